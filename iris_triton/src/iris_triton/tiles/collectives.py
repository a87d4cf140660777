"""Collectives on one tile, called from inside a kernel: all_reduce, all_gather, reduce_scatter,
all_to_all and broadcast of a tile of a matrix on the symmetric heap.

Every rank runs the same kernel; a program calls, say, ``all_reduce(tile, src_view, dst_view,
dctx, sync)`` for a tile once its values are in ``src_view`` (this rank's heap), and on return
``dst_view`` holds the tile summed over ranks. The data moves by *pull*: a rank reads its peers'
tiles of ``src_view`` with remote loads (16-byte vectors) and writes only its own ``dst_view``,
except :func:`all_reduce_two_shot`, whose owner of a tile writes the result into every rank's
``dst_view`` (then on the heap).

The signal protocol (``sync``: from ``ctx.tile_sync(num_tiles)``). Each tile number has a row of
int32 words on every rank: this rank's count of calls on the tile, one *ready* flag per peer and
one *done* flag per peer. A call on tile ``t`` is this rank's ``s``-th on ``t`` (the count, kept
on the device, so kernels need no host work and replay in CUDA graphs), and its flags carry
``s * 8 + kind`` (which collective): the call releases its tile with a system-scope signal of
every peer that reads it (``ready``), waits until each peer it reads from announced call ``s``
(a different collective there is a *mismatch*), reads, tells them (``done``), and waits, before it
writes ``dst_view`` and returns, until every peer that reads its tile has read it. So on return
the tile of ``src_view`` may be written again, ``dst_view`` may be ``src_view`` itself, and a
flag of an earlier call is never taken for the current one.

Every wait is bounded by the context's timeout (wall-clock); one that gives up records the
failure in the context's fault words (:mod:`iris_triton.protocol.waits`), the call writes all-ones bits
(NaN) into its tile of ``dst_view`` instead of data, and every later wait of the rank gives up at
once; the host raises :class:`iris.errors.IrisTimeoutError` at the next iris call
(``ctx.check()`` waits for the kernel and raises). A tile number outside the sync's rows fails
the same way. Without ``sync`` a call does no synchronisation at all (upstream iris's contract:
the host orders the ranks around the kernel, e.g. with ``ctx.barrier()``).

Every rank must make the same calls on the same tile numbers in the same order, and the
programs that wait on a peer's tile must be able to run while that peer's program for it does
(as in any kernel that waits on its peers): size the grid to what runs at once, or make every
rank visit the tiles in the same order per program.

The functions are written once, for Triton and Gluon kernels alike: they reach memory through the
device context (``dctx``), which in a Gluon kernel also lays the tile out.
"""

from __future__ import annotations

import triton
import triton.language as tl

from iris_triton.protocol.reductions import combine, finish, widen
from iris_triton.device.tracing import OPERATION_EVENT, WAIT_EVENT
from iris_triton.protocol.waits import MISMATCH, TILES, failed, poisoned, record_failure, site_code, wait_or_record

__all__ = ["SYNC_FIELDS", "all_gather", "all_reduce", "all_reduce_one_shot", "all_reduce_two_shot", "all_to_all",
           "allocate_tile_sync", "broadcast", "gather", "reduce_scatter"]

#: The int64 fields of a tile sync (``ctx.tile_sync``), in order.
SYNC_FIELDS = ("flags", "tiles")
#: Flag values are ``call * KIND_SPAN + kind``.
KIND_SPAN: tl.constexpr = tl.constexpr(8)
ALL_REDUCE: tl.constexpr = tl.constexpr(1)
ALL_GATHER: tl.constexpr = tl.constexpr(2)
REDUCE_SCATTER: tl.constexpr = tl.constexpr(3)
ALL_TO_ALL: tl.constexpr = tl.constexpr(4)
BROADCAST: tl.constexpr = tl.constexpr(5)
ALL_REDUCE_TWO_SHOT: tl.constexpr = tl.constexpr(6)
GATHER: tl.constexpr = tl.constexpr(7)
ALL_REDUCE_SITE: tl.constexpr = tl.constexpr(site_code("tile all_reduce"))
ALL_GATHER_SITE: tl.constexpr = tl.constexpr(site_code("tile all_gather"))
REDUCE_SCATTER_SITE: tl.constexpr = tl.constexpr(site_code("tile reduce_scatter"))
ALL_TO_ALL_SITE: tl.constexpr = tl.constexpr(site_code("tile all_to_all"))
BROADCAST_SITE: tl.constexpr = tl.constexpr(site_code("tile broadcast"))
GATHER_SITE: tl.constexpr = tl.constexpr(site_code("tile gather"))


# -- the protocol ----------------------------------------------------------------------------------------
# Who reads whom in a call: with ``hub`` None every rank reads every peer's tile; otherwise, with
# ``GATHER``, the hub reads every peer's tile (reduce_scatter's owner of the tile), and without it
# every peer reads the hub's (broadcast's root).


@triton.jit
def _field(sync, index):
    return tl.load(sync + index)


@triton.jit
def _reads_mine(rank, q, hub, GATHER: tl.constexpr):
    """Whether peer ``q`` reads this rank's tile in the call."""
    if hub is None:
        result = q != rank
    elif GATHER:
        result = (rank != hub) & (q == hub)
    else:
        result = (rank == hub) & (q != rank)
    return result


@triton.jit
def _reads_from(rank, q, hub, GATHER: tl.constexpr):
    """Whether this rank reads peer ``q``'s tile in the call."""
    if hub is None:
        result = q != rank
    elif GATHER:
        result = (rank == hub) & (q != rank)
    else:
        result = (rank != hub) & (q == hub)
    return result


@triton.jit
def _await(dctx, sync, flag, value, peer, ok, SITE: tl.constexpr):
    """Whether ``peer``'s ``flag`` here announced this call (``value``) within the timeout: a
    flag of an earlier call is waited out, another collective's is a mismatch. After a failure
    (``ok`` False) it waits for nothing."""
    if ok:
        waiting = dctx.tracing.begin(WAIT_EVENT, peer, op=value // KIND_SPAN)
        ok = wait_or_record(dctx, flag, value - value % KIND_SPAN, peer, SITE)
        dctx.tracing.end(waiting)
        if ok:
            if tl.atomic_add(flag, 0, sem="acquire", scope="sys") != value:
                record_failure(dctx, peer, MISMATCH * 256 + SITE)
                ok = False
    return ok


@triton.jit
def _arrive(dctx, sync, tile_id, hub, GATHER: tl.constexpr, KIND: tl.constexpr, SITE: tl.constexpr):
    """The first half of this rank's next call on tile ``tile_id``: release this rank's tile to
    the peers that read it (their *ready* flag), then wait until every peer it reads from released
    theirs. ``(row, value, ok)``: the tile's words, what this call's flags carry, and whether
    everything arrived (False also for a tile number outside the sync, recorded as a failure,
    and on a failed context). Without a sync it does nothing (the host orders the ranks)."""
    if sync is None:
        row = 0  # unused: nothing to count
        value = 0
        ok = True
    else:
        inside = (tile_id >= 0) & (tile_id < _field(sync, 1))
        if not inside:
            record_failure(dctx, dctx.rank, TILES * 256 + SITE)
        words = 1 + 2 * dctx.world_size
        row = _field(sync, 0).to(tl.pointer_type(tl.int32)) + tl.where(inside, tile_id, 0) * words
        value = (tl.load(row) + 1) * KIND_SPAN + KIND
        ok = inside & (not failed(dctx))
        if ok:
            for q in range(dctx.world_size):
                if _reads_mine(dctx.rank, q, hub, GATHER):
                    dctx.signal(row + 1 + dctx.rank, value, q)
            for q in range(dctx.world_size):
                if _reads_from(dctx.rank, q, hub, GATHER):
                    ok = _await(dctx, sync, row + 1 + q, value, q, ok, SITE)
    dctx.tracing.record(OPERATION_EVENT + SITE, tile=tile_id, op=value // KIND_SPAN)
    return row, value, ok


@triton.jit
def _leave(dctx, sync, row, value, ok, hub, GATHER: tl.constexpr, SITE: tl.constexpr):
    """The second half: tell the peers read from that their tiles were read (their *done* flag),
    wait until every peer that reads this rank's tile has read it, and count the call. Whether
    every wait of the call succeeded."""
    if sync is not None:
        done = row + 1 + dctx.world_size
        if ok:
            for q in range(dctx.world_size):
                if _reads_from(dctx.rank, q, hub, GATHER):
                    dctx.signal(done + dctx.rank, value, q)
        for q in range(dctx.world_size):
            if _reads_mine(dctx.rank, q, hub, GATHER):
                ok = _await(dctx, sync, done + q, value, q, ok, SITE)
        tl.store(row, value // KIND_SPAN)
    return ok


@triton.jit
def owner_of_run(tile_id, tiles, world):
    """The rank that owns tile ``tile_id`` of ``tiles`` in contiguous runs: rank r the
    ``tiles // world`` from ``r * (tiles // world)``, the last rank the rest too."""
    per_rank = tiles // world
    return tl.where(per_rank > 0, tl.minimum(tile_id // tl.maximum(per_rank, 1), world - 1), world - 1)


@triton.jit
def _reduced(dctx, pointers, mask, OP: tl.constexpr):
    """Every rank's tile at ``pointers`` combined by ``OP`` in rank order (so that every rank
    computing it gets the same bits), 16-bit floats in float32."""
    acc = widen(dctx.load(pointers, 0, mask=mask))
    for q in range(1, dctx.world_size):
        acc = combine(acc, widen(dctx.load(pointers, q, mask=mask)), OP)
    if OP == "avg":  # the world size as a float block: Gluon's is a run-time integer, which div_rn refuses
        world = (acc != acc).to(tl.float32) * 0 + dctx.world_size
    else:
        world = dctx.world_size
    return finish(acc, OP, world)


@triton.jit
def _store(pointers, values, mask, ok):
    """``values`` into ``pointers``'s type, or all-ones bits where the call failed."""
    tl.store(pointers, poisoned(values.to(pointers.dtype.element_ty), ok), mask=mask)


# -- the collectives -------------------------------------------------------------------------------------


@triton.jit
def all_reduce_one_shot(tile, src_view, dst_view, ctx, sync=None, op: tl.constexpr = tl.constexpr("sum")):
    """``dst_view``'s ``tile`` := ``src_view``'s ``tile`` combined over ranks by ``op`` (``"sum"``,
    ``"prod"``, ``"max"``, ``"min"``, ``"avg"``): every rank reads every peer's tile and combines
    them itself, in rank order (the same bits on every rank). ``dst_view`` may be ``src_view``."""
    src, mask = src_view.tile_ptr(tile, ctx)
    dst, dst_mask = dst_view.tile_ptr(tile, ctx)
    row, value, ok = _arrive(ctx, sync, src_view.tile_id(tile), None, False, ALL_REDUCE, ALL_REDUCE_SITE)
    result = _reduced(ctx, src, mask, op)
    ok = _leave(ctx, sync, row, value, ok, None, False, ALL_REDUCE_SITE)
    _store(dst, result, dst_mask, ok)


@triton.jit
def all_reduce(tile, src_view, dst_view, ctx, sync=None, op: tl.constexpr = tl.constexpr("sum")):
    """:func:`all_reduce_one_shot`, the all-reduce of one tile."""
    all_reduce_one_shot(tile, src_view, dst_view, ctx, sync, op)


@triton.jit
def all_reduce_two_shot(tile, src_view, dst_view, ctx, sync=None, op: tl.constexpr = tl.constexpr("sum")):
    """:func:`all_reduce_one_shot` with each tile reduced once: rank ``tile number % world`` reads
    every peer's tile, combines them and writes the result into every rank's ``dst_view``, which
    must be on the heap; each rank reads less than in the one-shot form (a 1/world share of the
    tiles, from every peer), at one more signal's latency."""
    tile_id = src_view.tile_id(tile)
    owner = tile_id % ctx.world_size
    src, mask = src_view.tile_ptr(tile, ctx)
    dst, dst_mask = dst_view.tile_ptr(tile, ctx)
    row, value, ok = _arrive(ctx, sync, tile_id, owner, True, ALL_REDUCE_TWO_SHOT, ALL_REDUCE_SITE)
    if ctx.rank == owner:
        result = poisoned(_reduced(ctx, src, mask, op).to(dst.dtype.element_ty), ok)
        for q in range(ctx.world_size):
            ctx.store(dst, result, q, mask=dst_mask)
    ok = _leave(ctx, sync, row, value, ok, owner, True, ALL_REDUCE_SITE)
    if not ok:
        _store(dst, tl.load(dst, mask=dst_mask), dst_mask, ok)


@triton.jit
def reduce_scatter(tile, src_view, dst_view, ctx, sync=None, op: tl.constexpr = tl.constexpr("sum")):
    """Reduce-scatter of tiles: the rank that owns ``tile`` (in contiguous runs of the tiles of
    ``src_view``: rank r the ``tiles // world`` from ``r * (tiles // world)``, the last rank the
    rest too) sets its ``dst_view``'s ``tile`` to every rank's ``src_view`` tile combined by ``op``
    in rank order; the other ranks' ``dst_view`` is left as it is. Every rank calls it for every
    tile."""
    tile_id = src_view.tile_id(tile)
    owner = owner_of_run(tile_id, src_view.number_of_tiles(tile.block_m, tile.block_n), ctx.world_size)
    row, value, ok = _arrive(ctx, sync, tile_id, owner, True, REDUCE_SCATTER, REDUCE_SCATTER_SITE)
    if ctx.rank == owner:
        src, mask = src_view.tile_ptr(tile, ctx)
        dst, dst_mask = dst_view.tile_ptr(tile, ctx)
        _store(dst, _reduced(ctx, src, mask, op), dst_mask, ok)
    _leave(ctx, sync, row, value, ok, owner, True, REDUCE_SCATTER_SITE)


@triton.jit
def all_gather(tile, src_view, dst_view, dim: tl.constexpr, ctx, sync=None):
    """All-gather of a tile: ``src_view`` is ``M x N`` on every rank and ``dst_view`` is
    ``world * M x N`` (``dim=0``: rank q's tile lands ``q * M`` rows down) or ``M x world * N``
    (``dim=1``: ``q * N`` columns across)."""
    src, mask = src_view.tile_ptr(tile, ctx)
    row, value, ok = _arrive(ctx, sync, src_view.tile_id(tile), None, False, ALL_GATHER, ALL_GATHER_SITE)
    for q in range(ctx.world_size):
        if dim == 0:
            dst, dst_mask = dst_view.offset_tile_ptr(tile, q * src_view.M, 0, mask, ctx)
        else:
            dst, dst_mask = dst_view.offset_tile_ptr(tile, 0, q * src_view.N, mask, ctx)
        _store(dst, ctx.load(src, q, mask=mask), dst_mask, ok)
    arrived = ok
    ok = _leave(ctx, sync, row, value, ok, None, False, ALL_GATHER_SITE)
    if arrived & (not ok):  # written, but a peer never read this rank's tile: the call failed
        for q in range(ctx.world_size):
            if dim == 0:
                dst, dst_mask = dst_view.offset_tile_ptr(tile, q * src_view.M, 0, mask, ctx)
            else:
                dst, dst_mask = dst_view.offset_tile_ptr(tile, 0, q * src_view.N, mask, ctx)
            _store(dst, tl.load(dst, mask=dst_mask), dst_mask, ok)


@triton.jit
def _chunk_tile(view, rm, rn, chunk, N_per_rank):
    """Pointers to the elements ``(rm, rn)`` of column chunk ``chunk`` (``N_per_rank`` columns
    from ``chunk * N_per_rank``) of ``view``."""
    columns = chunk * N_per_rank + rn
    return view.ptr + rm.to(tl.int64)[:, None] * view.stride_m + columns.to(tl.int64)[None, :] * view.stride_n


@triton.jit
def all_to_all(tile, src_view, dst_view, N_per_rank, ctx, sync=None):
    """All-to-all of a tile of ``M x world * N_per_rank`` matrices, as ``all_to_all_single`` along
    the columns: ``dst_view``'s column chunk q (``N_per_rank`` columns from ``q * N_per_rank``)
    receives rank q's chunk ``rank`` of ``src_view``. ``tile`` is a tile *of one chunk* (chunk
    columns ``[pid_n * BLOCK_N, ...)``): the call moves that tile of every chunk, so a rank calls it
    once the tile is written in all its chunks; a tile past a chunk's width moves nothing (so a
    kernel may also iterate over the tiles of the whole width). ``dst_view`` must not be
    ``src_view``."""
    rm, rn = tile.indices(ctx, dst_view.ptr)
    inside = (rm[:, None] < dst_view.M) & (rn[None, :] < N_per_rank)
    row, value, ok = _arrive(ctx, sync, dst_view.tile_id(tile), None, False, ALL_TO_ALL, ALL_TO_ALL_SITE)
    for q in range(ctx.world_size):
        data = ctx.load(_chunk_tile(src_view, rm, rn, ctx.rank, N_per_rank), q, mask=inside)
        _store(_chunk_tile(dst_view, rm, rn, q, N_per_rank), data, inside, ok)
    arrived = ok
    ok = _leave(ctx, sync, row, value, ok, None, False, ALL_TO_ALL_SITE)
    if arrived & (not ok):  # written, but a peer never read this rank's tile: the call failed
        for q in range(ctx.world_size):
            received = _chunk_tile(dst_view, rm, rn, q, N_per_rank)
            _store(received, tl.load(received, mask=inside), inside, ok)


@triton.jit
def broadcast(tile, src_view, dst_view, root, ctx, sync=None):
    """``dst_view``'s ``tile`` := rank ``root``'s ``src_view`` tile, on every rank."""
    src, mask = src_view.tile_ptr(tile, ctx)
    dst, dst_mask = dst_view.tile_ptr(tile, ctx)
    row, value, ok = _arrive(ctx, sync, src_view.tile_id(tile), root, False, BROADCAST, BROADCAST_SITE)
    data = ctx.load(src, root, mask=mask)
    ok = _leave(ctx, sync, row, value, ok, root, False, BROADCAST_SITE)
    _store(dst, data, dst_mask, ok)



@triton.jit
def gather(tile, src_view, source_rank, ctx, sync=None):
    """Rank ``source_rank``'s ``src_view`` tile, returned for the caller to use at once (e.g. as
    an operand of ``tl.dot``) rather than stored; 0 outside the matrix. With a sync every rank
    calls it with the same ``source_rank`` (that rank's own call returns its tile once every rank
    has read it); a failed call returns all-ones bits (NaN)."""
    src, mask = src_view.tile_ptr(tile, ctx)
    row, value, ok = _arrive(ctx, sync, src_view.tile_id(tile), source_rank, False, GATHER, GATHER_SITE)
    data = ctx.load(src, source_rank, mask=mask, other=0)
    ok = _leave(ctx, sync, row, value, ok, source_rank, False, GATHER_SITE)
    return poisoned(data, ok)


# -- the host side ---------------------------------------------------------------------------------------


def allocate_tile_sync(context, num_tiles: int):
    """What ``ctx.tile_sync(num_tiles)`` returns: the int64 fields :data:`SYNC_FIELDS` (the
    address of ``num_tiles`` rows of zeroed flag words on the heap, ``num_tiles``) on the context's
    device; the waits' timeout and fault words come with the kernel's device context. The flag
    words are allocated collectively and live as long as the context; a host barrier follows, so
    that no peer signals into them before every rank has zeroed its own."""
    import torch

    if isinstance(num_tiles, bool) or not isinstance(num_tiles, int) or num_tiles < 1:
        raise ValueError(f"tile_sync: num_tiles must be a positive int (the tiles a kernel synchronises, e.g. "
                         f"triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)), got {num_tiles!r}")
    flags = context.zeros(num_tiles * (1 + 2 * context.world_size), dtype=torch.int32)
    context._tile_flags.append(flags)
    context.barrier()
    fields = [flags.data_ptr(), num_tiles]
    return torch.tensor(fields, dtype=torch.int64, device=context.device)
