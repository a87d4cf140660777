"""Handles: how a custom operator names the ``ctx.ccl`` / ``ctx.ops`` object a call runs on.

Operators take tensors, numbers and strings only, so each such object (one per context, and
per group view) is registered under an int *handle*, kept as its ``_iris_handle`` (Dynamo reads
that attribute, guarding on its value, to call the operators). ``ctx.destroy()`` forgets its
context's handles: compiled code or a graph that names one then raises, saying so.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

from iris.errors import IrisError

__all__ = ["forget", "lookup", "register"]

#: Live ``ctx.ccl`` / ``ctx.ops`` objects by handle (weak: an object its context dropped goes away too).
_LIVE: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def register(target) -> int:
    """A new handle for ``target``, which keeps it as ``_iris_handle``."""
    handle = next(_HANDLES)
    _LIVE[handle] = target
    return handle


def lookup(handle: int):
    """The live object of ``handle``; an IrisError for a handle of a destroyed context."""
    target = _LIVE.get(int(handle))
    if target is None:
        raise IrisError(f"torch.ops.iris: handle {handle} names no live iris context (destroyed, or made in another "
                        f"process); compiled code and graphs must be rebuilt for a new context")
    return target


def forget(context) -> None:
    """Drop the handles of ``context``'s objects and of its group views' (``destroy()``)."""
    for handle, target in list(_LIVE.items()):
        owner = getattr(target, "_context", None)
        if owner is context or getattr(owner, "__dict__", {}).get("_world") is context:
            _LIVE.pop(handle, None)
