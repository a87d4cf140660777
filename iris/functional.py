"""Functional collectives and fused operations: each returns new tensors and leaves its inputs
unchanged, as torch's ``torch.distributed._functional_collectives`` do.

This is the traceable spelling for ``torch.compile``: every function is one custom operator
(``torch.ops.iris.<name>``, :mod:`iris.calls.operators`), so the compiled graph has no break and
the compiler sees a pure function of its inputs::

    import iris.functional as F

    @torch.compile(fullgraph=True)
    def layer(x, w1, w2):
        h = F.all_gather_matmul(x, w1, ctx)          # (world * m) x N
        return F.all_reduce(torch.relu(h) @ w2, ctx)

There is one function per call of ``ctx.ccl`` and ``ctx.ops``, made from its declaration
(:mod:`iris.calls.declarations`): the method's arguments but the outputs it can make itself
(``all_gather`` makes its output from its input; ``recv`` takes a tensor of the shape to
receive), with ``ctx`` after the leading tensors, the method's ``algorithm=`` / ``method=``, and
``group=``. ``ctx`` is a context (its collectives with torch.distributed's conventions, and its
``ops``), or a ``ctx.ccl`` / ``ctx.ops`` object. Functional ``all_gather`` stacks along dim 0
(``(world * d0, ...)``) and ``reduce_scatter`` splits dim 0, as torch's ``all_gather_tensor`` /
``reduce_scatter_tensor`` do. The in-place methods compile too; these functions are for code
written in the functional style.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from iris.calls.declarations import DECLARATIONS, REQUIRED, Declaration
from iris.calls.operators import functional_params


def _target(ctx, namespace: str, group):
    """The ``ctx.ccl`` / ``ctx.ops`` object that runs a call of ``ctx`` with ``group=``."""
    is_context = hasattr(ctx, "_torch_ccl")
    if namespace == "ccl":
        target = ctx._torch_ccl if is_context else ctx
    else:
        target = ctx.ops if is_context else ctx
        target = getattr(target, "_ops", target)  # a context with upstream's conventions wraps its ops
    return target if group is None else target._for_group(group)


def _function(declaration: Declaration) -> Callable:
    """``iris.functional.<name>`` of ``declaration``."""
    params = {param.name: param for param in declaration.params}
    names = ["ctx" if name == "handle" else name for name, _ in functional_params(declaration)]
    keyword_only = {name for name in names if name in params and params[name].keyword_only}
    positional = [name for name in names if name not in keyword_only]
    defaults = {name: params[name].default for name in names
                if name in params and params[name].default is not REQUIRED}
    defaults.update({name: False for name in names if name.startswith("keep_")})
    converts = {name: params[name].convert for name in names if name in params and params[name].convert}
    operator = getattr(torch.ops.iris, declaration.name)

    def function(*args, group=None, **kwargs):
        values = dict(defaults)
        values.update(zip(positional, args))
        values.update(kwargs)
        for name, convert in converts.items():
            values[name] = convert(values[name])
        target = _target(values["ctx"], declaration.namespace, group)
        return operator(*[target._iris_handle if name == "ctx" else values[name] for name in names])

    kind = inspect.Parameter
    function.__signature__ = inspect.Signature(
        [kind(name, kind.KEYWORD_ONLY if name in keyword_only else kind.POSITIONAL_OR_KEYWORD,
              default=defaults.get(name, kind.empty)) for name in names]
        + [kind("group", kind.KEYWORD_ONLY, default=None)])
    function.__name__ = function.__qualname__ = declaration.name
    function.__module__ = __name__
    function.__doc__ = (f"{declaration.summary}\n\nThe functional form of ``ctx.{declaration.namespace}."
                        f"{declaration.name}`` (``torch.ops.iris.{declaration.name}``).")
    return function


globals().update({name: _function(declaration) for name, declaration in DECLARATIONS.items()})
__all__ = sorted(DECLARATIONS)
