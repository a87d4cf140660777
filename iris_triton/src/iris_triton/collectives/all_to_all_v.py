"""Uneven all-to-all: rows split by counts that differ between ranks (entry points
``iris.ccl.all_to_all_single`` and ``iris.ccl.all_to_all_vdev``).

One kernel source, :func:`all_to_all_v_kernel`, compiled by the context's front end, serves both
collectives: ``all_to_all_single`` passes the split sizes the host gave (as small device tensors),
``all_to_all_vdev`` passes split counts that only the device knows (MoE routing) and gets the
counts it received back. A call moves rows (the product of a tensor's other dimensions) and runs
in two exchanges of signals, each program ``p`` with program ``p`` of every peer, on the
collectives' sync words (:mod:`iris_triton.protocol.calls`: call numbers, signal counts, headers):

1. Every program announces the call (number and signature) and writes this rank's *table row*
   into every peer's table: the rows it sends to each rank, the rows it expects from each rank
   (``all_to_all_single``), its input's rows and its output's rows (the bound). Then it signals.
   After the wait, every rank holds every rank's row, so every rank checks the same table and
   reaches the same verdict: splits that are negative or exceed their input, a rank that would
   receive more rows than its output (or the receive region) holds, outputs of different bounds
   (``all_to_all_vdev``), rows expected that no peer sends (``all_to_all_single``). A bad table
   fails the call on every rank at once, before any data moves: nothing is written out of bounds
   and nobody waits for data that will never come.
2. Each sender computes, from the table, where its rows go in each receiver's *receive region*
   (after the rows of the ranks before it) and pushes them there; its own rows go straight into
   its output. Then it signals; after the wait, the receiver copies what its peers pushed from
   its region into its output, packed in source-rank order from row 0.

The region is split in blocks of ``BLOCK`` elements; program ``p`` of a grid of ``P`` pushes and
copies the blocks ``p, p + P, ...`` only, so what program ``p`` of the receiver copies was
pushed by program ``p`` of the senders, which its wait covers.

The loops over ranks (the table's checks, the pushes, the copies) are loops in the compiled
kernel, not unrolled per rank as the collectives' pushes and reductions are: each rank's rows
are a loop of their own, one after another, so unrolling them would overlap nothing and would
multiply the kernel's code, and the time every rank spends compiling it, by the world size.

Consecutive calls: the table has two slots, by call parity, as the collectives' workspaces do
(a peer's call ``k + 1`` writes its row before any wait, while this rank may still be in call
``k``). The receive region needs only one: a sender pushes into it only after the receiver's
signal of the same call, and that program of the receiver started this call only once its
previous kernel finished, copying included (kernels of a stream run one after another).

Capacity: the region holds the same number of bytes on every rank (a workspace, grown
collectively). ``all_to_all_vdev`` sizes it by the output's bound (the same on every rank by
contract, checked in the table); ``all_to_all_single`` agrees on it with one small host exchange
per eager call (the most bytes any rank receives, with the call's description: ranks in
different calls raise there), and during a CUDA graph capture, where no host exchange can
happen, uses the workspace as earlier calls left it: a call that does not fit fails on the
device, so make an eager call of the largest size before capturing.

A wait that gives up, a peer that made a different call or a bad table records the failure in
the context's fault words and poisons the outputs (NaN, integers -1; the received counts -1)
(:mod:`iris_triton.protocol.waits`); the host raises at the call (CPU ranks) or at the next iris call.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

import iris.collectives.workspaces as workspaces
from iris.collectives import SAME_SIZE_INTEGER, Algorithm, CollectiveCall
from iris_triton.protocol.calls import announce, header_value, headers_of
from iris_triton.collectives.kernels import SLOT_ALIGNMENT, _finish, _program_state, _signal_peers, _wait_peers
from iris_triton.device.frontend import SHARED_SOURCE_LANGUAGES
from iris_triton.device.tracing import OPERATION_EVENT
from iris_triton.tuning import collective_shape
from iris_triton.protocol.waits import (BOUNDS, CAPACITY, OVERFLOW, SPLITS, UNMATCHED, failed, peers_announced,
                               poison_blocks, record_failure, site_code)

__all__ = ["ALL_TO_ALL_SINGLE_DIRECT", "ALL_TO_ALL_VDEV_DIRECT", "WORKSPACE", "all_to_all_v_kernel", "table_bytes"]

#: The workspace of these collectives: the two table slots, then the receive region.
WORKSPACE = "all_to_all_v"

# -- the table -----------------------------------------------------------------------------------------
# Row ``s`` of a table slot, ``LANES`` int64 words (a power of two >= 2 * WORLD + 2): the rows rank
# ``s`` sends to each rank (lanes [0, WORLD)), the rows it expects from each rank (lanes
# [WORLD, 2 * WORLD); all_to_all_single only, else 0), its input's rows (lane 2 * WORLD) and its
# output's rows, the bound (lane 2 * WORLD + 1). A program reads the whole slot as one vector of
# ``TABLE`` words (``LANES`` times the world size rounded up to a power of two): lane ``i`` is word
# ``i % LANES`` of rank ``i // LANES``'s row. Entries are picked out of it by masked sums.


@triton.jit
def _own_row(lanes, splits, expected, in_rows, bound, WORLD: tl.constexpr, EXPECTED: tl.constexpr):
    """This rank's table row, from its split tensors and its tensors' rows."""
    sent = tl.load(splits + lanes, mask=lanes < WORLD, other=0)
    if EXPECTED:
        wanted = tl.load(expected + (lanes - WORLD), mask=(lanes >= WORLD) & (lanes < 2 * WORLD), other=0)
    else:
        wanted = sent * 0
    return tl.where(lanes < WORLD, sent, tl.where(lanes < 2 * WORLD, wanted,
                                                  tl.where(lanes == 2 * WORLD, in_rows + sent * 0, bound + sent * 0)))


@triton.jit
def _pick(table, where):
    """The sum of ``table``'s lanes where ``where`` holds (one entry, or a row's or a column's sum)."""
    return tl.sum(tl.where(where, table, 0), axis=0)


@triton.jit
def _table_holds(dctx, slot, words, cap_rows, RANK: tl.constexpr, WORLD: tl.constexpr,
                 LANES: tl.constexpr, SITE: tl.constexpr, SAME_BOUND: tl.constexpr, EXPECTED: tl.constexpr):
    """Whether every rank's row of the table (``words``: the slot's offsets, one vector) makes a
    call that fits (the module's checks). Every rank checks the same table, so every rank reaches
    the same verdict; what does not fit is recorded (for the rank it concerns)."""
    source, lane = words // LANES, words % LANES
    filled = (source < WORLD) & (lane < 2 * WORLD + 2)
    table = tl.load(slot + words, mask=filled, other=0)
    # Rank d's expected rows from rank s sit at [d, WORLD + s], opposite the rows s sends d at [s, d].
    opposite = tl.load(slot + lane * LANES + WORLD + source, mask=filled & (lane < WORLD), other=0)
    ok = tl.program_id(0) >= 0
    here = _pick(table, words == RANK * LANES + 2 * WORLD + 1)  # this rank's bound
    for q in range(WORLD):
        sends = _pick(table, (source == q) & (lane < WORLD))
        bad = (sends > _pick(table, words == q * LANES + 2 * WORLD)) | (
            _pick(tl.where(table < 0, 1, 0), (source == q) & (lane < 2 * WORLD)) > 0)
        if bad:  # negative, or more rows than q's input has
            record_failure(dctx, q, SPLITS * 256 + SITE)
        ok = ok & (not bad)
        bound = _pick(table, words == q * LANES + 2 * WORLD + 1)
        if SAME_BOUND:
            if bound != here:
                record_failure(dctx, q, BOUNDS * 256 + SITE)
            ok = ok & (bound == here)
        receives = _pick(table, (source < WORLD) & (lane == q))
        if receives > bound:
            record_failure(dctx, q, OVERFLOW * 256 + SITE)
        if receives > cap_rows:
            record_failure(dctx, q, CAPACITY * 256 + SITE)
        ok = ok & (receives <= bound) & (receives <= cap_rows)
        if EXPECTED:
            unmatched = _pick(tl.where(table != opposite, 1, 0), (lane == q) & (source < WORLD)) > 0
            if unmatched:
                record_failure(dctx, q, UNMATCHED * 256 + SITE)
            ok = ok & (not unmatched)
    return ok


# -- moving rows ---------------------------------------------------------------------------------------


@triton.jit
def _copy_range(dctx, src, dst, lo, hi, to_rank, RANK: tl.constexpr, BLOCK: tl.constexpr):
    """``dst[e] := src[e - lo]`` on ``to_rank`` for the elements ``e`` in ``[lo, hi)`` of this
    program's blocks (``p, p + P, ...`` of the region's blocks of ``BLOCK`` elements)."""
    programs = tl.num_programs(0)
    first = lo // BLOCK
    first = first + (tl.program_id(0) - first % programs + programs) % programs
    for b in range(first, tl.cdiv(hi, BLOCK), programs):
        e = dctx.block_offsets(dst, b * BLOCK, BLOCK)
        mask = (e >= lo) & (e < hi)
        x = tl.load(src + (e - lo), mask=mask)
        if to_rank == RANK:
            tl.store(dst + e, x, mask=mask)
        else:
            dctx.store(dst + e, x, to_rank, mask=mask)


@triton.jit
def _push_rows(dctx, table, words, inp, out, region, row, RANK: tl.constexpr, WORLD: tl.constexpr,
               LANES: tl.constexpr, BLOCK: tl.constexpr):
    """This rank's rows for each rank d into d's receive region (its own rows into ``out``),
    after the rows the ranks before it send there."""
    source, lane = words // LANES, words % LANES
    start = _pick(table, words < 0)  # this rank's first input row for rank d
    for d in range(WORLD):
        rows = _pick(table, words == RANK * LANES + d)
        lo = _pick(table, (source < RANK) & (lane == d)) * row
        if d == RANK:
            _copy_range(dctx, inp + start * row, out, lo, lo + rows * row, RANK, RANK, BLOCK)
        else:
            _copy_range(dctx, inp + start * row, region, lo, lo + rows * row, d, RANK, BLOCK)
        start += rows


@triton.jit
def _take_rows(dctx, table, words, out, region, out_splits, row, RANK: tl.constexpr, WORLD: tl.constexpr,
               LANES: tl.constexpr, BLOCK: tl.constexpr, REPORT: tl.constexpr):
    """``out`` := what every peer pushed into this rank's region (in source order, at the same
    rows); with ``REPORT``, program 0 writes the rows received from each rank to ``out_splits``."""
    lo = _pick(table, words < 0)
    for s in range(WORLD):
        rows = _pick(table, words == s * LANES + RANK)
        if s != RANK:
            _copy_range(dctx, region + lo * row, out, lo * row, (lo + rows) * row, RANK, RANK, BLOCK)
        if REPORT:
            if tl.program_id(0) == 0:
                tl.store(out_splits + s, rows)
        lo += rows


# -- the kernel source ---------------------------------------------------------------------------------


def all_to_all_v_kernel(context, inp, out, region, table, splits, expected, out_splits, sync, programs, in_rows,
                        bound, cap_rows, row, out_numel, signature, CTX: tl.constexpr,
                        TRACING: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, LANES: tl.constexpr,
                        TABLE: tl.constexpr, SITE: tl.constexpr, EXPECTED: tl.constexpr,
                        SAME_BOUND: tl.constexpr, REPORT: tl.constexpr, BLOCK: tl.constexpr):
    """One uneven all-to-all of rows of ``row`` elements, by the protocol above: ``splits``
    (int64 [WORLD]) are the rows of ``inp`` (``in_rows`` rows) for each rank; ``expected`` (with
    ``EXPECTED``) the rows ``out`` (``bound`` rows) receives from each rank; ``SAME_BOUND``:
    every rank's ``bound`` must be the same; ``REPORT``: ``out_splits`` := the rows received
    from each rank. ``region`` holds ``cap_rows`` rows; ``table`` is the table's two slots."""
    dctx = CTX.initialize(context, RANK, WORLD, TRACING)
    call, count, flags = _program_state(sync, programs)
    span = dctx.tracing.begin(OPERATION_EVENT + SITE, op=call)
    headers = headers_of(sync, programs, call, WORLD)
    announced = header_value(call, signature)
    slot = table + (call & 1) * WORLD * LANES
    lanes = dctx.block_offsets(table, 0, LANES)
    mine = _own_row(lanes, splits, expected, in_rows, bound, WORLD, EXPECTED)
    alive = not failed(dctx)  # a failed context sends peers nothing, and its output is NaN
    if alive:
        for q in tl.static_range(WORLD):
            if q != RANK:
                dctx.store(slot + RANK * LANES + lanes, mine, q, mask=lanes < 2 * WORLD + 2)
    tl.store(slot + RANK * LANES + lanes, mine, mask=lanes < 2 * WORLD + 2)
    tl.debug_barrier()  # this rank's row, as every thread of the program reads it below
    announce(dctx, headers, announced, RANK, WORLD)
    count += 1
    _signal_peers(dctx, flags, count, RANK, WORLD)
    ok = alive & _wait_peers(dctx, flags, count, headers, announced, RANK, WORLD, SITE)
    ok = ok & peers_announced(dctx, headers, announced, RANK, WORLD, SITE, False)
    words = dctx.block_offsets(table, 0, TABLE)
    if ok:
        ok = _table_holds(dctx, slot, words, cap_rows, RANK, WORLD, LANES, SITE, SAME_BOUND, EXPECTED)
    count += 1
    if ok:  # every rank's verdict is the same: either all push, or none does
        counts = tl.load(slot + words, mask=(words // LANES < WORLD) & (words % LANES < WORLD), other=0)
        _push_rows(dctx, counts, words, inp, out, region, row, RANK, WORLD, LANES, BLOCK)
        _signal_peers(dctx, flags, count, RANK, WORLD)
        ok = _wait_peers(dctx, flags, count, headers, announced, RANK, WORLD, SITE)
        if ok:
            _take_rows(dctx, counts, words, out, region, out_splits, row, RANK, WORLD, LANES, BLOCK, REPORT)
    _finish(dctx, sync, programs, call, count)
    if not ok:
        poison_blocks(dctx, out, out_numel, out_numel, tl.program_id(0), tl.num_programs(0), BLOCK)
        if REPORT:
            if tl.program_id(0) == 0:
                for s in tl.static_range(WORLD):
                    tl.store(out_splits + s, -1)
    dctx.tracing.end(span)


# -- launching -----------------------------------------------------------------------------------------


def table_lanes(world: int) -> int:
    """Words of one table row (a power of two: one vector)."""
    return triton.next_power_of_2(2 * world + 2)


def table_bytes(world: int) -> int:
    """Bytes of the table's two slots at the front of the workspace (aligned)."""
    return -(-2 * world * table_lanes(world) * 8 // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


def _rows(tensor: torch.Tensor) -> tuple[int, int]:
    """(rows, elements per row) of ``tensor`` along dim 0."""
    return tensor.shape[0], math.prod(tensor.shape[1:])


def _launch(call: CollectiveCall, need_bytes: int | None, expected: torch.Tensor | None,
            out_splits: torch.Tensor | None):
    """Launch :func:`all_to_all_v_kernel` for ``call`` with a receive region of at least
    ``need_bytes`` (the same on every rank; None: the workspace as it is, during a capture)."""
    ctx, world = call.context, call.context.world_size
    in_rows, row = _rows(call.input)
    bound = call.output.shape[0]
    size = call.input.element_size()
    front_bytes = table_bytes(world)
    ws = ctx.workspaces.get(WORKSPACE, front_bytes + (0 if need_bytes is None else need_bytes))
    region_elements = (ws.numel() - front_bytes) // size
    cap_rows = region_elements // row if row else 1 << 62
    if need_bytes is None:
        need_bytes = region_elements * size
    shape = collective_shape(ctx.kernel_device_type, need_bytes)
    grid = (max(1, min(ctx.programs, triton.cdiv(need_bytes // size, shape["BLOCK"]))),)
    options = {key: shape[key] for key in ("num_warps",) if key in shape}
    bits = SAME_SIZE_INTEGER[size]  # rows move as bits: any dtype of the size, and an all-ones poison
    region = ws[front_bytes:front_bytes + region_elements * size].view(bits)
    front = ctx.frontend
    return front.launch(
        all_to_all_v_kernel, grid, context=ctx.get_device_context(), inp=call.input.view(bits),
        out=call.output.view(bits), region=region,
        table=ws[:front_bytes].view(torch.int64), splits=call.input_splits,
        expected=call.input_splits if expected is None else expected,
        out_splits=call.input_splits if out_splits is None else out_splits, sync=ctx.collective_sync(),
        programs=ctx.programs, in_rows=in_rows, bound=bound, cap_rows=cap_rows, row=row,
        out_numel=call.output.numel(), signature=call.signature, CTX=front.device_context,
        TRACING=ctx.tracing.enabled, RANK=ctx.rank, WORLD=world, LANES=table_lanes(world),
        TABLE=table_lanes(world) * triton.next_power_of_2(world), SITE=site_code(call.collective),
        EXPECTED=expected is not None, SAME_BOUND=out_splits is not None, REPORT=out_splits is not None,
        BLOCK=shape["BLOCK"], **options)


def _all_to_all_single(call: CollectiveCall):
    """Host split sizes (``call.input_splits`` / ``output_splits``: device copies). Eager calls
    agree on the receive region with one host exchange (the most bytes a rank receives); a call
    during a capture uses the workspace as it is. Returns no repeat: every eager call makes
    that exchange, on every rank alike."""
    ctx = call.context
    if workspaces.capturing(ctx.device.type):
        need = None
    else:
        rows, row = _rows(call.output)
        # With the call's description: ranks in different calls raise here (iris.context.failstop).
        need = max(ctx._agree_on_call(rows * row * call.output.element_size(), settle=False))
    _launch(call, need, call.output_splits, None)
    return None


def _all_to_all_vdev(call: CollectiveCall):
    """Device split counts (``call.input_splits``), received counts into ``call.output_splits``;
    the receive region is sized by the output's bound, the same on every rank."""
    rows, row = _rows(call.output)
    return _launch(call, rows * row * call.output.element_size(), None, call.output_splits)


ALL_TO_ALL_SINGLE_DIRECT = Algorithm(
    name="direct", collective="all_to_all_single", run=_all_to_all_single, languages=SHARED_SOURCE_LANGUAGES,
    description="every rank publishes its split sizes to every peer, then pushes its rows into each receiver's "
                "region at the offset the sizes give")
ALL_TO_ALL_VDEV_DIRECT = Algorithm(
    name="direct", collective="all_to_all_vdev", run=_all_to_all_vdev, languages=SHARED_SOURCE_LANGUAGES,
    description="every rank publishes its device split counts to every peer, then pushes its rows into each "
                "receiver's region at the offset the counts give")
