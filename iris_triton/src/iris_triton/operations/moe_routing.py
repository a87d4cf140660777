"""The routing step of MoE dispatch, on the device: where each ``(token, slot)`` pair's row goes.

For ``topk_ids`` ``[T, k]`` a pair's *position* is how many earlier tokens of this rank route to
the same expert (token order, so the layout is deterministic), or -1 for a pair that sends nothing
(id -1, an id out of range, or an expert an earlier slot of the same token already names: that
token reaches the expert once). Every rank also counts its rows per expert and whether some id was
out of range: the row ``[counts of the E experts, out-of-range flag]`` that every rank publishes to
every other, from which each computes the same offsets and verdict.

The tokens are routed in chunks of ``BLOCK_T``, one program each, all at once (a walk of the
tokens by one program takes time in proportion to their number): :func:`route_chunk` gives each
pair its position within its chunk and each chunk its counts; :func:`scan_chunks` (one program,
once every chunk is routed) turns the chunks' counts into the rows of each expert in earlier
chunks and the rank's row; :func:`final_positions` adds a pair's chunk's offset to its position.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["ROUTE_BLOCK", "final_positions", "route_chunk", "scan_chunks"]

#: Tokens a program of :func:`route_chunk` routes.
ROUTE_BLOCK = 32
#: Chunks a step of :func:`scan_chunks` takes.
SCAN_BLOCK: tl.constexpr = tl.constexpr(64)


@triton.jit
def _column(block, columns, j):
    """Column ``j`` of ``block`` (``[rows, columns]``, ``columns`` its column indices)."""
    return tl.sum(tl.where(columns[None, :] == j, block, 0), axis=1)


@triton.jit
def route_chunk(ids, positions, chunk_counts, chunk, T, E, K: tl.constexpr, K_BLOCK: tl.constexpr,
                E_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr):
    """Tokens ``[chunk * BLOCK_T, (chunk + 1) * BLOCK_T)`` of ``ids`` (``[T, K]``, int32 or int64):
    ``positions[t, j]`` (int32) := pair ``(t, j)``'s position among the chunk's rows of its expert,
    or -1 when it sends nothing; ``chunk_counts[chunk]`` (int32 ``[E + 1]``) := the chunk's rows
    of each expert, then 1 if some id is outside ``[-1, E)``, else 0. ``K_BLOCK`` and ``E_BLOCK``
    are powers of two of at least ``K`` and ``E``."""
    t = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.arange(0, K_BLOCK)
    experts = tl.arange(0, E_BLOCK)
    pairs = t[:, None] * K + slots[None, :]
    live = (t[:, None] < T) & (slots[None, :] < K)
    chosen = tl.load(ids + pairs, mask=live, other=-1).to(tl.int32)  # every id of the chunk, read once
    outside = tl.max(tl.max(((chosen < -1) | (chosen >= E)).to(tl.int32), axis=1), axis=0)
    hit = tl.zeros([BLOCK_T, E_BLOCK], dtype=tl.int32)  # token t routes to expert e (once)
    for j in tl.static_range(K):
        e = _column(chosen, slots, j)
        hit = tl.maximum(hit, ((e[:, None] == experts[None, :]) & (experts[None, :] < E)).to(tl.int32))
    before = tl.cumsum(hit, axis=0) - hit  # earlier tokens' rows of each expert
    seen = tl.zeros([BLOCK_T, E_BLOCK], dtype=tl.int32)  # an earlier slot of the token names e
    found = tl.full([BLOCK_T, K_BLOCK], -1, dtype=tl.int32)
    for j in tl.static_range(K):
        e = _column(chosen, slots, j)
        names = ((e[:, None] == experts[None, :]) & (experts[None, :] < E)).to(tl.int32)
        sends = tl.sum(names * (1 - seen), axis=1) > 0  # a valid id whose expert no earlier slot named
        position = tl.sum(names * before, axis=1)
        found = tl.where(slots[None, :] == j, tl.where(sends, position, -1)[:, None], found)
        seen = tl.maximum(seen, names)
    tl.store(positions + pairs, found, mask=live)
    tl.store(chunk_counts + chunk * (E + 1) + experts, tl.sum(hit, axis=0), mask=experts < E)
    tl.store(chunk_counts + chunk * (E + 1) + E, outside)


@triton.jit
def scan_chunks(chunk_counts, chunks, E, E_BLOCK: tl.constexpr):
    """Once every chunk is routed (:func:`route_chunk`; one program): each chunk's counts in
    ``chunk_counts`` (``[chunks, E + 1]``) := the rows of each expert in the chunks before it;
    returns the rank's rows of each expert (``[E_BLOCK]``, 0 past ``E``) and whether some chunk
    had an id out of range. Read through the L2 cache: other programs wrote the counts."""
    experts = tl.arange(0, E_BLOCK)
    rows = tl.arange(0, SCAN_BLOCK)
    running = tl.zeros([E_BLOCK], dtype=tl.int32)
    outside = tl.zeros([SCAN_BLOCK], dtype=tl.int32)
    for start in range(0, chunks, SCAN_BLOCK):
        c = start + rows
        where = chunk_counts + c[:, None] * (E + 1) + experts[None, :]
        mask = (c[:, None] < chunks) & (experts[None, :] < E)
        counts = tl.load(where, mask=mask, other=0, cache_modifier=".cg")
        tl.store(where, running[None, :] + tl.cumsum(counts, axis=0) - counts, mask=mask)
        running += tl.sum(counts, axis=0)
        flags = tl.load(chunk_counts + c * (E + 1) + E, mask=c < chunks, other=0, cache_modifier=".cg")
        outside = tl.maximum(outside, flags)
    return running, tl.max(outside, axis=0)


@triton.jit
def final_positions(ids, positions, chunk_offsets, T, E, K: tl.constexpr, K_BLOCK: tl.constexpr,
                    BLOCK_T: tl.constexpr, TOKENS: tl.constexpr):
    """The positions of the tokens this program moves (``program_id + i * num_programs``) made
    the rank's: each routed pair's position plus its chunk's offset of its expert
    (``chunk_offsets``: :func:`scan_chunks`' result), ``TOKENS`` tokens a step."""
    slots = tl.arange(0, K_BLOCK)
    stride = tl.num_programs(0)
    for start in range(tl.program_id(0), T, stride * TOKENS):
        t = start + stride * tl.arange(0, TOKENS)
        pairs = t[:, None] * K + slots[None, :]
        live = (t[:, None] < T) & (slots[None, :] < K)
        position = tl.load(positions + pairs, mask=live, other=-1)
        e = tl.maximum(tl.load(ids + pairs, mask=live, other=0).to(tl.int32), 0)
        routed = live & (position >= 0)
        offset = tl.load(chunk_offsets + (t // BLOCK_T)[:, None] * (E + 1) + e, mask=routed, other=0)
        tl.store(positions + pairs, position + offset, mask=routed)
    tl.debug_barrier()  # the positions as every thread of the program stored them
