"""Upstream iris's tile collectives, in its forms: what its kernels call as ``iris.x.all_gather``,
``all_reduce_atomic``, ``all_reduce_one_shot``, ``all_reduce_two_shot`` and ``reduce_scatter``.

Upstream's tile collectives take other arguments than iris's own
(:mod:`iris_triton.tiles.collectives`) and keep another contract:

- ``all_gather(tile, dst_view, dim, ctx)`` and ``all_reduce_atomic(tile, dst_view, ctx)`` *push*
  this rank's ``tile.data`` into every rank's ``dst_view`` (stores; atomic adds into a zeroed
  output) and signal nothing: the host orders the ranks around the kernel (``ctx.barrier()``)
  before anyone reads the output.
- ``all_reduce_one_shot``, ``all_reduce_two_shot`` and ``reduce_scatter(tile, src_view, dst_view,
  locks, ctx)`` *pull*: the caller has written its partial tile into ``src_view`` (on the heap)
  and then set its own ``locks[tile]`` to 1 (release); a call waits for each peer's lock and reads
  the peer's tile. Locks are never reset: a locks buffer serves one launch.

These take upstream's arguments and give its results, on iris's device API, with iris's failure
rule where upstream has a wait: a wait for a peer's lock is bounded by the context's timeout (the
device context must come from ``DeviceContext.initialize``, which carries it); one that gives up
records a timeout in the context's fault words, the call writes all-ones bits (NaN) instead of
the tile, every later wait of the rank gives up at once, and the host raises at the next iris
call. Sums are taken in rank order, 16-bit floats in float32 (upstream adds bfloat16 in
bfloat16), so every rank computing a tile gets the same bits.

The pushes of ``all_gather`` and ``all_reduce_atomic`` carry no completion signal, so no call can
tell that its peers' data has arrived: iris's own forms, with a tile sync, wait per tile,
sequence-numbered.
"""

import triton
import triton.language as tl

from iris_triton.protocol.reductions import widen
from iris_triton.protocol.waits import poisoned, wait_or_record
from iris_triton.tiles.collectives import ALL_REDUCE_SITE, REDUCE_SCATTER_SITE, owner_of_run

__all__ = ["all_gather", "all_reduce_atomic", "all_reduce_one_shot", "all_reduce_two_shot", "reduce_scatter"]


@triton.jit
def all_gather(tile, dst_view, dim: tl.constexpr, ctx):
    """``tile.data`` (this rank's tile of its ``M x N`` block) stored into every rank's
    ``dst_view``, the gathered ``world * M x N`` (``dim=0``: rank r's block ``r * M`` rows down) or
    ``M x world * N`` matrix (``dim=1``: ``r * N`` columns across). Elements past the block are not
    stored, so a block whose size is no multiple of the tile's leaves its neighbour's intact."""
    rm, rn = tile.indices()
    if dim == 0:
        rows = dst_view.M // ctx.world_size
        inside = (rm[:, None] < rows) & (rn[None, :] < dst_view.N)
        dst, mask = dst_view.offset_tile_ptr(tile, ctx.rank * rows, 0, inside)
    else:
        columns = dst_view.N // ctx.world_size
        inside = (rm[:, None] < dst_view.M) & (rn[None, :] < columns)
        dst, mask = dst_view.offset_tile_ptr(tile, 0, ctx.rank * columns, inside)
    for q in range(ctx.world_size):
        ctx.store(dst, tile.data, q, mask=mask)


@triton.jit
def all_reduce_atomic(tile, dst_view, ctx):
    """``tile.data`` atomically added into ``tile`` of every rank's ``dst_view`` (zeroed before the
    kernel): once every rank's kernel is done, each holds the sum (in no fixed order)."""
    dst, mask = dst_view.tile_ptr(tile)
    for q in range(ctx.world_size):
        ctx.atomic_add(dst, tile.data, q, mask=mask)


@triton.jit
def _sum_when_locked(tile, src_view, lock, ctx, SITE: tl.constexpr):
    """``(sum, ok)``: ``tile.data`` for this rank and every peer's ``src_view`` tile, each read once
    the peer's ``lock`` (in its heap) is set, summed in rank order (16-bit floats in float32); and
    whether every lock was seen within the timeout."""
    src, mask = src_view.tile_ptr(tile)
    ok = tl.program_id(0) >= 0
    for q in tl.static_range(ctx.world_size):
        if q == ctx.rank:
            part = widen(tile.data)
        else:
            ok = ok & wait_or_record(ctx, lock, 1, q, SITE, True)
            part = widen(ctx.load(src, q, mask=mask, other=0))  # poisoned below if a wait gave up
        if q == 0:
            total = part
        else:
            total = total + part
    return total, ok


@triton.jit
def all_reduce_one_shot(tile, src_view, dst_view, locks, ctx):
    """``dst_view``'s ``tile`` (this rank's) := the sum over ranks of their tiles: every rank reads
    every peer's ``src_view`` tile once its lock (``locks[tile number]``) is set."""
    dst, mask = dst_view.tile_ptr(tile)
    total, ok = _sum_when_locked(tile, src_view, locks + dst_view.tile_id(tile), ctx, ALL_REDUCE_SITE)
    tl.store(dst, poisoned(total.to(dst.dtype.element_ty), ok), mask=mask)


@triton.jit
def all_reduce_two_shot(tile, src_view, dst_view, locks, ctx):
    """:func:`all_reduce_one_shot` with each tile summed once: rank ``tile number % world`` reads
    the peers' tiles and stores the sum into every rank's ``dst_view`` (on the heap); the others
    do nothing for the tile."""
    tile_id = dst_view.tile_id(tile)
    if tile_id % ctx.world_size == ctx.rank:
        dst, mask = dst_view.tile_ptr(tile)
        total, ok = _sum_when_locked(tile, src_view, locks + tile_id, ctx, ALL_REDUCE_SITE)
        result = poisoned(total.to(dst.dtype.element_ty), ok)
        for q in range(ctx.world_size):
            ctx.store(dst, result, q, mask=mask)


@triton.jit
def reduce_scatter(tile, src_view, dst_view, locks, ctx):
    """The rank that owns ``tile`` (in contiguous runs: rank r the ``tiles // world`` from
    ``r * (tiles // world)``, the last rank the rest too) sets its ``dst_view``'s tile to the sum
    over ranks; the other ranks' ``dst_view`` is left as it is."""
    tile_id = dst_view.tile_id(tile)
    if owner_of_run(tile_id, dst_view.number_of_tiles(tile.block_m, tile.block_n), ctx.world_size) == ctx.rank:
        dst, mask = dst_view.tile_ptr(tile)
        total, ok = _sum_when_locked(tile, src_view, locks + tile_id, ctx, REDUCE_SCATTER_SITE)
        tl.store(dst, poisoned(total.to(dst.dtype.element_ty), ok), mask=mask)
