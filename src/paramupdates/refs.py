"""Weak references whose target's death is also a plain flag, for code a compiled step traces."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


class WatchedRef:
    """``weakref.ref(obj, callback)`` plus :attr:`gone`, a bool set when ``obj`` is collected.

    Calling it returns ``obj`` (or ``None``), as a weak reference does. :attr:`gone` answers "is it
    alive?" without touching ``obj``: inside ``torch.compile(optimizer.step)``, reading a module
    makes dynamo wrap it, and wrapping a module marks its parameters as *unguarded* static inputs,
    which then cost a full tensor guard (``TENSOR_MATCH``) each in every frame of the commit, where
    the compiled optimizer's own marking (*guarded*: one identity check) would do.
    """

    __slots__ = ("__weakref__", "gone", "ref")

    def __init__(self, obj: Any, callback: Callable[[Any], None] | None = None) -> None:
        self.gone = False
        me = weakref.ref(self)

        def died(ref: Any) -> None:
            watched = me()
            if watched is not None:
                watched.gone = True
            if callback is not None:
                callback(ref)

        self.ref = weakref.ref(obj, died)

    def __call__(self) -> Any:
        return self.ref()
