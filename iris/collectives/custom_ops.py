"""iris's collectives and fused operations as PyTorch custom operators (``torch.ops.iris.*``),
so that programs using them compile with ``torch.compile(fullgraph=True)`` and replay in CUDA
graphs.

Dynamo cannot trace the methods' own code (their fail-stop guard takes a lock, the algorithms'
launch records are attrs classes, kernels launch through Triton's Python), so every public
method of ``ctx.ccl`` (:class:`iris.mixins.ccl.Collectives`) and ``ctx.ops``
(:class:`iris_triton.operations.fused_ops.FusedOps`) carries one decorator, :func:`traceable`: while
``torch.compiler.is_compiling()``, the call goes to its custom operator instead, which the graph
records as one opaque call with a fake (meta) implementation for shapes. Each collective has
two operators, as torch's ``_functional_collectives``:

- an in-place one named with a trailing underscore (``torch.ops.iris.all_reduce_``,
  ``all_gather_matmul_``), which mutates its tensor or its ``out`` (``mutates_args``) and returns
  nothing;
- a functional one (``torch.ops.iris.all_reduce``, ``all_gather_matmul``) that returns new
  tensors and carries an ordered effect, so that a compiled graph keeps every iris call in
  program order (the ranks must make them in the same order): what the methods route to (the
  result copied into their output), spelled :mod:`iris.functional` for programs.

Operators take tensors, ints and strs only: the collectives object is named by an int *handle*
into a registry of live :class:`Collectives` / :class:`FusedOps` objects (one per context, and
per group view), removed when their context is destroyed (:func:`forget`).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from iris.collectives.algorithms import reduce_op_name
from iris.errors import IrisError
from iris.collectives.work import CompletedWork, run_async

__all__ = ["forget", "handle_of", "lookup", "register", "traceable"]

NAMESPACE = "iris"

#: Live collectives objects by handle (weak: an object its context dropped goes away too).
_LIVE: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


# -- the registry of handles ------------------------------------------------------------------------------


def register(target) -> int:
    """A new handle for ``target`` (a Collectives or FusedOps object), which keeps it as
    ``_iris_handle``: Dynamo reads that attribute (guarding on its value) to call the operators."""
    handle = next(_HANDLES)
    _LIVE[handle] = target
    return handle


def handle_of(target) -> int:
    """``target``'s handle (its ``_iris_handle``)."""
    return target._iris_handle


def lookup(handle: int):
    """The live object of ``handle``; an IrisError for a handle of a destroyed context."""
    target = _LIVE.get(int(handle))
    if target is None:
        raise IrisError(f"torch.ops.{NAMESPACE}: handle {handle} names no live iris context (destroyed, or made in "
                        f"another process); compiled code and graphs must be rebuilt for a new context")
    return target


def forget(context) -> None:
    """Drop the handles of ``context``'s objects and of its group views' (``destroy()``)."""
    for handle, target in list(_LIVE.items()):
        owner = getattr(target, "_context", None)
        if owner is context or getattr(owner, "__dict__", {}).get("_world") is context:
            _LIVE.pop(handle, None)


def _eager(handle: int, name: str) -> Callable:
    """The undecorated method ``name`` of ``handle``'s object, bound (what the operators run)."""
    target = lookup(handle)
    return getattr(type(target), name).__wrapped__.__get__(target)


def _world_size(handle: int) -> int:
    return lookup(handle)._context.world_size


def _dense(tensor: Tensor) -> Tensor:
    """A new contiguous tensor like ``tensor`` (a functional operator's output)."""
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _custom_op(name: str, mutates_args: tuple = ()):
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates_args)


def _no_result(*args, **kwargs) -> None:
    """The fake implementation of an in-place operator: it mutates, and returns nothing."""
    return None


def _in_place(name: str, mutates_args: tuple):
    """Register ``fn`` as the in-place operator ``name`` (fake: nothing to compute)."""

    def register_op(fn):
        op = _custom_op(name, mutates_args)(fn)
        op.register_fake(_no_result)
        return op

    return register_op


# -- collectives: in-place operators ----------------------------------------------------------------------


@_in_place("all_reduce_", ("tensor",))
def all_reduce_(tensor: Tensor, handle: int, op: str, algorithm: Optional[str]) -> None:
    _eager(handle, "all_reduce")(tensor, op, algorithm=algorithm)


@_in_place("all_gather_", ("output",))
def all_gather_(output: Tensor, input: Tensor, handle: int, algorithm: Optional[str]) -> None:
    _eager(handle, "all_gather")(output, input, algorithm=algorithm)


@_in_place("reduce_scatter_", ("output",))
def reduce_scatter_(output: Tensor, input: Tensor, handle: int, op: str, algorithm: Optional[str]) -> None:
    _eager(handle, "reduce_scatter")(output, input, op, algorithm=algorithm)


@_in_place("all_to_all_", ("output",))
def all_to_all_(output: Tensor, input: Tensor, handle: int, algorithm: Optional[str]) -> None:
    _eager(handle, "all_to_all")(output, input, algorithm=algorithm)


@_in_place("broadcast_", ("tensor",))
def broadcast_(tensor: Tensor, handle: int, src: int, algorithm: Optional[str]) -> None:
    _eager(handle, "broadcast")(tensor, src, algorithm=algorithm)


@_in_place("reduce_", ("tensor",))
def reduce_(tensor: Tensor, handle: int, dst: int, op: str, algorithm: Optional[str]) -> None:
    _eager(handle, "reduce")(tensor, dst, op, algorithm=algorithm)


@_in_place("gather_", ("output",))
def gather_(output: Optional[Tensor], input: Tensor, handle: int, dst: int, algorithm: Optional[str]) -> None:
    _eager(handle, "gather")(output, input, dst, algorithm=algorithm)


@_in_place("scatter_", ("output",))
def scatter_(output: Tensor, input: Optional[Tensor], handle: int, src: int, algorithm: Optional[str]) -> None:
    _eager(handle, "scatter")(output, input, src, algorithm=algorithm)


@_in_place("recv_", ("tensor",))
def recv_(tensor: Tensor, handle: int, src: int, algorithm: Optional[str]) -> None:
    _eager(handle, "recv")(tensor, src, algorithm=algorithm)


@_in_place("all_to_all_single_", ("output",))
def all_to_all_single_(output: Tensor, input: Tensor, handle: int, output_split_sizes: Optional[list[int]],
                       input_split_sizes: Optional[list[int]], algorithm: Optional[str]) -> None:
    _eager(handle, "all_to_all_single")(output, input, output_split_sizes, input_split_sizes, algorithm=algorithm)


@_in_place("all_to_all_vdev_", ("output", "output_splits"))
def all_to_all_vdev_(output: Tensor, input: Tensor, input_splits: Tensor, output_splits: Tensor, handle: int,
                     algorithm: Optional[str]) -> None:
    _eager(handle, "all_to_all_vdev")(output, input, input_splits, output_splits, algorithm=algorithm)


@_custom_op("send")
def send(tensor: Tensor, handle: int, dst: int, algorithm: Optional[str]) -> None:
    _eager(handle, "send")(tensor, dst, algorithm=algorithm)


@_custom_op("barrier")
def barrier(handle: int) -> None:
    _eager(handle, "barrier")()


send.register_fake(_no_result)  # nothing flows out of these two: their effect (below) keeps them in the graph
barrier.register_fake(_no_result)


# -- collectives: functional operators --------------------------------------------------------------------


def _gathered(input: Tensor, world: int) -> Tensor:
    """What an all-gather of ``input`` returns: the ranks' inputs stacked along dim 0."""
    shape = (world * input.shape[0], *input.shape[1:]) if input.dim() else (world,)
    return input.new_empty(shape)


def _scattered(name: str, input: Tensor, world: int) -> Tensor:
    """What a reduce-scatter of ``input`` returns: this rank's share of dim 0."""
    if input.dim() == 0 or input.shape[0] % world:
        raise IrisError(f"{name}: the functional form splits dim 0 among the ranks; input has shape "
                        f"{tuple(input.shape)}, whose dim 0 is not divisible by the world size {world}. Pad it, or "
                        f"call the in-place form with an output of input.numel() / world_size elements")
    return input.new_empty((input.shape[0] // world, *input.shape[1:]))


@_custom_op("all_reduce")
def all_reduce(tensor: Tensor, handle: int, op: str, algorithm: Optional[str]) -> Tensor:
    result = _dense(tensor).copy_(tensor)
    all_reduce_(result, handle, op, algorithm)
    return result


@_custom_op("all_gather")
def all_gather(input: Tensor, handle: int, algorithm: Optional[str]) -> Tensor:
    result = _gathered(input, _world_size(handle))
    all_gather_(result, input, handle, algorithm)
    return result


@_custom_op("reduce_scatter")
def reduce_scatter(input: Tensor, handle: int, op: str, algorithm: Optional[str]) -> Tensor:
    result = _scattered("reduce_scatter", input, _world_size(handle))
    reduce_scatter_(result, input, handle, op, algorithm)
    return result


@_custom_op("all_to_all")
def all_to_all(input: Tensor, handle: int, algorithm: Optional[str]) -> Tensor:
    result = _dense(input)
    all_to_all_(result, input, handle, algorithm)
    return result


@_custom_op("broadcast")
def broadcast(tensor: Tensor, handle: int, src: int, algorithm: Optional[str]) -> Tensor:
    result = _dense(tensor).copy_(tensor)
    broadcast_(result, handle, src, algorithm)
    return result


@_custom_op("reduce")
def reduce(tensor: Tensor, handle: int, dst: int, op: str, algorithm: Optional[str]) -> Tensor:
    result = _dense(tensor).copy_(tensor)
    reduce_(result, handle, dst, op, algorithm)
    return result


def _received(input: Tensor, output_split_sizes: Optional[list[int]]) -> Tensor:
    """What an all_to_all_single of ``input`` returns: the rows received, in rank order."""
    if output_split_sizes is None:
        return _dense(input)
    return input.new_empty((sum(output_split_sizes), *input.shape[1:]))


@_custom_op("all_to_all_single")
def all_to_all_single(input: Tensor, handle: int, output_split_sizes: Optional[list[int]],
                      input_split_sizes: Optional[list[int]], algorithm: Optional[str]) -> Tensor:
    result = _received(input, output_split_sizes)
    all_to_all_single_(result, input, handle, output_split_sizes, input_split_sizes, algorithm)
    return result


def _gathered_on(input: Tensor, handle: int, dst: int) -> Tensor:
    """What a gather returns: on rank ``dst`` the ranks' inputs stacked along dim 0, elsewhere
    an empty tensor."""
    target = lookup(handle)._context
    return _gathered(input, target.world_size) if target.rank == dst else input.new_empty((0,))


@_custom_op("gather")
def gather(input: Tensor, handle: int, dst: int, algorithm: Optional[str]) -> Tensor:
    result = _gathered_on(input, handle, dst)
    gather_(result if result.numel() else None, input, handle, dst, algorithm)
    return result


@_custom_op("scatter")
def scatter(output_like: Tensor, input: Optional[Tensor], handle: int, src: int, algorithm: Optional[str]) -> Tensor:
    result = _dense(output_like)
    scatter_(result, input, handle, src, algorithm)
    return result


@_custom_op("recv")
def recv(like: Tensor, handle: int, src: int, algorithm: Optional[str]) -> Tensor:
    result = _dense(like)
    recv_(result, handle, src, algorithm)
    return result


@_custom_op("all_to_all_vdev")
def all_to_all_vdev(output: Tensor, input: Tensor, input_splits: Tensor, handle: int,
                    algorithm: Optional[str]) -> tuple[Tensor, Tensor]:
    received, splits = _dense(output).copy_(output), _dense(input_splits)
    all_to_all_vdev_(received, input, input_splits, splits, handle, algorithm)
    return received, splits


all_reduce.register_fake(lambda tensor, handle, op, algorithm: _dense(tensor))
gather.register_fake(lambda input, handle, dst, algorithm: _gathered_on(input, handle, dst))
scatter.register_fake(lambda output_like, input, handle, src, algorithm: _dense(output_like))
recv.register_fake(lambda like, handle, src, algorithm: _dense(like))
all_to_all_vdev.register_fake(lambda output, input, input_splits, handle, algorithm: (_dense(output),
                                                                                      _dense(input_splits)))
reduce.register_fake(lambda tensor, handle, dst, op, algorithm: _dense(tensor))
all_to_all_single.register_fake(lambda input, handle, output_split_sizes, input_split_sizes, algorithm:
                                _received(input, output_split_sizes))
all_gather.register_fake(lambda input, handle, algorithm: _gathered(input, _world_size(handle)))
reduce_scatter.register_fake(lambda input, handle, op, algorithm: _scattered("reduce_scatter", input,
                                                                             _world_size(handle)))
all_to_all.register_fake(lambda input, handle, algorithm: _dense(input))
broadcast.register_fake(lambda tensor, handle, src, algorithm: _dense(tensor))


# -- fused operations -------------------------------------------------------------------------------------


@_in_place("all_gather_matmul_", ("out",))
def all_gather_matmul_(out: Tensor, a_shard: Tensor, b: Tensor, handle: int, method: Optional[str]) -> None:
    _eager(handle, "all_gather_matmul")(out, a_shard, b, method=method)


@_in_place("matmul_reduce_scatter_", ("out",))
def matmul_reduce_scatter_(out: Tensor, a: Tensor, b: Tensor, handle: int, method: Optional[str]) -> None:
    _eager(handle, "matmul_reduce_scatter")(out, a, b, method=method)


@_in_place("matmul_all_reduce_", ("out",))
def matmul_all_reduce_(out: Tensor, a: Tensor, b: Tensor, handle: int, method: Optional[str]) -> None:
    _eager(handle, "matmul_all_reduce")(out, a, b, method=method)


@_in_place("matmul_all_gather_", ("out",))
def matmul_all_gather_(out: Tensor, a: Tensor, b: Tensor, handle: int, method: Optional[str]) -> None:
    _eager(handle, "matmul_all_gather")(out, a, b, method=method)


def _product(name: str, a: Tensor, b: Tensor, rows: int) -> Tensor:
    """The output of ``name`` on ``a`` and ``b``: ``rows`` x b's columns, of a's dtype."""
    if a.dim() != 2 or b.dim() != 2:
        raise IrisError(f"{name}: a and b must be matrices (2-D), got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    return a.new_empty((rows, b.shape[1]))


def _output_of(name: str, a: Tensor, b: Tensor, handle: int) -> Tensor:
    world = _world_size(handle)
    if name == "matmul_reduce_scatter":
        if a.shape[0] % world:
            raise IrisError(f"matmul_reduce_scatter: a has {a.shape[0]} rows, not divisible by the world size "
                            f"{world}; pad M to a multiple of {world}")
        return _product(name, a, b, a.shape[0] // world)
    return _product(name, a, b, a.shape[0] if name == "matmul_all_reduce" else world * a.shape[0])


def _functional_product(name: str, in_place):
    """The functional operator ``name``: a new output, then the in-place operator on it."""

    def run(a: Tensor, b: Tensor, handle: int, method: Optional[str]) -> Tensor:
        out = _output_of(name, a, b, handle)
        in_place(out, a, b, handle, method)
        return out

    op = _custom_op(name)(run)
    op.register_fake(lambda a, b, handle, method: _output_of(name, a, b, handle))
    return op


FUSED = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "matmul_all_gather")
all_gather_matmul = _functional_product("all_gather_matmul", all_gather_matmul_)
matmul_reduce_scatter = _functional_product("matmul_reduce_scatter", matmul_reduce_scatter_)
matmul_all_reduce = _functional_product("matmul_all_reduce", matmul_all_reduce_)
matmul_all_gather = _functional_product("matmul_all_gather", matmul_all_gather_)


@_in_place("all_reduce_rmsnorm_", ("out", "residual_out"))
def all_reduce_rmsnorm_(out: Tensor, x: Tensor, residual: Tensor, weight: Tensor, handle: int, eps: float,
                        residual_out: Optional[Tensor], method: Optional[str]) -> None:
    _eager(handle, "all_reduce_rmsnorm")(out, x, residual, weight, eps, residual_out, method=method)


def _normed_and_summed(x: Tensor, keep_residual: bool) -> tuple[Tensor, Tensor]:
    """What the functional all_reduce_rmsnorm returns: the normalised rows and, with
    ``keep_residual``, the sums (else an empty tensor)."""
    return _dense(x), _dense(x) if keep_residual else x.new_empty((0,))


@_custom_op("all_reduce_rmsnorm")
def all_reduce_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, handle: int, eps: float, keep_residual: bool,
                       method: Optional[str]) -> tuple[Tensor, Tensor]:
    out, summed = _normed_and_summed(x, keep_residual)
    all_reduce_rmsnorm_(out, x, residual, weight, handle, eps, summed if keep_residual else None, method)
    return out, summed


all_reduce_rmsnorm.register_fake(lambda x, residual, weight, handle, eps, keep_residual, method:
                                 _normed_and_summed(x, keep_residual))


# -- the public methods' routes to the operators ----------------------------------------------------------
#
# Each route takes its method's arguments, calls the functional operator and copies its result
# into the method's output (which the compiler may fuse away): the functional operators carry an
# ordered effect (below), so every iris call of a compiled graph runs in program order. That
# matters: each call is collective, and graphs may differ between ranks (a root's call, send on
# one rank and recv on another), so an order chosen by the compiler could differ between ranks.
# Mutating operators cannot carry an effect, so the in-place ones are ordered only by the data
# they share. Each route returns what its method returns.


def _route_all_reduce(self, tensor, op="sum", *, algorithm=None):
    return tensor.copy_(torch.ops.iris.all_reduce(tensor, self._iris_handle, reduce_op_name(op), algorithm))


def _route_all_gather(self, output, input, *, algorithm=None):
    gathered = torch.ops.iris.all_gather(input.reshape(-1), self._iris_handle, algorithm)
    return output.copy_(gathered.reshape(output.shape))


def _route_reduce_scatter(self, output, input, op="sum", *, algorithm=None):
    share = torch.ops.iris.reduce_scatter(input.reshape(-1), self._iris_handle, reduce_op_name(op), algorithm)
    return output.copy_(share.reshape(output.shape))


def _route_all_to_all(self, output, input, *, algorithm=None):
    return output.copy_(torch.ops.iris.all_to_all(input, self._iris_handle, algorithm).reshape(output.shape))


def _route_broadcast(self, tensor, src=0, *, algorithm=None):
    return tensor.copy_(torch.ops.iris.broadcast(tensor, self._iris_handle, src, algorithm))


def _route_barrier(self):
    torch.ops.iris.barrier(self._iris_handle)


def _route_reduce(self, tensor, dst=0, op="sum", *, algorithm=None):
    return tensor.copy_(torch.ops.iris.reduce(tensor, self._iris_handle, dst, reduce_op_name(op), algorithm))


def _route_gather(self, output, input, dst=0, *, algorithm=None):
    gathered = torch.ops.iris.gather(input.reshape(-1), self._iris_handle, dst, algorithm)
    if output is not None and gathered.numel():  # only rank dst's output changes
        output.copy_(gathered.reshape(output.shape))
    return output


def _route_scatter(self, output, input, src=0, *, algorithm=None):
    return output.copy_(torch.ops.iris.scatter(output, input, self._iris_handle, src, algorithm))


def _route_send(self, tensor, dst, *, algorithm=None):
    torch.ops.iris.send(tensor, self._iris_handle, dst, algorithm)


def _route_recv(self, tensor, src, *, algorithm=None):
    return tensor.copy_(torch.ops.iris.recv(tensor, self._iris_handle, src, algorithm))


def _split_list(sizes):
    return None if sizes is None else [int(size) for size in sizes]


def _route_all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, *,
                             algorithm=None):
    received = torch.ops.iris.all_to_all_single(input, self._iris_handle, _split_list(output_split_sizes),
                                                _split_list(input_split_sizes), algorithm)
    return output.copy_(received.reshape(output.shape))


def _route_all_to_all_vdev(self, output, input, input_splits, output_splits, *, algorithm=None):
    received, splits = torch.ops.iris.all_to_all_vdev(output, input, input_splits, self._iris_handle, algorithm)
    output.copy_(received)
    return output_splits.copy_(splits)


def _product_route(name: str):
    def route(self, out, a, b, *, method=None):
        return out.copy_(getattr(torch.ops.iris, name)(a, b, self._iris_handle, method))

    return route


def _route_all_reduce_rmsnorm(self, out, x, residual, weight, eps=1e-6, residual_out=None, *, method=None):
    normed, summed = torch.ops.iris.all_reduce_rmsnorm(x, residual, weight, self._iris_handle, float(eps),
                                                       residual_out is not None, method)
    if residual_out is not None:
        residual_out.copy_(summed)
    return out.copy_(normed)


ROUTES: dict[str, Callable] = {
    "all_reduce": _route_all_reduce,
    "all_gather": _route_all_gather,
    "reduce_scatter": _route_reduce_scatter,
    "all_to_all": _route_all_to_all,
    "broadcast": _route_broadcast,
    "barrier": _route_barrier,
    "reduce": _route_reduce,
    "gather": _route_gather,
    "scatter": _route_scatter,
    "send": _route_send,
    "recv": _route_recv,
    "all_to_all_single": _route_all_to_all_single,
    "all_to_all_vdev": _route_all_to_all_vdev,
    **{name: _product_route(name) for name in FUSED},
    "all_reduce_rmsnorm": _route_all_reduce_rmsnorm,
}

ORDERED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather", "scatter",
           "recv", "all_to_all_single", "all_to_all_vdev", "send", "barrier", *FUSED, "all_reduce_rmsnorm")
"""The operators that carry an ordered effect: the functional ones, send and barrier."""
for _name in ORDERED:
    torch.library._register_effectful_op(getattr(torch.ops.iris, _name).default,
                                         torch._library.effects.EffectType.ORDERED)


# -- the decorator ----------------------------------------------------------------------------------------


def _group_target(target, group):
    """The collectives object of ``group`` (``target._for_group(group)``)."""
    for_group = getattr(target, "_for_group", None)
    if for_group is None:
        raise IrisError(f"{type(target).__name__}: group= is not supported by this context yet; pass group=None "
                        f"(the whole world)")
    return for_group(group)


def traceable(name: str):
    """Decorate the public method ``name`` of Collectives / FusedOps: it takes ``group=`` (the call
    runs on ``self._for_group(group)``) and ``async_op=`` (a :mod:`iris.collectives.work` handle is returned),
    and under ``torch.compile`` it calls its custom operator (:data:`ROUTES`) instead of its body,
    so the compiled graph has no break. The undecorated method is ``__wrapped__``: what the
    operators run."""
    route = ROUTES[name]

    def decorate(method):
        @functools.wraps(method)
        def call(self, *args, group=None, async_op: bool = False, **kwargs):
            if group is not None:
                return getattr(_group_target(self, group), method.__name__)(*args, async_op=async_op, **kwargs)
            if torch.compiler.is_compiling():
                result = route(self, *args, **kwargs)
                return CompletedWork(result) if async_op else result
            if async_op:
                return run_async(self._context.device, lambda: method(self, *args, **kwargs),
                                 (*args, *kwargs.values()))
            return method(self, *args, **kwargs)

        call.__iris_operator__ = name
        return call

    return decorate
