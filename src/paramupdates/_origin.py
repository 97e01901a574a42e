"""Call-site capture: the ``file:line`` of the user code that issued an update."""

from __future__ import annotations

import os
import sys

import torch

_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Modules built on the mechanism (pu.nn) are where their updates are issued:
# their lines are shown, not skipped.
_USER_SUBDIRS = tuple(_PKG_DIR + d + os.sep for d in ("nn",))
# The demo is user code that ships in the package: its lines are shown too.
_USER_FILES = (_PKG_DIR + "demo.py",)
_TORCH_DIR = os.path.dirname(os.path.abspath(sys.modules["torch"].__file__)) + os.sep
_CWD = os.getcwd() + os.sep
# Files of a framework between the user's line and paramupdates (e.g. RETURNN's
# ``rf.Parameter.assign``), registered by its integration: skipped like our own.
_FRAMEWORK_FILES: set[str] = set()


def register_internal_files(*paths: str) -> None:
    """Skip frames of these source files in :func:`call_site` (a framework's plumbing)."""
    _FRAMEWORK_FILES.update(os.path.abspath(p) for p in paths)


def _is_internal(filename: str) -> bool:
    if filename.startswith(_PKG_DIR):
        return not (filename.startswith(_USER_SUBDIRS) or filename in _USER_FILES)
    return ( filename.startswith(_TORCH_DIR)
        or filename.startswith("<frozen")
        or "contextlib.py" in filename
        or filename in _FRAMEWORK_FILES
    )


def _relative(name: str) -> str:
    return name[len(_CWD) :] if name.startswith(_CWD) else name


def call_site(depth: int = 2) -> str:
    """Return ``"file:line"`` of the first frame outside paramupdates and torch.

    Paths under the working directory are shown relative to it, so that a
    schedule printed by the same script is identical from run to run. While
    ``torch.compile`` traces, the frames are dynamo's, not the user's: the
    call site comes from dynamo's user stack instead (a trace-time constant).
    """
    if torch.compiler.is_compiling():
        from .integrations.compile import traced_call_site

        return traced_call_site()
    try:
        f = sys._getframe(depth)
    except ValueError:  # pragma: no cover - shallow stack
        return "<unknown>"
    first = f
    while f is not None and _is_internal(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        f = first
    return f"{_relative(f.f_code.co_filename)}:{f.f_lineno}"
