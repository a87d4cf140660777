"""Collective kernels and the algorithms that launch them (entry points ``iris.ccl.<collective>``).

One kernel source, :func:`collective_kernel`, serves every collective: it runs the protocol
below and calls the collective's *steps* (what to do with one block before and after an
exchange of signals), passed as constexpr functions. It is compiled by the context's front end
(a Triton kernel for the Triton backend, a Gluon kernel for the Gluon backend). The protocol:

- Data moves by *push*: a rank writes, with remote stores, what a peer needs into that peer's
  workspace (heap), then signals the peer. The workspace has two fixed halves ("slots", ``stride``
  elements apart), used on alternate calls whatever the collective, so calls of different
  collectives and sizes never share bytes between consecutive calls.
- Work is split in blocks of ``BLOCK`` elements; program ``p`` of a grid of ``P`` handles blocks
  ``p, p + P, ...`` on every rank, in at most ``SYNCS`` rounds of groups of ``ROUND`` blocks.
  The rounds are pipelined: step ``i`` pushes round ``i``, then (from step 1) waits until every
  peer's flag ``[p, peer]`` here reaches the count it signalled at step ``i - 1`` and uses what
  that count covers (consumes round ``i - 1``; two-shot: reduces and shares round ``i - 1``, and
  consumes round ``i - 2``), then (but at the last step) signals every peer's flag ``[p, rank]``
  with its next count. A call has ``rounds + 1`` steps (two-shot: ``rounds + 2``), one signal
  fewer. So the local work of one round runs while the next round's stores cross the link, and a
  signal's fence finds those stores mostly done. Programs synchronise only with the same
  program of their peers, and every program does at least one round per call.
- ``P`` is the smaller of the blocks of the call and the programs the sync words are laid out
  for, so a small call launches few programs; the call counts (:mod:`iris_triton.protocol.calls`) still
  agree on a call's number, hence on its slot, across every program index.
- A rank's calls run one after another on its stream. A rank starts call ``k + 1`` only after
  its call ``k`` waited for a signal of every peer's call ``k``, which therefore began, so the
  peer finished call ``k - 1``, the last call that used the slot call ``k + 1`` pushes into:
  data is never overwritten before it was read. The counts live on the heap and
  are advanced by the kernels, so calls need no host work and can be captured in CUDA graphs.

A wait that gives up (after the context's timeout, wall-clock) records the failure in the
context's fault words and the program fills the call's output with NaN (:mod:`iris_triton.protocol.waits`);
the host raises at the call (CPU ranks) or at the next iris call (GPUs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iris.collectives import MOVED_ONLY_DTYPES, Algorithm, CollectiveCall
from iris.errors import IrisError
from iris_triton.device.frontend import SHARED_SOURCE_LANGUAGES
from iris_triton.protocol.calls import LANES, announce, call_number, count_call, header_value, headers_of
from iris_triton.protocol.reductions import own_block, reduce_in_rank_order, stacked_block
from iris_triton.device.tracing import OPERATION_EVENT, WAIT_EVENT
from iris_triton.tuning import ALL_REDUCE_CHOSEN_UP_TO, COLLECTIVE_LAUNCH_SHAPES, collective_shape
from iris_triton.protocol.waits import failed, peers_announced, poison_blocks, site_code, wait_for_call

__all__ = [
    "ALL_GATHER_DIRECT",
    "ALL_REDUCE_ONE_SHOT",
    "ALL_REDUCE_TWO_SHOT",
    "ALL_TO_ALL_DIRECT",
    "BROADCAST_DIRECT",
    "GATHER_DIRECT",
    "REDUCE_DIRECT",
    "REDUCE_SCATTER_DIRECT",
    "SCATTER_DIRECT",
]

# -- device helpers (compiled in the caller's language) ------------------------------------------------


@triton.jit
def _program_state(sync, programs):
    """This program's (call count, signal count, flags of program 0) from the sync words
    ``[calls[programs], counts[programs], flags[programs, WORLD]]``."""
    return call_number(sync), tl.load(sync + programs + tl.program_id(0)), sync + 2 * programs


@triton.jit
def _finish(dctx, sync, programs, call, count):
    """Record this program's signal count and count the call (:mod:`iris_triton.protocol.calls`)."""
    tl.store(sync + programs + tl.program_id(0), count)
    count_call(sync, programs, call, dctx.block_offsets(sync, 0, LANES))


@triton.jit
def _signal_peers(dctx, flags, count, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Release this program's writes so far to every peer: its flag [p, RANK] := ``count``;
    nothing once a failure is recorded on this rank (:mod:`iris_triton.protocol.waits`: a failed context
    sends peers nothing)."""
    if not failed(dctx):
        row = flags + tl.program_id(0) * WORLD
        for q in tl.static_range(WORLD):
            if q != RANK:
                dctx.signal(row + RANK, count, q)


@triton.jit
def _wait_peers(dctx, flags, count, headers, announced, RANK: tl.constexpr, WORLD: tl.constexpr,
                SITE: tl.constexpr):
    """Whether every peer's flag [p, peer] here reached ``count`` within the timeout; a wait
    that gives up records ``SITE`` (the collective's code, :mod:`iris_triton.protocol.waits`), and gives up
    at once where a peer announced another call than ``announced`` in ``headers`` (a mismatch).
    A loop over the peers, not unrolled: each wait spins until its flag arrives before the next
    begins, so unrolling would overlap nothing and would multiply the kernel's code, and the time
    every rank spends compiling it, by the world size."""
    row = flags + tl.program_id(0) * WORLD
    ok = True
    waiting = dctx.tracing.begin(WAIT_EVENT, op=count)
    for q in range(WORLD):
        if q != RANK:
            ok = ok & wait_for_call(dctx, row + q, count, q, headers, announced, SITE)
    dctx.tracing.end(waiting)
    return ok


@triton.jit
def _schedule(n, BLOCK: tl.constexpr, ROUND: tl.constexpr, SYNCS: tl.constexpr):
    """(rounds, groups per round) of this program for ``n`` elements: its blocks, in groups of
    ``ROUND``, split into at most ``SYNCS`` rounds of equal groups (at least one round, and no
    empty round: each costs a signal), pipelined as the module says.
    Fewer rounds cost fewer signals; more rounds overlap more of one round's use with the next
    round's pushes."""
    blocks = tl.cdiv(n, BLOCK)
    groups = tl.cdiv(tl.cdiv(blocks - tl.program_id(0), tl.num_programs(0)), ROUND)
    per_round = tl.maximum(tl.cdiv(groups, SYNCS), 1)
    return tl.maximum(tl.cdiv(groups, per_round), 1), per_round  # no round left empty


@triton.jit
def _block_start(g, k, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    """First element of block ``k`` of group ``g`` of this program."""
    return (tl.program_id(0) + (g * ROUND + k) * tl.num_programs(0)) * BLOCK


@triton.jit
def _reduce(own, received, offs, mask, m, OP: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Every rank's block reduced in rank order (so every rank computing it gets the same bits):
    this rank's from ``own``, peer q's from ``received + q * m``."""
    acc, _ = reduce_in_rank_order(own_block, stacked_block, (own, received, offs, mask, m), RANK, WORLD, OP)
    return acc.to(own.dtype.element_ty)


# -- steps: what a collective does to one block, before and after an exchange of signals --------------
# Every step takes (dctx, offs, inp, out, region, n, m, RANK, WORLD, OP, SRC): ``offs`` are the
# offsets of one block within a segment of ``m`` elements, ``n`` is the input's element count,
# ``region`` is this call's workspace slot, laid out [WORLD sources, m] (two-shot: two of those;
# broadcast and scatter: [m]). ``SRC`` is the root of a rooted collective (the source of broadcast
# and scatter, the destination of reduce and gather): their steps move data only from or to it.


@triton.jit
def _push_own(dctx, offs, inp, out, region, n, m, RANK: tl.constexpr, WORLD: tl.constexpr, OP: tl.constexpr,
              SRC: tl.constexpr):
    """This rank's block of ``inp`` into every peer's region ``RANK``; returns the block."""
    mask = offs < m
    x = tl.load(inp + offs, mask=mask)
    for q in tl.static_range(WORLD):
        if q != RANK:
            dctx.store(region + RANK * m + offs, x, q, mask=mask)
    return x


@triton.jit
def _push_own_and_keep(dctx, offs, inp, out, region, n, m, RANK: tl.constexpr, WORLD: tl.constexpr,
                       OP: tl.constexpr, SRC: tl.constexpr):
    """:func:`_push_own`, and the block into this rank's own segment of ``out`` (all_gather)."""
    x = _push_own(dctx, offs, inp, out, region, n, m, RANK, WORLD, OP, SRC)
    tl.store(out + RANK * m + offs, x, mask=offs < m)


@triton.jit
def _push_segments(dctx, offs, inp, out, region, n, m, RANK: tl.constexpr, WORLD: tl.constexpr,
                   OP: tl.constexpr, SRC: tl.constexpr):
    """Segment q of ``inp`` into peer q's region ``RANK``, for every peer q."""
    for q in tl.static_range(WORLD):
        if q != RANK:
            mask = (offs < m) & (q * m + offs < n)
            dctx.store(region + RANK * m + offs, tl.load(inp + q * m + offs, mask=mask), q, mask=mask)


@triton.jit
def _push_segments_and_keep(dctx, offs, inp, out, region, n, m, RANK: tl.constexpr, WORLD: tl.constexpr,
                            OP: tl.constexpr, SRC: tl.constexpr):
    """:func:`_push_segments`, and this rank's own segment into ``out`` (all_to_all)."""
    _push_segments(dctx, offs, inp, out, region, n, m, RANK, WORLD, OP, SRC)
    mask = offs < m
    tl.store(out + RANK * m + offs, tl.load(inp + RANK * m + offs, mask=mask), mask=mask)


@triton.jit
def _collect(dctx, offs, inp, out, region, n, m, RANK: tl.constexpr, WORLD: tl.constexpr, OP: tl.constexpr,
             SRC: tl.constexpr):
    """Segment q of ``out`` := region q, for every peer q."""
    for q in tl.static_range(WORLD):
        if q != RANK:
            mask = (offs < m) & (q * m + offs < n)
            tl.store(out + q * m + offs, tl.load(region + q * m + offs, mask=mask), mask=mask)


@triton.jit
def _reduce_whole(dctx, offs, inp, out, region, n, m, RANK: tl.constexpr, WORLD: tl.constexpr, OP: tl.constexpr,
                  SRC: tl.constexpr):
    """``out`` := every rank's ``inp`` reduced (one-shot all_reduce)."""
    mask = offs < m
    tl.store(out + offs, _reduce(inp, region, offs, mask, m, OP, RANK, WORLD), mask=mask)


@triton.jit
def _reduce_own_segment(dctx, offs, inp, out, region, n, m, RANK: tl.constexpr, WORLD: tl.constexpr,
                        OP: tl.constexpr, SRC: tl.constexpr):
    """``out`` := every rank's segment ``RANK`` of ``inp`` reduced (reduce_scatter)."""
    mask = offs < m
    tl.store(out + offs, _reduce(inp + RANK * m, region, offs, mask, m, OP, RANK, WORLD), mask=mask)


@triton.jit
def _reduce_and_share_segment(dctx, offs, inp, out, region, n, m, RANK: tl.constexpr, WORLD: tl.constexpr,
                              OP: tl.constexpr, SRC: tl.constexpr):
    """Two-shot all_reduce, between its exchanges: reduce segment ``RANK`` into ``out`` and
    push it into every peer's second region (``region + WORLD * m``), slot ``RANK``."""
    mask = (offs < m) & (RANK * m + offs < n)
    reduced = _reduce(inp + RANK * m, region, offs, mask, m, OP, RANK, WORLD)
    tl.store(out + RANK * m + offs, reduced, mask=mask)
    for q in tl.static_range(WORLD):
        if q != RANK:
            dctx.store(region + WORLD * m + RANK * m + offs, reduced, q, mask=mask)


@triton.jit
def _collect_shared(dctx, offs, inp, out, region, n, m, RANK: tl.constexpr, WORLD: tl.constexpr,
                    OP: tl.constexpr, SRC: tl.constexpr):
    """Two-shot all_reduce, last: segment q of ``out`` := the reduced segment peer q shared."""
    _collect(dctx, offs, inp, out, region + WORLD * m, n, m, RANK, WORLD, OP, SRC)


@triton.jit
def _push_from_source(dctx, offs, inp, out, region, n, m, RANK: tl.constexpr, WORLD: tl.constexpr,
                      OP: tl.constexpr, SRC: tl.constexpr):
    """Broadcast: rank ``SRC``'s block into every peer's region, laid out [m] (only ``SRC``
    pushes)."""
    if RANK == SRC:
        mask = offs < m
        x = tl.load(inp + offs, mask=mask)
        for q in tl.static_range(WORLD):
            if q != RANK:
                dctx.store(region + offs, x, q, mask=mask)


@triton.jit
def _take_from_source(dctx, offs, inp, out, region, n, m, RANK: tl.constexpr, WORLD: tl.constexpr,
                      OP: tl.constexpr, SRC: tl.constexpr):
    """Broadcast: ``out`` := what rank ``SRC`` pushed (on every rank but ``SRC``)."""
    if RANK != SRC:
        mask = offs < m
        tl.store(out + offs, tl.load(region + offs, mask=mask), mask=mask)


@triton.jit
def _push_own_to_root(dctx, offs, inp, out, region, n, m, RANK: tl.constexpr, WORLD: tl.constexpr,
                      OP: tl.constexpr, SRC: tl.constexpr):
    """Reduce and gather: this rank's block of ``inp`` into the root's region ``RANK`` (every rank
    but the root ``SRC``)."""
    if RANK != SRC:
        mask = offs < m
        dctx.store(region + RANK * m + offs, tl.load(inp + offs, mask=mask), SRC, mask=mask)


@triton.jit
def _push_own_to_root_and_keep(dctx, offs, inp, out, region, n, m, RANK: tl.constexpr, WORLD: tl.constexpr,
                               OP: tl.constexpr, SRC: tl.constexpr):
    """Gather: :func:`_push_own_to_root`; the root's block into its own segment of ``out``."""
    _push_own_to_root(dctx, offs, inp, out, region, n, m, RANK, WORLD, OP, SRC)
    if RANK == SRC:
        mask = offs < m
        tl.store(out + RANK * m + offs, tl.load(inp + offs, mask=mask), mask=mask)


@triton.jit
def _reduce_at_root(dctx, offs, inp, out, region, n, m, RANK: tl.constexpr, WORLD: tl.constexpr,
                    OP: tl.constexpr, SRC: tl.constexpr):
    """Reduce: on the root, ``out`` := every rank's ``inp`` reduced (:func:`_reduce_whole`)."""
    if RANK == SRC:
        _reduce_whole(dctx, offs, inp, out, region, n, m, RANK, WORLD, OP, SRC)


@triton.jit
def _collect_at_root(dctx, offs, inp, out, region, n, m, RANK: tl.constexpr, WORLD: tl.constexpr,
                     OP: tl.constexpr, SRC: tl.constexpr):
    """Gather: on the root, segment q of ``out`` := region q, for every peer q (:func:`_collect`)."""
    if RANK == SRC:
        _collect(dctx, offs, inp, out, region, n, m, RANK, WORLD, OP, SRC)


@triton.jit
def _push_segments_from_root(dctx, offs, inp, out, region, n, m, RANK: tl.constexpr, WORLD: tl.constexpr,
                             OP: tl.constexpr, SRC: tl.constexpr):
    """Scatter: on the root ``SRC``, segment q of ``inp`` into peer q's region, laid out [m], for
    every peer q, and its own segment into ``out``; the other ranks' ``inp`` is not read. What
    arrived, :func:`_take_from_source` takes."""
    if RANK == SRC:
        mask = offs < m
        for q in tl.static_range(WORLD):
            x = tl.load(inp + q * m + offs, mask=mask)
            if q == RANK:
                tl.store(out + offs, x, mask=mask)
            else:
                dctx.store(region + offs, x, q, mask=mask)


@triton.jit
def _each_block(STEP: tl.constexpr, dctx, r, per_round, inp, out, region, n, m, RANK: tl.constexpr,
                WORLD: tl.constexpr, OP: tl.constexpr, SRC: tl.constexpr, BLOCK: tl.constexpr,
                ROUND: tl.constexpr):
    """``STEP`` on every block of round ``r`` of this program."""
    for g in range(r * per_round, (r + 1) * per_round):
        for k in tl.static_range(ROUND):
            offs = dctx.block_offsets(inp, _block_start(g, k, ROUND, BLOCK), BLOCK)
            STEP(dctx, offs, inp, out, region, n, m, RANK, WORLD, OP, SRC)


# -- the kernel source ---------------------------------------------------------------------------------


def collective_kernel(context, inp, out, ws, sync, programs, n, m, out_numel, stride, signature, CTX: tl.constexpr,
                      TRACING: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, PUSH: tl.constexpr,
                      MIDDLE: tl.constexpr, CONSUME: tl.constexpr, OP: tl.constexpr, SRC: tl.constexpr,
                      SITE: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr, SYNCS: tl.constexpr):
    """One collective, by the protocol above: ``PUSH`` every block of a round, (two-shot)
    ``MIDDLE`` every block of it once the peers pushed theirs, ``CONSUME`` every block once the
    peers pushed (two-shot: shared) theirs; the signals and waits between steps as the module
    says.
    Blocks cover segments of ``m`` elements; ``n`` is the input's element count; ``stride`` is
    the distance between the workspace's two slots (elements); ``programs`` is the number of
    programs the sync words are laid out for (the grid may be smaller). The waits are bounded by
    the context's timeout and record a give-up in its fault words (:mod:`iris_triton.protocol.waits`),
    after which the program fills ``out`` (``out_numel`` elements) with NaN (integers: -1). Before its
    first signal a program announces the call (its number and ``signature``) to its peers, and
    after its first wait it checks what they announced: a peer in a different call is a failure,
    not data (:func:`iris_triton.protocol.calls.announce`); every wait also reads the headers, so a peer in a
    different call (whatever algorithm it runs) fails the call as soon as its header lands."""
    dctx = CTX.initialize(context, RANK, WORLD, TRACING)
    call, count, flags = _program_state(sync, programs)
    span = dctx.tracing.begin(OPERATION_EVENT + SITE, nbytes=n * (inp.dtype.element_ty.primitive_bitwidth // 8),
                              op=call)
    headers = headers_of(sync, programs, call, WORLD)
    announced = header_value(call, signature)
    announce(dctx, headers, announced, RANK, WORLD)
    region = ws + (call & 1) * stride
    rounds, per_round = _schedule(m, BLOCK, ROUND, SYNCS)
    lag: tl.constexpr = 1 if MIDDLE is None else 2  # steps between a round's push and its consume
    ok = not failed(dctx)  # every wait so far succeeded, on a context that had not failed before
    for i in range(rounds + lag):
        if (i < rounds) & ok:  # after a give-up nothing more reaches a peer
            _each_block(PUSH, dctx, i, per_round, inp, out, region, n, m, RANK, WORLD, OP, SRC, BLOCK, ROUND)
        if i > 0:  # the peers' count of step i - 1 covers their pushes up to round i - 1
            ok = ok & _wait_peers(dctx, flags, count, headers, announced, RANK, WORLD, SITE)
            if i == 1:
                ok = ok & peers_announced(dctx, headers, announced, RANK, WORLD, SITE, False)
            if MIDDLE is not None:
                if (i <= rounds) & ok:
                    _each_block(MIDDLE, dctx, i - 1, per_round, inp, out, region, n, m, RANK, WORLD, OP, SRC,
                                BLOCK, ROUND)
            if i >= lag:
                _each_block(CONSUME, dctx, i - lag, per_round, inp, out, region, n, m, RANK, WORLD, OP, SRC,
                            BLOCK, ROUND)
        if i < rounds + lag - 1:
            count += 1
            if ok:  # after a give-up, nothing this program computes may reach a peer as valid
                _signal_peers(dctx, flags, count, RANK, WORLD)
    _finish(dctx, sync, programs, call, count)
    if not ok:
        poison_blocks(dctx, out, out_numel, m, tl.program_id(0), tl.num_programs(0), BLOCK)
    dctx.tracing.end(span)


# -- launching -----------------------------------------------------------------------------------------

#: Offsets are 32-bit: a workspace larger than this many elements needs the call split.
MAX_WORKSPACE_ELEMENTS = 2**31 - 1
#: Byte alignment of the two workspace slots (keeps 16-byte vector accesses).
SLOT_ALIGNMENT = 256


def _launch(call: CollectiveCall, n: int, m: int, slot_elements: int, push, consume, middle=None):
    """Launch :func:`collective_kernel` for ``call`` with its steps, ``n`` input elements,
    segments of ``m`` and a workspace slot of ``slot_elements`` of the call's dtype; returns
    the launch's repeat (:meth:`Frontend.launch`). A rank without an input (scatter's but the
    root) passes its output in its place, never read; one without an output (reduce's and
    gather's but the root) its input, never written (nor filled with NaN when a wait gives up).
    Elements only moved, never computed with (fp8), move as bytes."""
    ctx = call.context
    inp = call.input if call.input is not None else call.output
    out, out_numel = (call.output, call.output.numel()) if call.output is not None else (inp, 0)
    if inp.dtype in MOVED_ONLY_DTYPES:
        inp, out = inp.view(torch.uint8), out.view(torch.uint8)
    element_size = inp.element_size()
    slot_bytes = -(-slot_elements * element_size // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
    workspace = ctx.workspaces.get("collectives", 2 * slot_bytes)
    stride = workspace.numel() // 2 // SLOT_ALIGNMENT * SLOT_ALIGNMENT // element_size  # between the halves
    if 2 * stride > MAX_WORKSPACE_ELEMENTS:
        raise IrisError(f"{call.collective}: {call.nbytes // element_size} elements per rank is too large for one "
                        f"call (workspace offsets are 32-bit); split it into smaller calls")
    ws = workspace[: 2 * stride * element_size].view(inp.dtype)
    front = ctx.frontend
    shape = collective_shape(ctx.kernel_device_type, call.nbytes, call.launch_shape)
    grid = (max(1, min(ctx.programs, triton.cdiv(m, shape["BLOCK"]))),)
    return front.launch(
        collective_kernel, grid, context=ctx.get_device_context(), inp=inp, out=out, ws=ws,
        sync=ctx.collective_sync(), programs=ctx.programs, n=n, m=m, out_numel=out_numel, stride=stride,
        signature=call.signature,
        CTX=front.device_context, TRACING=ctx.tracing.enabled, RANK=ctx.rank, WORLD=ctx.world_size, PUSH=push,
        MIDDLE=middle, CONSUME=consume, OP=call.op, SRC=call.src, SITE=site_code(call.collective), **shape)


def _all_gather(call: CollectiveCall):
    m, world = call.input.numel(), call.context.world_size
    return _launch(call, world * m, m, world * m, _push_own_and_keep, _collect)


def _all_to_all(call: CollectiveCall):
    n = call.input.numel()
    return _launch(call, n, n // call.context.world_size, n, _push_segments_and_keep, _collect)


def _reduce_scatter(call: CollectiveCall):
    n = call.input.numel()
    return _launch(call, n, call.output.numel(), n, _push_segments, _reduce_own_segment)


def _all_reduce_one_shot(call: CollectiveCall):
    n = call.input.numel()
    return _launch(call, n, n, call.context.world_size * n, _push_own, _reduce_whole)


def _all_reduce_two_shot(call: CollectiveCall):
    n, world = call.input.numel(), call.context.world_size
    m = triton.cdiv(n, world)
    return _launch(call, n, m, 2 * world * m, _push_segments, _collect_shared, middle=_reduce_and_share_segment)


def _broadcast(call: CollectiveCall):
    n = call.input.numel()
    return _launch(call, n, n, n, _push_from_source, _take_from_source)


def _reduce_to_root(call: CollectiveCall):
    n = call.input.numel()
    return _launch(call, n, n, call.context.world_size * n, _push_own_to_root, _reduce_at_root)


def _gather(call: CollectiveCall):
    m, world = call.input.numel(), call.context.world_size
    return _launch(call, world * m, m, world * m, _push_own_to_root_and_keep, _collect_at_root)


def _scatter(call: CollectiveCall):
    m = call.output.numel()
    return _launch(call, call.context.world_size * m, m, m, _push_segments_from_root, _take_from_source)


ALL_GATHER_DIRECT = Algorithm(
    name="direct", collective="all_gather", run=_all_gather, languages=SHARED_SOURCE_LANGUAGES,
    description="every rank pushes its input into every peer",
    launch_shapes=COLLECTIVE_LAUNCH_SHAPES)
ALL_TO_ALL_DIRECT = Algorithm(
    name="direct", collective="all_to_all", run=_all_to_all, languages=SHARED_SOURCE_LANGUAGES,
    description="every rank pushes segment q of its input to rank q",
    launch_shapes=COLLECTIVE_LAUNCH_SHAPES)
REDUCE_SCATTER_DIRECT = Algorithm(
    name="direct", collective="reduce_scatter", run=_reduce_scatter, languages=SHARED_SOURCE_LANGUAGES,
    description="every rank pushes segment q to rank q, which reduces",
    launch_shapes=COLLECTIVE_LAUNCH_SHAPES)
ALL_REDUCE_ONE_SHOT = Algorithm(
    name="one_shot", collective="all_reduce", run=_all_reduce_one_shot, languages=SHARED_SOURCE_LANGUAGES,
    description="every rank receives every input and reduces",
    priority=10, chosen_up_to=ALL_REDUCE_CHOSEN_UP_TO["one_shot"],
    launch_shapes=COLLECTIVE_LAUNCH_SHAPES)
ALL_REDUCE_TWO_SHOT = Algorithm(
    name="two_shot", collective="all_reduce", run=_all_reduce_two_shot, languages=SHARED_SOURCE_LANGUAGES,
    description="reduce-scatter then all-gather of the reduced segments, one round behind",
    launch_shapes=COLLECTIVE_LAUNCH_SHAPES)
BROADCAST_DIRECT = Algorithm(
    name="direct", collective="broadcast", run=_broadcast, languages=SHARED_SOURCE_LANGUAGES,
    description="the source pushes into every peer",
    launch_shapes=COLLECTIVE_LAUNCH_SHAPES)
REDUCE_DIRECT = Algorithm(
    name="direct", collective="reduce", run=_reduce_to_root, languages=SHARED_SOURCE_LANGUAGES,
    description="every rank pushes its input into the root, which reduces",
    launch_shapes=COLLECTIVE_LAUNCH_SHAPES)
GATHER_DIRECT = Algorithm(
    name="direct", collective="gather", run=_gather, languages=SHARED_SOURCE_LANGUAGES,
    description="every rank pushes its input into the root",
    launch_shapes=COLLECTIVE_LAUNCH_SHAPES)
SCATTER_DIRECT = Algorithm(
    name="direct", collective="scatter", run=_scatter, languages=SHARED_SOURCE_LANGUAGES,
    description="the root pushes segment q of its input to rank q",
    launch_shapes=COLLECTIVE_LAUNCH_SHAPES)
