"""Call sites: the ``file:line`` of the user code that issued an update or declared a rule.

:func:`capture` is on the path of every update, so it is cheap: it walks the
frames to the first one outside paramupdates and torch (the verdict per file
is cached) and keeps ``(filename, line)``; the text is made only when
shown (an error, ``schedule()``). An update that a module issues from its
forward (``pu.nn``'s batch norm statistics) has as call site the user's line
that called the module: the frames of ``pu.nn`` and ``torch.nn`` between the
two are skipped like any other of paramupdates' and torch's, and the origin
says what the module updated (:attr:`Origin.by`), so that messages name it in
the user's terms (:func:`issued`). Paths under the working directory are shown
relative to it, so that a schedule printed by the same script is the same
from run to run. While ``torch.compile`` traces, the frames are dynamo's: the
registered tracing support (``hooks.register_tracing_support``) gives the
user's call site as a trace-time constant string instead.
"""

from __future__ import annotations

import os
import sys

import torch

from . import hooks, state

_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# The demo is user code that ships in the package: its lines are shown (every other file of the
# package is skipped, pu.nn's modules included: their updates show the line that called the module).
_USER_FILES = (_PKG_DIR + "demo.py",)
_TORCH_DIR = os.path.dirname(os.path.abspath(sys.modules["torch"].__file__)) + os.sep
_CWD = os.getcwd() + os.sep


def is_internal(filename: str) -> bool:
    """Whether frames of ``filename`` are skipped when looking for the user's call site."""
    if filename.startswith(_PKG_DIR):
        return filename not in _USER_FILES
    return (
        filename.startswith(_TORCH_DIR)
        or filename.startswith("<frozen")
        or "contextlib.py" in filename
        or filename in hooks.internal_files  # a framework's plumbing (hooks.register_internal_files)
    )


def relative(filename: str) -> str:
    """``filename`` relative to the working directory when it lies under it."""
    return filename[len(_CWD) :] if filename.startswith(_CWD) else filename


def _forget_verdicts() -> None:
    state.process.internal_by_file.clear()


hooks.internal_files_changed.append(_forget_verdicts)


class Shown:
    """A text made when first shown (``str()``, an f-string, a comparison), then kept: what is made on
    every update or step and seldom shown (a call site, a step's name) costs no formatting."""

    __slots__ = ("_text",)

    def __init__(self) -> None:
        self._text: str | None = None

    def _make(self) -> str:
        raise NotImplementedError

    def __str__(self) -> str:
        if self._text is None:
            self._text = self._make()
        return self._text

    def __repr__(self) -> str:
        return str(self)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __eq__(self, other: object) -> bool:
        return str(self) == str(other) if isinstance(other, Shown | str) else NotImplemented

    def __hash__(self) -> int:
        return hash(str(self))


class Origin(Shown):
    """Where an update was issued: shown as ``file:line``.

    ``by``: for an update a module issued from its forward, what the module updated, in the user's
    terms (``"BatchNorm2d running statistics"``); the line is then the user's call of the module."""

    __slots__ = ("file", "line", "by")

    def __init__(self, file: str, line: int, by: str | None = None) -> None:
        self._text = None  # (not super().__init__(): one made per update)
        self.file = file
        self.line = line
        self.by = by

    def _make(self) -> str:
        return f"{relative(self.file)}:{self.line}"


class Label(Shown):
    """``"<what> at <file:line>"``: how messages name a step (a ``pu.step`` block opens one per
    iteration; most are never shown)."""

    __slots__ = ("what", "origin")

    def __init__(self, what: str, origin: Origin | str) -> None:
        self._text = None
        self.what = what
        self.origin = origin

    def _make(self) -> str:
        return f"{self.what} at {self.origin}"


def capture(depth: int = 2, compiling: bool | None = None, by: str | None = None) -> Origin | str:
    """The call site of the first frame (from ``depth`` up) outside paramupdates and torch.

    Returns an :class:`Origin` (formatted when shown; ``by``: see :class:`Origin`), or a string
    while dynamo traces.
    """
    if compiling if compiling is not None else torch.compiler.is_compiling():
        support = hooks.tracing()
        return support.call_site() if support is not None else "<compiled>"
    try:
        f = sys._getframe(depth)
    except ValueError:  # pragma: no cover - shallow stack
        return "<unknown>"
    first = f
    cache = state.process.internal_by_file
    while f is not None:
        # keyed by the file name (a str caches its hash), not the code object: hashing a code object
        # hashes its bytecode and constants, 1.5 us for Module._call_impl, every time
        file = f.f_code.co_filename
        internal = cache.get(file)
        if internal is None:
            if len(cache) >= 4096:  # the files of re-run notebook cells: keep the cache bounded
                cache.clear()
            internal = cache[file] = is_internal(file)
        if not internal:
            o = _new(Origin)  # (Origin(file, f.f_lineno, by) without a call into its __init__: every update makes one)
            o._text, o.file, o.line, o.by = None, file, f.f_lineno, by
            return o
        f = f.f_back
    return Origin(first.f_code.co_filename, first.f_lineno, by)


_new = object.__new__


def issued(op: str, name: str, origin: Origin | str) -> str:
    """How a message names one update: ``pu.assign on 'w' at train.py:3``; for an update a module
    issued from its forward (``origin.by``), in the user's terms, since the user never called
    ``pu.assign``: ``the update of '4.running_mean' (BatchNorm2d running statistics) by the call of
    the module at train.py:3``."""
    by = getattr(origin, "by", None)
    if by is None:
        return f"pu.{op} on {name!r} at {origin}"
    return f"the update of {name!r} ({by}) by the call of the module at {origin}"


def user_stacklevel() -> int:
    """The ``stacklevel`` of a ``warnings.warn`` called by the caller that points at the first frame
    outside paramupdates and torch (the user's line)."""
    frame = sys._getframe(2)
    level = 2
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    return level


def call_site(depth: int = 2) -> str:
    """``"file:line"`` of the first frame (from ``depth`` up) outside paramupdates and torch."""
    return str(capture(depth + 1))
