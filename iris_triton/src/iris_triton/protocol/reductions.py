"""Element-wise reductions shared by the collective kernels (compiled in the caller's language)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["combine", "finish", "own_block", "reduce_in_rank_order", "stacked_block", "widen"]


@triton.jit
def widen(x):
    """``x`` in the type reductions accumulate in (float32 for 16-bit floats)."""
    if x.dtype.is_fp16() or x.dtype.is_bf16():
        x = x.to(tl.float32)
    return x


@triton.jit
def combine(acc, x, OP: tl.constexpr):
    """``acc`` combined with ``x`` by ``OP`` (:data:`iris.collectives.REDUCE_OPS`; ``"avg"`` sums,
    and :func:`finish` divides). Integers wrap around, as torch's do; ``"max"`` and ``"min"`` give
    NaN where any operand is NaN, as torch's do (a GPU's plain max/min instruction returns the other
    operand: the interpreter, whose numpy propagates NaN, does not show the difference), and order
    -0 below +0 (IEEE 754's maximum and minimum; torch returns either zero of a tie, by the path its
    kernel takes)."""
    if OP == "sum":
        acc = acc + x
    elif OP == "avg":
        acc = acc + x
    elif OP == "prod":
        acc = acc * x
    elif OP == "max":
        acc = tl.maximum(acc, x, propagate_nan=tl.PropagateNan.ALL)
    else:
        tl.static_assert(OP == "min", "OP must be 'sum', 'prod', 'max', 'min' or 'avg'")
        acc = tl.minimum(acc, x, propagate_nan=tl.PropagateNan.ALL)
    return acc


@triton.jit
def finish(acc, OP: tl.constexpr, WORLD: tl.constexpr):
    """``acc``, every rank's value combined by ``OP``, as the reduction's result: ``"avg"``
    divides the sum by the world size, rounded to nearest as torch's division (a float32
    accumulator: ``ctx.ccl`` takes ``"avg"`` for floating-point tensors only)."""
    if OP == "avg":
        acc = tl.div_rn(acc, WORLD)
    return acc


@triton.jit
def reduce_in_rank_order(OWN: tl.constexpr, PEER: tl.constexpr, args, RANK: tl.constexpr, WORLD: tl.constexpr,
                         OP: tl.constexpr):
    """``(acc, arrived)``: every rank's block, widened and combined by ``OP`` in rank order (then
    :func:`finish`), so that every rank computing it gets the same bits, and whether every peer's
    block arrived. This
    rank's block is ``OWN(args)``; peer q's and whether it arrived are ``PEER(q, args)``.
    ``args`` is a tuple of run-time values (a tuple does not carry constexprs), which each
    algorithm's two functions unpack to fetch a block their own way."""
    arrived = True
    for q in tl.static_range(WORLD):
        if q == RANK:
            x = widen(OWN(args))
        else:
            x, ok = PEER(q, args)
            x = widen(x)
            arrived = arrived & ok
        if q == 0:
            acc = x
        else:
            acc = combine(acc, x, OP)
    return finish(acc, OP, WORLD), arrived


@triton.jit
def own_block(args):
    """:func:`reduce_in_rank_order`'s ``OWN`` where ``args`` are ``(own, stacked, offs, mask,
    stride)``: this rank's block, from ``own``."""
    own, stacked, offs, mask, stride = args
    return tl.load(own + offs, mask=mask)


@triton.jit
def stacked_block(q, args):
    """:func:`reduce_in_rank_order`'s ``PEER`` for blocks stacked ``stride`` elements apart from
    ``stacked`` (a workspace slot's regions, partial results), already there (the caller waited)."""
    own, stacked, offs, mask, stride = args
    return tl.load(stacked + q * stride + offs, mask=mask), True
