"""Repeats: what a repeated eager call costs is its launches and a few checks.

A call of ``ctx.ccl`` or ``ctx.ops`` identical to an earlier one (the same method, the same
tensors by address, shape, strides, dtype and device, the same other arguments) would pass the
same checks, make the same choices and prepare the same launch as the earlier one did. Where the
earlier call's device work was one launch (or a fixed sequence of launches) that can be enqueued
again with the same arguments, its *repeat* (:meth:`iris_triton.device.frontend.Frontend.launch`),
the method *offers* it (:func:`offer`); the decorator of the public method
(:func:`iris.calls.routing.declared`) keeps it in the method's object (:class:`Repeats`), under
the call's key. An identical call later finds it before anything else runs and enqueues it
inside the least of the fail-stop guard (``ctx._run_repeat``): refused from a second thread and
on a failed context, as every call is.

A repeat launches with the addresses of the earlier call's tensors and workspaces, and with its
choices. Every repeat of every context is forgotten (:func:`invalidate`) whenever any may be
stale: a workspace replaced, a registry of plugins changed (the automatic choice may differ),
tracing switched (kernels are compiled otherwise), tuning applied, a context destroyed, a call's
description dropped (a repeat would then run a call its errors could not name). Those are rare:
the kept repeats are emptied then, and a call checks nothing for it. Under the Triton
interpreter kernels have no repeat: every call there runs in full.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from typing import Any, Callable

from iris.calls.declarations import DECLARATIONS
from iris.calls.entries import guard, keyer

__all__ = ["MAX_REPEATS", "Kept", "Repeats", "generation", "invalidate", "offer", "taking_stream"]

#: Most repeats an object keeps (the oldest is dropped first); each is a key and a callable.
MAX_REPEATS = 256

#: Bumped by :func:`invalidate`: a plan kept before it is not used (MoE's plans compare it).
_generation = 0

#: Every :class:`Kept` alive, emptied together by :func:`invalidate` (added to and read under
#: :data:`_ALL_KEPT_LOCK`: contexts may be made and repeats forgotten from several threads).
_ALL_KEPT: weakref.WeakSet = weakref.WeakSet()
_ALL_KEPT_LOCK = threading.Lock()

#: Marks a call that offered more than one repeat: none of them is all of its work.
_SEVERAL = object()


def generation() -> int:
    """A number that changes whenever every repeat is forgotten (:func:`invalidate`), for whoever
    keeps launches of their own (MoE's plans)."""
    return _generation


def invalidate() -> None:
    """Forget every repeat kept so far, in every context (something they depend on changed)."""
    global _generation
    with _ALL_KEPT_LOCK:
        _generation += 1
        every = list(_ALL_KEPT)
    for kept in every:
        kept.by_key.clear()


def taking_stream(repeat: Callable | None) -> Callable[[int], Any] | None:
    """``repeat`` as a callable of the raw stream: a repeat of no parameters (a collective
    algorithm's, written before repeats were handed the stream) is wrapped to be called without
    it, launching on the current stream as it does."""
    function = getattr(repeat, "__func__", repeat)
    code = getattr(function, "__code__", None)
    own = 1 if function is not repeat else 0  # a bound method's parameters count its self
    if code is None or code.co_flags & inspect.CO_VARARGS or code.co_argcount > own:
        return repeat  # takes the stream (or is None, or a callable this cannot read: as it is)
    return lambda stream: repeat()


class _Offered:
    """What one call in progress offered (a slot on its context's stack of calls)."""

    __slots__ = ("repeat",)

    def __init__(self):
        self.repeat = None


def offer(context, repeat: Callable[[int], None] | None) -> None:
    """Offer ``repeat`` as all of the device work of the public call now in progress on
    ``context``: it enqueues that work again, on the raw stream it is handed, for an identical call.
    A call that offers twice is kept by neither offer (each is only part of its work); a call
    made by another call offers to the inner one. None: nothing to offer."""
    calls = context._calls_offering
    if repeat is not None and calls:
        slot = calls[-1]
        slot.repeat = repeat if slot.repeat is None else _SEVERAL


class Kept:
    """Values kept by key, at most ``limit`` (the oldest is dropped first), while the repeats are
    valid: :func:`invalidate` empties every one (repeats, MoE's plans)."""

    __slots__ = ("_limit", "by_key", "__weakref__")

    def __init__(self, limit: int):
        self._limit = limit
        #: What is kept, by key: emptied in place, never replaced, so a caller may hold it.
        self.by_key: dict = {}
        with _ALL_KEPT_LOCK:
            _ALL_KEPT.add(self)

    def keep(self, key, value) -> None:
        by_key = self.by_key
        if len(by_key) >= self._limit:
            by_key.pop(next(iter(by_key), None), None)  # None: emptied meanwhile by invalidate()
        by_key[key] = value


class Repeats:
    """The repeats of one ``ctx.ccl`` / ``ctx.ops`` object's calls, by their keys."""

    __slots__ = ("_context", "_kept", "by_key")

    def __init__(self, context):
        self._context = context
        self._kept = Kept(MAX_REPEATS)
        #: ``(repeat, trace name, guard)`` by the call's key (:func:`iris.calls.entries.keyer`):
        #: the guard checks the call's tensors; ``ctx._run_repeat(repeat, trace name)`` makes the
        #: call. Looked up by the methods' entries (:mod:`iris.calls.entries`).
        self.by_key = self._kept.by_key

    def __len__(self) -> int:
        return len(self.by_key)

    def kept(self, name: str, *args, **kwargs) -> Callable[[], None] | None:
        """The repeat kept for the call ``name(*args, **kwargs)``, if any, as a callable that
        launches it on the current stream (what a benchmark launches bare, beside the call)."""
        key, tensors = keyer(DECLARATIONS[name])(*args, **kwargs)
        found = self.by_key.get(key)
        if found is None or not found[2](*tensors):
            return None
        repeat, current_stream = found[0], self._context._current_stream
        return lambda: repeat(current_stream())

    def call(self, declaration, method: Callable, target, args: tuple, kwargs: dict,
             returned: Callable[[tuple, dict], Any], keyed: Callable[..., tuple]):
        """``method(target, *args, **kwargs)``, the call of ``declaration`` in full, keeping the
        repeat it offers (:func:`offer`) under the call's key (``keyed``:
        :func:`iris.calls.entries.keyer`) where the method returned what ``returned(args,
        kwargs)`` gives (what a call made by the repeat returns)."""
        context = self._context
        calls = context._calls_offering
        slot = _Offered()
        calls.append(slot)
        try:
            made = method(target, *args, **kwargs)
        finally:
            calls.remove(slot)
        repeat = slot.repeat
        if repeat is None or repeat is _SEVERAL or context.config.debug or made is not returned(args, kwargs):
            return made  # debug mode: every call is checked in full
        try:
            key, tensors = keyed(*args, **kwargs)
            hash(key)
        except (TypeError, AttributeError, RuntimeError):  # an argument that cannot be part of a key: never kept
            return made
        # After the call, which may have replaced a workspace.
        self._kept.keep(key, (repeat, declaration.trace_name, guard(tensors)))
        return made
