"""Collective kernels and the algorithms that launch them (entry points ``iris.ccl.<collective>``).

Each kernel is one source, compiled by the context's front end (a Triton kernel for the Triton
backend, a Gluon kernel for the Gluon backend). All follow one protocol:

- Data moves by *push*: a rank writes, with remote stores, what a peer needs into that peer's
  workspace (heap), then signals the peer. The workspace has two fixed halves ("slots", ``stride``
  elements apart), used on alternate calls whatever the collective, so calls of different
  collectives and sizes never share bytes between consecutive calls.
- Work is split in blocks of ``BLOCK`` elements; program ``p`` handles blocks ``p, p + P, ...``
  on every rank, in at most ``SYNCS`` rounds of groups of ``ROUND`` blocks: push the round's blocks, signal every peer's
  flag ``[p, rank]`` with the program's signal count, wait until every peer's flag ``[p, peer]``
  here reaches that count, then consume the round's blocks from the local workspace. Programs
  synchronise only with the same program of their peers, and every program does at least one
  round per call.
- So a rank is never more than one call ahead of a peer (program by program), and the slot it
  pushes into was consumed one call earlier: data is never overwritten before it was read.
  The counts live on the heap and are advanced by the kernels, so calls need no host work and
  can be captured in CUDA graphs.

A wait that times out records the peer in the context's ``wait_failures`` (reported by the next
``ctx.barrier()``) and the call goes on rather than hang.
"""

from __future__ import annotations

import triton
import triton.language as tl

from iris.collectives import Algorithm, CollectiveCall
from iris.errors import IrisError

__all__ = [
    "ALL_GATHER_DIRECT",
    "ALL_REDUCE_ONE_SHOT",
    "ALL_REDUCE_TWO_SHOT",
    "ALL_TO_ALL_DIRECT",
    "BROADCAST_DIRECT",
    "REDUCE_SCATTER_DIRECT",
]

# -- device helpers (compiled in the caller's language) ------------------------------------------------


@triton.jit
def _program_state(sync, WORLD: tl.constexpr):
    """This program's (call count, signal count, flags of program 0) from the sync words
    ``[calls[P], counts[P], flags[P, WORLD]]``."""
    p = tl.program_id(0)
    programs = tl.num_programs(0)
    return tl.load(sync + p), tl.load(sync + programs + p), sync + 2 * programs


@triton.jit
def _finish(sync, call, count):
    p = tl.program_id(0)
    tl.store(sync + tl.num_programs(0) + p, count)
    tl.store(sync + p, call + 1)


@triton.jit
def _exchange_signals(dctx, flags, count, failures, max_spins, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Signal every peer (its flag [p, RANK] := count), then wait for every peer's signal here."""
    row = flags + tl.program_id(0) * WORLD
    for q in tl.static_range(WORLD):
        if q != RANK:
            dctx.signal(row + RANK, count, q)
    for q in tl.static_range(WORLD):
        if q != RANK:
            if not dctx.wait_until(row + q, count, RANK, max_spins):
                tl.store(failures + q, 1)


@triton.jit
def _schedule(n, BLOCK: tl.constexpr, ROUND: tl.constexpr, SYNCS: tl.constexpr):
    """(rounds, groups per round) of this program for ``n`` elements: its blocks, in groups of
    ``ROUND``, split into at most ``SYNCS`` rounds (at least one), each ending in one exchange of
    signals. Fewer rounds wait less; more rounds overlap one round's pushes with another's use."""
    blocks = tl.cdiv(n, BLOCK)
    groups = tl.cdiv(tl.cdiv(blocks - tl.program_id(0), tl.num_programs(0)), ROUND)
    rounds = tl.maximum(tl.minimum(groups, SYNCS), 1)
    return rounds, tl.cdiv(groups, rounds)


@triton.jit
def _block_start(g, k, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    """First element of block ``k`` of group ``g`` of this program."""
    return (tl.program_id(0) + (g * ROUND + k) * tl.num_programs(0)) * BLOCK


@triton.jit
def _widen(x):
    """``x`` in the type reductions accumulate in (float32 for 16-bit floats)."""
    if x.dtype.is_fp16() or x.dtype.is_bf16():
        x = x.to(tl.float32)
    return x


@triton.jit
def _combine(acc, x, OP: tl.constexpr):
    if OP == "sum":
        acc = acc + x
    elif OP == "max":
        acc = tl.maximum(acc, x)
    else:
        tl.static_assert(OP == "min", "OP must be 'sum', 'max' or 'min'")
        acc = tl.minimum(acc, x)
    return acc


@triton.jit
def _reduce(own, received, offs, mask, m, OP: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Every rank's block reduced in rank order (so every rank computing it gets the same bits):
    this rank's from ``own``, peer q's from ``received + q * m``."""
    for q in tl.static_range(WORLD):
        if q == RANK:
            x = _widen(tl.load(own + offs, mask=mask))
        else:
            x = _widen(tl.load(received + q * m + offs, mask=mask))
        if q == 0:
            acc = x
        else:
            acc = _combine(acc, x, OP)
    return acc.to(own.dtype.element_ty)


# -- kernel sources ------------------------------------------------------------------------------------
# Arguments common to all: context (device-context tensor), sync (int32 words), failures (int32 per
# peer), stride (elements between the workspace's two slots), max_spins; CTX (device-context class),
# RANK, WORLD, BLOCK, ROUND, SYNCS as constexprs.


def all_gather_kernel(context, inp, out, ws, sync, failures, n, stride, max_spins, CTX: tl.constexpr,
                      RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr,
                      SYNCS: tl.constexpr):
    """out[q * n:(q + 1) * n] := rank q's inp[:n]. Slot: [WORLD sources, n]."""
    dctx = CTX.initialize(context, RANK, WORLD)
    call, count, flags = _program_state(sync, WORLD)
    region = ws + (call % 2) * stride
    rounds, per_round = _schedule(n, BLOCK, ROUND, SYNCS)
    for r in range(rounds):
        for g in range(r * per_round, (r + 1) * per_round):
            for k in tl.static_range(ROUND):
                offs = dctx.block_offsets(inp, _block_start(g, k, ROUND, BLOCK), BLOCK)
                mask = offs < n
                x = tl.load(inp + offs, mask=mask)
                tl.store(out + RANK * n + offs, x, mask=mask)
                for q in tl.static_range(WORLD):
                    if q != RANK:
                        dctx.store(region + RANK * n + offs, x, q, mask=mask)
        count += 1
        _exchange_signals(dctx, flags, count, failures, max_spins, RANK, WORLD)
        for g in range(r * per_round, (r + 1) * per_round):
            for k in tl.static_range(ROUND):
                offs = dctx.block_offsets(inp, _block_start(g, k, ROUND, BLOCK), BLOCK)
                mask = offs < n
                for q in tl.static_range(WORLD):
                    if q != RANK:
                        tl.store(out + q * n + offs, tl.load(region + q * n + offs, mask=mask), mask=mask)
    _finish(sync, call, count)


def all_to_all_kernel(context, inp, out, ws, sync, failures, m, stride, max_spins, CTX: tl.constexpr, RANK: tl.constexpr,
                      WORLD: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr,
                      SYNCS: tl.constexpr):
    """out[q * m:(q + 1) * m] := rank q's inp[RANK * m:(RANK + 1) * m]. Slot: [WORLD, m]."""
    dctx = CTX.initialize(context, RANK, WORLD)
    call, count, flags = _program_state(sync, WORLD)
    region = ws + (call % 2) * stride
    rounds, per_round = _schedule(m, BLOCK, ROUND, SYNCS)
    for r in range(rounds):
        for g in range(r * per_round, (r + 1) * per_round):
            for k in tl.static_range(ROUND):
                offs = dctx.block_offsets(inp, _block_start(g, k, ROUND, BLOCK), BLOCK)
                mask = offs < m
                for q in tl.static_range(WORLD):
                    x = tl.load(inp + q * m + offs, mask=mask)
                    if q == RANK:
                        tl.store(out + RANK * m + offs, x, mask=mask)
                    else:
                        dctx.store(region + RANK * m + offs, x, q, mask=mask)
        count += 1
        _exchange_signals(dctx, flags, count, failures, max_spins, RANK, WORLD)
        for g in range(r * per_round, (r + 1) * per_round):
            for k in tl.static_range(ROUND):
                offs = dctx.block_offsets(inp, _block_start(g, k, ROUND, BLOCK), BLOCK)
                mask = offs < m
                for q in tl.static_range(WORLD):
                    if q != RANK:
                        tl.store(out + q * m + offs, tl.load(region + q * m + offs, mask=mask), mask=mask)
    _finish(sync, call, count)


def reduce_scatter_kernel(context, inp, out, ws, sync, failures, m, stride, max_spins, CTX: tl.constexpr,
                          RANK: tl.constexpr, WORLD: tl.constexpr, OP: tl.constexpr, BLOCK: tl.constexpr,
                          ROUND: tl.constexpr, SYNCS: tl.constexpr):
    """out[:m] := the reduction over ranks q of rank q's inp[RANK * m:(RANK + 1) * m].
    Slot: [WORLD, m]."""
    dctx = CTX.initialize(context, RANK, WORLD)
    call, count, flags = _program_state(sync, WORLD)
    region = ws + (call % 2) * stride
    rounds, per_round = _schedule(m, BLOCK, ROUND, SYNCS)
    for r in range(rounds):
        for g in range(r * per_round, (r + 1) * per_round):
            for k in tl.static_range(ROUND):
                offs = dctx.block_offsets(inp, _block_start(g, k, ROUND, BLOCK), BLOCK)
                mask = offs < m
                for q in tl.static_range(WORLD):
                    if q != RANK:
                        dctx.store(region + RANK * m + offs, tl.load(inp + q * m + offs, mask=mask), q, mask=mask)
        count += 1
        _exchange_signals(dctx, flags, count, failures, max_spins, RANK, WORLD)
        for g in range(r * per_round, (r + 1) * per_round):
            for k in tl.static_range(ROUND):
                offs = dctx.block_offsets(inp, _block_start(g, k, ROUND, BLOCK), BLOCK)
                mask = offs < m
                tl.store(out + offs, _reduce(inp + RANK * m, region, offs, mask, m, OP, RANK, WORLD), mask=mask)
    _finish(sync, call, count)


def all_reduce_one_shot_kernel(context, inp, out, ws, sync, failures, n, stride, max_spins, CTX: tl.constexpr,
                               RANK: tl.constexpr, WORLD: tl.constexpr, OP: tl.constexpr, BLOCK: tl.constexpr,
                               ROUND: tl.constexpr, SYNCS: tl.constexpr):
    """out[:n] := the reduction over ranks of inp[:n] (out may be inp). Every rank receives every
    input and reduces all of them itself. Slot: [WORLD, n]."""
    dctx = CTX.initialize(context, RANK, WORLD)
    call, count, flags = _program_state(sync, WORLD)
    region = ws + (call % 2) * stride
    rounds, per_round = _schedule(n, BLOCK, ROUND, SYNCS)
    for r in range(rounds):
        for g in range(r * per_round, (r + 1) * per_round):
            for k in tl.static_range(ROUND):
                offs = dctx.block_offsets(inp, _block_start(g, k, ROUND, BLOCK), BLOCK)
                mask = offs < n
                x = tl.load(inp + offs, mask=mask)
                for q in tl.static_range(WORLD):
                    if q != RANK:
                        dctx.store(region + RANK * n + offs, x, q, mask=mask)
        count += 1
        _exchange_signals(dctx, flags, count, failures, max_spins, RANK, WORLD)
        for g in range(r * per_round, (r + 1) * per_round):
            for k in tl.static_range(ROUND):
                offs = dctx.block_offsets(inp, _block_start(g, k, ROUND, BLOCK), BLOCK)
                mask = offs < n
                tl.store(out + offs, _reduce(inp, region, offs, mask, n, OP, RANK, WORLD), mask=mask)
    _finish(sync, call, count)


def all_reduce_two_shot_kernel(context, inp, out, ws, sync, failures, n, m, stride, max_spins, CTX: tl.constexpr,
                               RANK: tl.constexpr, WORLD: tl.constexpr, OP: tl.constexpr, BLOCK: tl.constexpr,
                               ROUND: tl.constexpr, SYNCS: tl.constexpr):
    """out[:n] := the reduction over ranks of inp[:n] (out may be inp), in two exchanges of
    segments of ``m = cdiv(n, WORLD)`` elements: rank q reduces segment q (reduce-scatter), then
    sends the result to every rank (all-gather). Slot: [2 exchanges, WORLD, m]."""
    dctx = CTX.initialize(context, RANK, WORLD)
    call, count, flags = _program_state(sync, WORLD)
    scattered = ws + (call % 2) * stride
    gathered = scattered + WORLD * m
    rounds, per_round = _schedule(m, BLOCK, ROUND, SYNCS)
    for r in range(rounds):
        for g in range(r * per_round, (r + 1) * per_round):
            for k in tl.static_range(ROUND):
                offs = dctx.block_offsets(inp, _block_start(g, k, ROUND, BLOCK), BLOCK)
                for q in tl.static_range(WORLD):
                    if q != RANK:
                        mask = (offs < m) & (q * m + offs < n)
                        dctx.store(scattered + RANK * m + offs, tl.load(inp + q * m + offs, mask=mask), q, mask=mask)
        count += 1
        _exchange_signals(dctx, flags, count, failures, max_spins, RANK, WORLD)
        for g in range(r * per_round, (r + 1) * per_round):
            for k in tl.static_range(ROUND):
                offs = dctx.block_offsets(inp, _block_start(g, k, ROUND, BLOCK), BLOCK)
                mask = (offs < m) & (RANK * m + offs < n)
                reduced = _reduce(inp + RANK * m, scattered, offs, mask, m, OP, RANK, WORLD)
                tl.store(out + RANK * m + offs, reduced, mask=mask)
                for q in tl.static_range(WORLD):
                    if q != RANK:
                        dctx.store(gathered + RANK * m + offs, reduced, q, mask=mask)
        count += 1
        _exchange_signals(dctx, flags, count, failures, max_spins, RANK, WORLD)
        for g in range(r * per_round, (r + 1) * per_round):
            for k in tl.static_range(ROUND):
                offs = dctx.block_offsets(inp, _block_start(g, k, ROUND, BLOCK), BLOCK)
                for q in tl.static_range(WORLD):
                    if q != RANK:
                        mask = (offs < m) & (q * m + offs < n)
                        tl.store(out + q * m + offs, tl.load(gathered + q * m + offs, mask=mask), mask=mask)
    _finish(sync, call, count)


def broadcast_kernel(context, buf, ws, sync, failures, n, stride, max_spins, CTX: tl.constexpr, RANK: tl.constexpr,
                     WORLD: tl.constexpr, SRC: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr,
                     SYNCS: tl.constexpr):
    """buf[:n] := rank SRC's buf[:n]. Every rank signals every round, so none runs ahead of
    the others. Slot: [n]."""
    dctx = CTX.initialize(context, RANK, WORLD)
    call, count, flags = _program_state(sync, WORLD)
    region = ws + (call % 2) * stride
    rounds, per_round = _schedule(n, BLOCK, ROUND, SYNCS)
    for r in range(rounds):
        if RANK == SRC:
            for g in range(r * per_round, (r + 1) * per_round):
                for k in tl.static_range(ROUND):
                    offs = dctx.block_offsets(buf, _block_start(g, k, ROUND, BLOCK), BLOCK)
                    mask = offs < n
                    x = tl.load(buf + offs, mask=mask)
                    for q in tl.static_range(WORLD):
                        if q != RANK:
                            dctx.store(region + offs, x, q, mask=mask)
        count += 1
        _exchange_signals(dctx, flags, count, failures, max_spins, RANK, WORLD)
        if RANK != SRC:
            for g in range(r * per_round, (r + 1) * per_round):
                for k in tl.static_range(ROUND):
                    offs = dctx.block_offsets(buf, _block_start(g, k, ROUND, BLOCK), BLOCK)
                    mask = offs < n
                    tl.store(buf + offs, tl.load(region + offs, mask=mask), mask=mask)
    _finish(sync, call, count)


# -- launching -----------------------------------------------------------------------------------------

#: Launch shape per device type: elements per block, blocks per group (unrolled), most exchanges
#: of signals per call, warps.
CONFIGS = {"cuda": dict(BLOCK=4096, ROUND=4, SYNCS=8, num_warps=8), "cpu": dict(BLOCK=64, ROUND=2, SYNCS=2)}
#: Offsets are 32-bit: a workspace larger than this many elements needs the call split.
MAX_WORKSPACE_ELEMENTS = 2**31 - 1
#: Byte alignment of the two workspace slots (keeps 16-byte vector accesses).
SLOT_ALIGNMENT = 256


def _launch(call: CollectiveCall, source, slot_elements: int, tensors: tuple, sizes: tuple, **constexprs) -> None:
    """Launch kernel ``source`` for ``call``, whose workspace slot holds ``slot_elements`` of
    the call's dtype. The kernels' arguments are ``context, *tensors, ws, sync, failures,
    *sizes, stride, max_spins`` and the constexprs."""
    ctx = call.context
    element_size = call.input.element_size()
    slot_bytes = -(-slot_elements * element_size // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
    workspace = ctx.ccl.workspace(2 * slot_bytes)
    stride = workspace.numel() // 2 // SLOT_ALIGNMENT * SLOT_ALIGNMENT // element_size  # between the halves
    if 2 * stride > MAX_WORKSPACE_ELEMENTS:
        raise IrisError(f"{call.collective}: {call.input.numel()} elements per rank is too large for one call "
                        f"(workspace offsets are 32-bit); split it into smaller calls")
    ws = workspace[: 2 * stride * element_size].view(call.input.dtype)
    front = ctx.frontend
    front.kernel(source)[(ctx.ccl.programs,)](
        ctx.get_device_context(), *tensors, ws, ctx.ccl.sync_state(), ctx.wait_failures, *sizes, stride, ctx.max_spins,
        CTX=front.device_context, RANK=ctx.rank, WORLD=ctx.world_size, **CONFIGS[ctx.device.type], **constexprs)


def _all_gather(call: CollectiveCall) -> None:
    n = call.input.numel()
    _launch(call, all_gather_kernel, call.context.world_size * n, (call.input, call.output), (n,))


def _all_to_all(call: CollectiveCall) -> None:
    m = call.input.numel() // call.context.world_size
    _launch(call, all_to_all_kernel, call.input.numel(), (call.input, call.output), (m,))


def _reduce_scatter(call: CollectiveCall) -> None:
    m = call.output.numel()
    _launch(call, reduce_scatter_kernel, call.input.numel(), (call.input, call.output), (m,), OP=call.op)


def _all_reduce_one_shot(call: CollectiveCall) -> None:
    n = call.input.numel()
    _launch(call, all_reduce_one_shot_kernel, call.context.world_size * n, (call.input, call.output), (n,),
            OP=call.op)


def _all_reduce_two_shot(call: CollectiveCall) -> None:
    n, world = call.input.numel(), call.context.world_size
    m = triton.cdiv(n, world)
    _launch(call, all_reduce_two_shot_kernel, 2 * world * m, (call.input, call.output), (n, m), OP=call.op)


def _broadcast(call: CollectiveCall) -> None:
    n = call.input.numel()
    _launch(call, broadcast_kernel, n, (call.input,), (n,), SRC=call.src)


ALL_GATHER_DIRECT = Algorithm(name="direct", collective="all_gather", run=_all_gather,
                              description="every rank pushes its input into every peer; one exchange")
ALL_TO_ALL_DIRECT = Algorithm(name="direct", collective="all_to_all", run=_all_to_all,
                              description="every rank pushes segment q of its input to rank q; one exchange")
REDUCE_SCATTER_DIRECT = Algorithm(name="direct", collective="reduce_scatter", run=_reduce_scatter,
                                  description="every rank pushes segment q to rank q, which reduces; one exchange")
ALL_REDUCE_ONE_SHOT = Algorithm(name="one_shot", collective="all_reduce", run=_all_reduce_one_shot,
                                description="every rank receives every input and reduces; one exchange")
ALL_REDUCE_TWO_SHOT = Algorithm(name="two_shot", collective="all_reduce", run=_all_reduce_two_shot,
                                description="reduce-scatter then all-gather of the reduced segments; two exchanges")
BROADCAST_DIRECT = Algorithm(name="direct", collective="broadcast", run=_broadcast,
                             description="the source pushes into every peer; one exchange")
