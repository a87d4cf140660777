"""``@declared``: what every public method of ``ctx.ccl`` and ``ctx.ops`` does before its own code.

A declared method (its :class:`~iris.calls.declarations.Declaration` found by its name) also
takes ``group=`` (the call runs on ``self._for_group(group)``: :mod:`iris.collectives.groups`)
and ``async_op=`` (a :mod:`iris.calls.work` handle is returned), under ``torch.compile`` it
calls its functional operator (:func:`iris.calls.operators.compiled_call`) instead of its own
code, so the compiled graph has no break; and a call identical to an earlier one runs that
call's repeat, if it offered one, before anything else (:mod:`iris.calls.repeats`; the method's
entry is written for its declaration, :mod:`iris.calls.entries`, to find it in few steps). The
undecorated method is ``__wrapped__``: what the operators run. Its signature must be the
declared one (checked when the class is defined), so the two cannot drift apart.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from iris.calls.declarations import DECLARATIONS, REQUIRED, Declaration
from iris.calls.entries import entry, keyer
from iris.calls.operators import compiled_call
from iris.calls.work import CompletedWork, run_async
from iris.errors import IrisError

__all__ = ["declared"]


def _check_signature(method, declaration: Declaration) -> None:
    """Raise TypeError when ``method``'s parameters (after ``self``; a ``**keywords`` catch-all
    aside) are not the declaration's: names, order, defaults and keyword-only ones."""
    actual = [(p.name, p.default, p.kind == p.KEYWORD_ONLY)
              for p in list(inspect.signature(method).parameters.values())[1:] if p.kind != p.VAR_KEYWORD]
    declared_params = [(p.name, inspect.Parameter.empty if p.default is REQUIRED else p.default, p.keyword_only)
                       for p in declaration.params]
    if actual != declared_params:
        raise TypeError(f"{method.__qualname__}: its parameters {actual} are not those of its declaration "
                        f"{declared_params} (iris.calls.declarations); change both together")


def _group_target(target, group):
    """The ``ctx.ccl`` / ``ctx.ops`` object of ``group`` (``target._for_group(group)``)."""
    for_group = getattr(target, "_for_group", None)
    if for_group is None:
        raise IrisError(f"{type(target).__name__}: group= is not supported by this context yet; pass group=None "
                        f"(the whole world)")
    return for_group(group)


def _returned(declaration: Declaration) -> Callable[[tuple, dict], Any]:
    """What the method returns, from a call's arguments: the declared parameter (or None)."""
    if declaration.returns is None:
        return lambda args, kwargs: None
    name = declaration.returns
    index = [p.name for p in declaration.params].index(name)
    default = declaration.params[index].default
    return lambda args, kwargs: args[index] if index < len(args) else kwargs.get(name, default)


def declared(method):
    """Decorate the public method of a declared call (:data:`~iris.calls.declarations.DECLARATIONS`,
    by the method's name): ``group=``, ``async_op=``, ``torch.compile`` and repeated calls as this
    module says."""
    declaration = DECLARATIONS[method.__name__]
    _check_signature(method, declaration)
    compiled = compiled_call(declaration)
    name, returned, keyed = method.__name__, _returned(declaration), keyer(declaration)

    def in_full(self, args: tuple, kwargs: dict, group, async_op: bool):
        if group is not None:
            return getattr(_group_target(self, group), name)(*args, async_op=async_op, **kwargs)
        if torch.compiler.is_compiling():
            result = compiled(self, args, kwargs)
            return CompletedWork(result) if async_op else result
        repeats = self._repeats
        if async_op:
            def make():
                return repeats.call(declaration, method, self, args, kwargs, returned, keyed)

            return run_async(self._context.device, make, (*args, *kwargs.values()))
        return repeats.call(declaration, method, self, args, kwargs, returned, keyed)

    call = functools.wraps(method)(entry(declaration, in_full))
    call.__iris_operator__ = declaration.name
    return call
