"""The core's layering (``docs/design.md``, "Architecture"): no import cycle among the modules of
``src/paramupdates``, counting imports inside functions, and nothing outside ``integrations/``
imports from ``integrations/`` except the package's ``__init__.py``.

Imports are read from the AST of every module; those under ``if TYPE_CHECKING:`` never execute
and are not counted. Importing ``a.b.c`` executes the ``__init__`` of ``a.b`` too, so that counts
as an import of ``a.b``, except from inside ``a.b`` itself (a package is initialised before its
modules). The top package ``paramupdates`` is the root that imports everything: not a target.
"""

from __future__ import annotations

import ast
from pathlib import Path

import paramupdates

SRC = Path(paramupdates.__file__).parent
TOP = "paramupdates"


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The paramupdates modules that executing ``path`` may import (function-level included)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}

    def add(target: str) -> None:
        # the module itself and every package __init__ on the way, but the module's own
        # packages: they are initialised before any of their modules is imported
        parts = target.split(".")
        for i in range(2, len(parts) + 1):
            cand = ".".join(parts[:i])
            if cand in modules and cand != name and cand not in ancestors:
                found.add(cand)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.startswith(TOP + "."):
                        add(a.name)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                if not mod.startswith(TOP):
                    continue
                add(mod)
                for a in child.names:  # "from . import x": x may be a submodule
                    add(f"{mod}.{a.name}")
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in SRC.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(p, modules) for name, p in paths.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a path a -> ... -> a), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if m == TOP:
                continue
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = dfs(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = dfs(n)
            if found:
                return found
    return None


def test_the_graph_is_read():
    """The reader sees the edges it must (a broken reader would make the test below pass vacuously)."""
    g = _graph()
    assert "paramupdates.journal" in g["paramupdates.updates"]
    assert "paramupdates.hooks" in g["paramupdates.integrations.checkpoint"]
    assert "paramupdates.integrations" in g[TOP]
    assert "paramupdates.commit" not in g["paramupdates.rules.base"]  # a TYPE_CHECKING import only


def test_no_import_cycle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


PUBLIC_PATHS = {f"{TOP}.lightning", f"{TOP}.returnn", f"{TOP}.transformers"}
"""The frameworks' public import paths: each is the module of ``integrations/`` under a shorter name."""


def test_only_the_package_init_imports_integrations():
    offenders = {
        name: sorted(m for m in deps if m.startswith(f"{TOP}.integrations"))
        for name, deps in _graph().items()
        if not name.startswith(f"{TOP}.integrations") and name != TOP and name not in PUBLIC_PATHS
    }
    assert {k: v for k, v in offenders.items() if v} == {}
