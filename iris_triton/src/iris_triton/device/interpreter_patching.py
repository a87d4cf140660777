"""Device-function calls in Triton's interpreter without patching ``triton.language`` again.

Triton's interpreter (CPU ranks) runs a launch with ``triton.language``'s builtins replaced by
interpreted ones (``_patch_lang``, undone when the launch ends), and repeats the patching at
every call of a ``@triton.jit`` device function inside the kernel: a walk over every member of
``tl``, ``tl.core``, ``tl.tensor`` and ``tl.math`` in which nothing is left to replace (what the
launch replaced is no longer a builtin). iris's kernels call device functions thousands of
times per launch, and the walks took about half of a collective's time on CPU ranks.

:func:`patch_language_once` makes such a call skip the walk when the language modules its
function sees were already patched for the launch in progress. A launch patches as before and
undoes it as before; a call whose function sees a module the launch did not patch patches it
as before (and, as before, that patch lasts).
"""

from __future__ import annotations

import functools
import inspect

import triton.language as tl
from triton.runtime import interpreter

__all__ = ["patch_language_once"]

#: The ids of the language modules patched for the launch in progress (empty between launches).
_patched: set[int] = set()


class _Unchanged:
    """The scope of a call that patched nothing: nothing to undo."""

    @staticmethod
    def restore() -> None:
        return None


class _LaunchScope:
    """A launch's patches; undoing them also ends the launch for :func:`patch_language_once`."""

    def __init__(self, scope):
        self._scope = scope

    def restore(self) -> None:
        _patched.clear()
        self._scope.restore()


#: Per module namespace (by id): its size when last read, and the ids of ``tl`` and ``tl.core`` in it.
_LANGUAGES: dict[int, tuple[int, frozenset[int]]] = {}


def _languages(fn) -> frozenset[int]:
    """The ids of the modules ``tl`` and ``tl.core`` among ``fn``'s globals (what the interpreter
    patches), read again when the namespace changed size."""
    namespace = fn.__globals__
    known = _LANGUAGES.get(id(namespace))
    if known is None or known[0] != len(namespace):
        known = len(namespace), frozenset(id(value) for value in namespace.values()
                                          if inspect.ismodule(value) and value in (tl, tl.core))
        _LANGUAGES[id(namespace)] = known
    return known[1]


def patch_language_once() -> None:
    """Replace the interpreter's ``_patch_lang`` by one that patches each language module once per
    launch (the module docstring says why). Idempotent."""
    original = interpreter._patch_lang
    if getattr(original, "patches_once", False):
        return

    @functools.wraps(original)
    def patch_lang(fn):
        languages = _languages(fn)
        if _patched and languages and languages <= _patched:
            return _Unchanged  # a device-function call inside a launch that patched its modules
        launch = not _patched
        scope = original(fn)
        _patched.update(languages)
        return _LaunchScope(scope) if launch else scope

    patch_lang.patches_once = True
    interpreter._patch_lang = patch_lang
