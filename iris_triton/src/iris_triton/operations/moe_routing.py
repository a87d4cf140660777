"""The routing step of MoE dispatch, on the device: where each ``(token, slot)`` pair's row goes.

For ``topk_ids`` ``[T, k]`` one program computes, for every pair, its *position*: how many earlier
tokens of this rank route to the same expert (token order, so the layout is deterministic), or -1
for a pair that sends nothing (id -1, an id out of range, or an expert an earlier slot of the same
token already names: that token reaches the expert once). It also counts the rows per expert and
whether some id was out of range: the row ``[counts of the E experts, out-of-range flag]`` that
every rank publishes to every other, from which each computes the same offsets and verdict.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["ROUTE_BLOCK", "route_pairs"]

#: Tokens a step of :func:`route_pairs` takes.
ROUTE_BLOCK = 32


@triton.jit
def route_pairs(ids, positions, row, T, E, K: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr):
    """``positions[t, j]`` (int32) := the position of pair ``(t, j)`` of ``ids`` (``[T, K]``,
    int32 or int64) among this rank's rows of its expert, or -1 when it sends nothing;
    ``row[e]`` (int32, ``e < E``) := the rows of expert ``e``; ``row[E]`` := 1 if some id is
    outside ``[-1, E)``, else 0. ``E_BLOCK`` is a power of two of at least ``E``; run by one
    program (the first kernel of a dispatch, :mod:`iris_triton.operations.moe_kernels`)."""
    experts = tl.arange(0, E_BLOCK)
    running = tl.zeros([E_BLOCK], dtype=tl.int32)
    outside = tl.zeros([BLOCK_T], dtype=tl.int32)
    for start in range(0, T, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        live = t < T
        hit = tl.zeros([BLOCK_T, E_BLOCK], dtype=tl.int32)  # token t routes to expert e (once)
        for j in tl.static_range(K):
            e = tl.load(ids + t * K + j, mask=live, other=-1).to(tl.int32)
            hit = tl.maximum(hit, (e[:, None] == experts[None, :]).to(tl.int32))
            outside = tl.maximum(outside, ((e < -1) | (e >= E)).to(tl.int32))
        before = running[None, :] + tl.cumsum(hit, axis=0) - hit  # earlier tokens' rows of each expert
        for j in tl.static_range(K):
            e = tl.load(ids + t * K + j, mask=live, other=-1).to(tl.int32)
            sends = (e >= 0) & (e < E)
            for i in tl.static_range(j):  # a repeat of an earlier slot's expert sends nothing
                sends = sends & (e != tl.load(ids + t * K + i, mask=live, other=-1).to(tl.int32))
            position = tl.sum(tl.where(e[:, None] == experts[None, :], before, 0), axis=1)
            tl.store(positions + t * K + j, tl.where(sends, position, -1), mask=live)
        running += tl.sum(hit, axis=0)
    tl.store(row + experts, running, mask=experts < E)
    tl.store(row + E, tl.max(outside, axis=0))

