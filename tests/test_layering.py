"""The core's layering (``docs/design.md``, "Architecture"): no import cycle among the modules of
``src/paramupdates``, counting every import: module-level, inside functions, and under ``if
TYPE_CHECKING:`` (for annotations only, but a reader of a module must understand the classes it
names, so they must come from below); and nothing outside ``integrations/`` imports from
``integrations/`` except the package's ``__init__.py`` and the frameworks' public import paths.

A low module that names an object of a higher layer in its annotations takes it from
``paramupdates.seams``: a small ``Protocol`` of what it uses, or ``Any`` under the higher class's name.

Imports are read from the AST of every module. Importing ``a.b.c`` executes the ``__init__`` of ``a.b`` too, so that counts
as an import of ``a.b``, except from inside ``a.b`` itself (a package is initialised before its
modules). The top package ``paramupdates`` is the root that imports everything: not a target.
"""

from __future__ import annotations

import ast
from pathlib import Path

import paramupdates

SRC = Path(paramupdates.__file__).parent
TOP = "paramupdates"


def _module_name(path: Path, root: Path = SRC) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(test: ast.expr) -> bool:
    """Whether ``test`` (an ``if``'s) is ``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, modules: set[str], types: bool = False, root: Path = SRC) -> set[str]:
    """The paramupdates modules that executing ``path`` may import (function-level included); with
    ``types``, also those imported under ``if TYPE_CHECKING:`` (for annotations only)."""
    name = _module_name(path, root)
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
            if not types and isinstance(child, ast.If) and _type_checking(child.test):  # (its ``else:`` runs)
                visit(ast.Module(body=child.orelse, type_ignores=[]))
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


def _graph(types: bool = False, root: Path = SRC) -> dict[str, set[str]]:
    """The import graph of the package at ``root``: the runtime one, or with ``types`` the one that
    counts the imports under ``if TYPE_CHECKING:`` too."""
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(p, modules, types, root) for name, p in paths.items()}


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
    assert "paramupdates.attach" in g["paramupdates.step"]  # an import inside a function counts
    assert "paramupdates.seams" not in g["paramupdates.state"]  # one under TYPE_CHECKING does not
    assert "paramupdates.seams" in _graph(types=True)["paramupdates.state"]  # (but is read)


def test_no_import_cycle():
    """No cycle in the runtime import graph (module-level and function-level imports)."""
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_no_import_cycle_with_type_checking_imports():
    """No cycle either with the imports under ``if TYPE_CHECKING:`` counted: each module names only
    classes from below it (a seam takes a higher one's as a ``seams`` Protocol or ``Any``)."""
    cycle = _cycle(_graph(types=True))
    assert cycle is None, "import cycle (type-level imports counted): " + " -> ".join(cycle or [])


def test_seams_import_only_records():
    """``seams`` is below every module that takes a name from it: of the package, only ``records``."""
    assert _graph(types=True)[f"{TOP}.seams"] == {f"{TOP}.records"}


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_a_runtime_cycle_fails_and_a_type_checking_one_does_not(tmp_path):
    """The reader on a synthetic package: ``a`` imports ``b`` at module level; ``b`` imports ``a`` inside
    a function (a cycle at run time), under ``if TYPE_CHECKING:`` (none at run time, one at the type
    level, which ``test_no_import_cycle_with_type_checking_imports`` forbids), or in its ``else:`` (one)."""
    pkg = tmp_path / TOP
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    cycle = ["paramupdates.a", "paramupdates.b", "paramupdates.a"]
    b_imports_a = {
        "def f():\n    from .a import g\n": cycle,
        "import typing\nif typing.TYPE_CHECKING:\n    from .a import g\n": None,
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import g\n": None,
        "if TYPE_CHECKING:\n    pass\nelse:\n    from . import a\n": cycle,
    }
    for source, found in b_imports_a.items():
        (pkg / "b.py").write_text(source)
        assert _cycle(_graph(root=pkg)) == found, source
        assert _cycle(_graph(types=True, root=pkg)) is not None, source  # (the imports are read)


PUBLIC_PATHS = {f"{TOP}.lightning", f"{TOP}.returnn", f"{TOP}.transformers"}
"""The frameworks' public import paths: each is the module of ``integrations/`` under a shorter name."""


def test_only_the_package_init_imports_integrations():
    offenders = {
        name: sorted(m for m in deps if m.startswith(f"{TOP}.integrations"))
        for name, deps in _graph(types=True).items()
        if not name.startswith(f"{TOP}.integrations") and name != TOP and name not in PUBLIC_PATHS
    }
    assert {k: v for k, v in offenders.items() if v} == {}


STATE_HOMES = {f"{TOP}.state", f"{TOP}.hooks", f"{TOP}.nn.convert"}
"""Where module-level mutable state may live: the state module, the hook registries, the converter
registry. Everything else keeps its state in objects (a model's index, a rule, a registered hook)."""

_MUTABLE_CALLS = {
    "dict",
    "list",
    "set",
    "bytearray",
    "OrderedDict",
    "defaultdict",
    "deque",
    "Counter",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
    "WeakIdKeyDictionary",
    "local",
    "count",
}
_MUTABLE_NODES = (ast.Dict, ast.List, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)


def _module_state(tree: ast.Module) -> list[str]:
    """``name (line)`` of each module-level binding of a mutable container, and each ``global``."""
    found = []

    def is_mutable(value: ast.AST | None) -> bool:
        if isinstance(value, _MUTABLE_NODES):
            return True
        if isinstance(value, ast.Call):
            f = value.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            return name in _MUTABLE_CALLS
        return False

    def top(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [ast.unparse(t) for t in targets]
                if is_mutable(node.value) and names != ["__all__"]:
                    found.append(f"{', '.join(names)} (line {node.lineno})")
            elif isinstance(node, ast.If | ast.Try | ast.With):
                for block in ("body", "orelse", "finalbody"):
                    top(getattr(node, block, []))
                for handler in getattr(node, "handlers", []):
                    top(handler.body)

    top(tree.body)
    found += [f"global {', '.join(n.names)} (line {n.lineno})" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    return found


def test_module_level_state_lives_in_the_state_module_and_the_registries():
    offenders = {}
    for path in SRC.rglob("*.py"):
        name = _module_name(path)
        if name not in STATE_HOMES:
            found = _module_state(ast.parse(path.read_text()))
            if found:
                offenders[name] = found
    assert offenders == {}


def test_the_state_finder_finds_state():
    src = "import weakref\nX = {}\nY: list = []\nZ = weakref.WeakSet()\n__all__ = ['a']\nif True:\n    W = set()\n"
    src += "def f():\n    global X\n"
    assert _module_state(ast.parse(src)) == [
        "X (line 2)",
        "Y (line 3)",
        "Z (line 4)",
        "W (line 7)",
        "global X (line 9)",
    ]
