"""Dedicated MoE dispatch kernels: every token read once and written straight into the receive
buffers of the ranks that own its experts, in the expert-major layout, in two launches.

1. :func:`announce_route_kernel` (a program per chunk of tokens): the routing of this rank's
   pairs (:mod:`iris_triton.operations.moe_routing`: positions within each chunk, each chunk's
   counts), then by the last program to finish: the chunks' offsets, the rank's row of counts
   published into every peer's routing table (``table[RANK]`` of the call's slot), the call
   announced in every peer's header ``RANK``, and the table's flag set on every peer.
2. :func:`push_kernel` (``P`` programs): its tokens' positions made the rank's; once every peer's
   row landed (bounded waits that check the peer's header), every rank holds the same table and
   reaches the same verdict (an id out of range on some rank, or an expert over ``capacity``:
   nothing is sent, the failure recorded for the rank it concerns). Otherwise program ``p`` pushes
   tokens ``p, p + P, ...``: each routed pair's row goes to slot ``[l, offset]`` of its expert's
   rank (local expert ``l``; ``offset``: the rows of that expert from lower ranks, then the
   pair's position; the handle keeps that slot, for combine), with its source rank, token index
   and slot; it clears the sources of its share of the slots past the rows its rank receives
   (-1) and sets its *done* flag on every rank. The last program to finish waits for every
   rank's programs, then writes the counts, or on a failure poisons every output (all-ones bits).

Flags carry the call's number + 1, counted on the device (``calls``: advanced by the first
kernel), so a captured call replays correctly; the slot's buffers alternate on the host by call
parity and are passed to the kernels as addresses.
"""

from __future__ import annotations

from typing import Any

import attrs
import triton
import triton.language as tl

from iris.tuning import bucket  # a power of two of at least n, without triton.next_power_of_2's call cost
from iris_triton.device.compiled import INTERPRETING
from iris_triton.device.context import DeviceContext
from iris_triton.device.frontend import LaunchCache
from iris_triton.operations.moe import FP8_MAX
from iris_triton.operations.moe_routing import final_positions, route_chunk, scan_chunks
from iris_triton.protocol.calls import announce, header_value
from iris_triton.tuning import MOE_SHAPES
from iris_triton.protocol.waits import EXPERT_CAPACITY, EXPERT_IDS, STALE_DISPATCH, failed, peers_announced, \
    poison_blocks, record_failure, site_code, wait_all_or_record, wait_for_peer_call

__all__ = ["announce_route_kernel", "push_kernel"]

SITE: tl.constexpr = tl.constexpr(site_code("moe_dispatch"))
COMBINE_SITE: tl.constexpr = tl.constexpr(site_code("moe_combine"))
INTERPRETED: tl.constexpr = tl.constexpr(INTERPRETING)
FP8_LARGEST: tl.constexpr = tl.constexpr(FP8_MAX)
#: Tokens a step of the push kernel's :func:`final_positions` takes.
FINAL_TOKENS: tl.constexpr = tl.constexpr(16)
#: Slots a program of the push kernel clears at a time: small enough that every program takes a
#: share of a few tokens' slots, rather than one program all of them.
CLEARED_SLOTS: tl.constexpr = tl.constexpr(1024)


@triton.jit
def _fma(a, b, c):
    """``a * b + c`` in float32 with one rounding, as a GPU's fma and torch's addcmul: the
    interpreter's ``tl.fma`` rounds twice, so there it is computed in float64 and rounded once."""
    if INTERPRETED:
        result = (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
    else:
        result = tl.fma(a, b, c)
    return result


@triton.jit
def _rounded(acc, dtype: tl.constexpr):
    """``acc`` (float32) as ``dtype``, rounded to nearest even as a GPU's conversion and torch's
    are: Triton's interpreter truncates float32 to bfloat16, so there the rounding is done on the
    bits first."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = acc.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        acc = bits.to(tl.float32, bitcast=True)
    return acc.to(dtype)


@triton.jit
def announce_route_kernel(context, ids, positions, chunk_counts, routed, calls, call_out, headers, table, table_flags,
                          signature, T, E, K: tl.constexpr, K_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
                          BLOCK_T: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Step 1 (a program per chunk of ``BLOCK_T`` tokens): the chunk's pairs routed
    (:func:`iris_triton.operations.moe_routing.route_chunk`: ``positions`` within the chunk, the
    chunk's row of ``chunk_counts``); then the last program to finish (``routed``: the programs
    finished, counted on the device and set back to 0 by the last) scans the chunks' counts into
    their offsets, stores this rank's row into every rank's ``table[RANK]`` (``table``: int32
    ``[WORLD, E + 1]`` of the call's slot), announces the call in ``headers`` (its parity's row)
    and sets ``table_flags[RANK]`` := call + 1 on every rank; ``call_out`` := the call's number. A
    failed context sends nothing."""
    dctx = DeviceContext.initialize(context, RANK, WORLD)
    route_chunk(ids, positions, chunk_counts, tl.program_id(0), T, E, K, K_BLOCK, E_BLOCK, BLOCK_T)
    tl.debug_barrier()  # the chunk's counts as every thread of the program stored them, then counted
    if tl.atomic_add(routed, 1, sem="acq_rel", scope="sys") == tl.num_programs(0) - 1:
        tl.store(routed, 0)
        call = tl.load(calls)
        tl.store(calls, call + 1)
        tl.store(call_out, call)  # the call's number, for its combine
        counts, outside = scan_chunks(chunk_counts, tl.num_programs(0), E, E_BLOCK)
        if not failed(dctx):
            lanes = tl.arange(0, E_BLOCK)
            mine = table + RANK * (E + 1)
            tl.store(mine + lanes, counts, mask=lanes < E)
            tl.store(mine + E, outside)
            announced = header_value(call, signature)
            announce(dctx, headers + (call & 1) * WORLD, announced, RANK, WORLD)
            for q in tl.static_range(WORLD):
                if q != RANK:
                    dctx.store(mine + lanes, counts, q, mask=lanes < E)
                    dctx.store(mine + E, outside, q)
                    dctx.signal(table_flags + RANK, call + 1, q)


@triton.jit
def _table_verdict(dctx, table, capacity, E, L, E_BLOCK: tl.constexpr, WORLD: tl.constexpr, RECORD: tl.constexpr):
    """Whether the routing table (``[WORLD, E + 1]``) makes a call that fits: no rank passed ids out
    of range, no expert receives more than ``capacity`` rows. With ``RECORD`` what does not fit is
    recorded (ids: the rank that passed them; capacity: the expert's rank)."""
    experts = tl.arange(0, E_BLOCK)
    per_expert = tl.zeros([E_BLOCK], dtype=tl.int32)
    ok = tl.program_id(0) >= 0
    for q in tl.static_range(WORLD):
        per_expert += tl.load(table + q * (E + 1) + experts, mask=experts < E, other=0)
        outside = tl.load(table + q * (E + 1) + E) != 0
        if outside & RECORD:
            record_failure(dctx, q, EXPERT_IDS * 256 + SITE)
        ok = ok & (not outside)
    over = (per_expert > capacity) & (experts < E)
    for q in tl.static_range(WORLD):
        mine = over & (experts // L == q)
        if (tl.sum(mine.to(tl.int32), axis=0) > 0) & RECORD:
            record_failure(dctx, q, EXPERT_CAPACITY * 256 + SITE)
    return ok & (tl.sum(over.to(tl.int32), axis=0) == 0)


@triton.jit
def _pair_slots(table, ids, positions, t, E, L, capacity, K: tl.constexpr, K_BLOCK: tl.constexpr,
                RANK: tl.constexpr, WORLD: tl.constexpr):
    """``(slots, owners)`` of this rank's pairs ``(t, 0..K-1)`` (``[K_BLOCK]``, :func:`_pick` takes
    pair ``j``'s): each row's index in its expert's rank's ``[L, capacity]`` slots (local expert
    ``l``, then the rows of that expert from lower ranks, then the pair's position) and that rank;
    slot -1 for a pair sent nowhere. The token's pairs are read at once, before any of its rows
    moves: a store between them would keep each read from starting before the last store."""
    pairs = tl.arange(0, K_BLOCK)
    live = pairs < K
    position = tl.load(positions + t * K + pairs, mask=live, other=-1)
    e = tl.maximum(tl.load(ids + t * K + pairs, mask=live, other=0).to(tl.int32), 0)
    offset = position
    for q in tl.static_range(WORLD):
        if q < RANK:
            offset += tl.load(table + q * (E + 1) + e, mask=live, other=0)
    return tl.where(position >= 0, (e % L) * capacity + offset, -1), e // L


@triton.jit
def _pick(values, j):
    """Element ``j`` of the vector ``values``."""
    return tl.sum(tl.where(tl.arange(0, values.shape[0]) == j, values, 0), axis=0)


@triton.jit
def push_kernel(context, tokens, token_scales, ids, positions, pair_slots, chunk_offsets, calls, headers, table,
                table_flags, done_flags, pushed, counts, data, scales, source_rank, source_index, source_slot,
                signature, T, H, E, L, capacity, K: tl.constexpr, K_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, PROGRAMS_BLOCK: tl.constexpr, FP8: tl.constexpr,
                QUANTIZED: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Step 2: the positions of the program's tokens made the rank's
    (:func:`iris_triton.operations.moe_routing.final_positions`, by step 1's ``chunk_offsets``);
    every pair's row of ``tokens`` (``[T, H]``) into slot ``[l, offset]`` of ``data`` (``[L,
    capacity, H]``) on its expert's rank (``pair_slots[t, j]`` := that slot, for combine: int32
    ``[T, K]``, -1 for a pair sent nowhere), its source into ``source_rank``, ``source_index``,
    ``source_slot`` there (``[L, capacity]`` int32), and the sources of this rank's slots past its
    experts' rows := -1 (their ``scales`` 0); then this program's done flag on every rank. The last
    program to finish (``pushed``, as step 1's ``routed``) waits for every rank's programs, then
    ``counts`` (int32 ``[L]``) := this rank's experts' rows; on any failure (a wait, or the table's
    verdict) every output := all-ones bits. With ``FP8`` the row moves as float8_e4m3fn over its
    scale (its largest magnitude / 448, into ``scales[l, offset]``; 1 for a row of zeros); with
    ``QUANTIZED`` too, ``tokens`` are already float8 over ``token_scales`` (``[T]``): Triton's
    interpreter converts float32 to float8 wrongly next to powers of two, so on CPU ranks torch
    quantizes first."""
    dctx = DeviceContext.initialize(context, RANK, WORLD)
    final_positions(ids, positions, chunk_offsets, T, E, K, K_BLOCK, BLOCK_T, FINAL_TOKENS)
    call = tl.load(calls) - 1
    announced = header_value(call, signature)
    row = headers + (call & 1) * WORLD
    ok = not failed(dctx)
    for q in tl.static_range(WORLD):
        if q != RANK:
            ok = ok & wait_for_peer_call(dctx, table_flags + q, call + 1, q, row, announced, SITE)
    if ok:
        ok = _table_verdict(dctx, table, capacity, E, L, E_BLOCK, WORLD, tl.program_id(0) == 0)
    if ok:
        columns = tl.arange(0, BLOCK_H)
        for t in range(tl.program_id(0), T, tl.num_programs(0)):
            token = tokens + tl.cast(t, tl.int64) * H
            scale = 1.0
            if QUANTIZED:
                scale = tl.load(token_scales + t)
            elif FP8:
                amax = tl.zeros([BLOCK_H], dtype=tl.float32)
                for h in range(0, H, BLOCK_H):
                    values = tl.load(token + h + columns, mask=h + columns < H, other=0.0)
                    amax = tl.maximum(amax, tl.abs(values.to(tl.float32)))
                largest = tl.max(amax, axis=0)
                scale = tl.where(largest > 0, largest / FP8_LARGEST, 1.0)
            # Each step of the row is read once and stored to every pair's slot: the loads of a
            # step are in flight together, the stores do not wait. The first step also stores
            # each pair's source (and scale).
            slots, owners = _pair_slots(table, ids, positions, t, E, L, capacity, K, K_BLOCK, RANK, WORLD)
            # The handle keeps each pair's slot: combine reads no routing table, which the peers'
            # next dispatch of this parity may rewrite while this rank's combine still runs.
            tl.store(pair_slots + t * K + tl.arange(0, K_BLOCK), slots, mask=tl.arange(0, K_BLOCK) < K)
            for h in range(0, H, BLOCK_H):
                mask = h + columns < H
                values = tl.load(token + h + columns, mask=mask)
                if FP8 and not QUANTIZED:
                    values = (values.to(tl.float32) / scale).to(data.dtype.element_ty)
                for j in tl.static_range(K):
                    slot, owner = _pick(slots, j), _pick(owners, j)
                    if slot >= 0:  # its row, at slot * H: past 2**31 in large buffers
                        dctx.store(data + tl.cast(slot, tl.int64) * H + h + columns, values, owner, mask=mask)
                        if h == 0:
                            if FP8:
                                dctx.store(scales + slot, scale, owner)
                            source = tl.full((), RANK, tl.int32)
                            dctx.store(source_rank + slot, source, owner)
                            dctx.store(source_index + slot, source * 0 + t, owner)
                            dctx.store(source_slot + slot, source * 0 + j, owner)
    _clear_slots(table, scales, source_rank, source_index, source_slot, E, L, capacity, ok, tl.program_id(0),
                 tl.num_programs(0), CLEARED_SLOTS, RANK, WORLD)
    programs = tl.num_programs(0)
    if not failed(dctx):  # a failed context signals nothing: its peers give up rather than take its rows
        for q in tl.static_range(WORLD):
            dctx.signal(done_flags + RANK * programs + tl.program_id(0), call + 1, q)
    tl.debug_barrier()  # every thread's writes, before the program counts as finished
    if tl.atomic_add(pushed, 1, sem="acq_rel", scope="sys") == programs - 1:
        tl.store(pushed, 0)
        done = not failed(dctx)
        for peer in range(WORLD):
            if done:
                done = wait_all_or_record(dctx, done_flags + peer * programs, programs, call + 1, peer, SITE,
                                          PROGRAMS_BLOCK)
        done = done & ok
        local = tl.arange(0, E_BLOCK)
        total = tl.zeros([E_BLOCK], dtype=tl.int32)
        for source in tl.static_range(WORLD):
            total += tl.load(table + source * (E + 1) + RANK * L + local, mask=local < L, other=0)
        tl.store(counts + local, tl.where(done, total, -1), mask=local < L)
        if not done:
            _clear_slots(table, scales, source_rank, source_index, source_slot, E, L, capacity, False, 0, 1,
                         CLEARED_SLOTS, RANK, WORLD)
            poison_blocks(dctx, data, L * capacity * H, L * capacity * H, 0, 1, BLOCK_H)


@triton.jit
def _clear_slots(table, scales, source_rank, source_index, source_slot, E, L, capacity, ok, first, step,
                 BLOCK: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr):
    """The sources of this rank's slots past its experts' rows (by ``table``; every slot unless
    ``ok``) := -1, their ``scales`` 0: blocks ``first, first + step, ...`` of ``BLOCK`` slots of
    the ``[L, capacity]`` buffers, each slot's expert's rows gathered from the table."""
    slots = tl.arange(0, BLOCK)
    received = table + RANK * L  # [source, E + 1] rows: this rank's experts' columns
    for start in range(first * BLOCK, L * capacity, step * BLOCK):
        i = start + slots
        inside = i < L * capacity
        expert = i // capacity
        rows = tl.zeros([BLOCK], dtype=tl.int32)
        for source in tl.static_range(WORLD):
            rows += tl.load(received + source * (E + 1) + expert, mask=inside, other=0)
        empty = inside & ((i - expert * capacity >= rows) | (not ok))
        tl.store(source_rank + i, -1, mask=empty)
        tl.store(source_index + i, -1, mask=empty)
        tl.store(source_slot + i, -1, mask=empty)
        tl.store(scales + i, 0.0, mask=empty)


#: Byte alignment of each buffer of a slot.
_ALIGNMENT = 256


def _aligned(size: int) -> int:
    """``size`` bytes rounded up to the alignment of a slot's buffers."""
    return -(-size // _ALIGNMENT) * _ALIGNMENT


def _launch(ctx, hidden: int) -> tuple[int, int, dict]:
    """``(programs, BLOCK_H, warps)`` of the kernels that move rows (:data:`iris_triton.tuning.MOE_SHAPES`):
    their programs, the elements of a row one step moves, and their launch option ``num_warps`` on
    GPUs (none on CPU ranks)."""
    shape = MOE_SHAPES[ctx.kernel_device_type]
    warps = {"num_warps": shape["num_warps"]} if "num_warps" in shape else {}
    return _programs(ctx), min(bucket(hidden), shape["MAX_BLOCK"]), warps


def _programs(ctx) -> int:
    """Programs of the kernels that move rows: :data:`iris_triton.tuning.MOE_SHAPES`' per
    multiprocessor (per CPU rank's program)."""
    return ctx.programs * MOE_SHAPES[ctx.kernel_device_type]["PER_UNIT"]


def slot_sizes(world: int, experts: int, capacity: int, hidden: int, element: int) -> dict:
    """Bytes of each buffer of one dispatch's slot (``element``: bytes per moved element)."""
    local = experts // world
    return {"table": 4 * world * (experts + 1), "source_rank": 4 * local * capacity,
            "source_index": 4 * local * capacity, "source_slot": 4 * local * capacity,
            "scales": 4 * local * capacity, "data": element * local * capacity * hidden}


def slot_bytes(world: int, experts: int, capacity: int, hidden: int, element: int) -> int:
    """Bytes of one dispatch's slot (its buffers, each aligned)."""
    return sum(map(_aligned, slot_sizes(world, experts, capacity, hidden, element).values()))


def carve_slot(slot, world: int, experts: int, capacity: int, hidden: int, dtype) -> dict:
    """A dispatch's slot (uint8) as its buffers: ``table`` (int32), ``source_rank``,
    ``source_index``, ``source_slot`` (int32 ``[L, capacity]``), ``scales`` (float32 ``[L,
    capacity]``) and ``data`` (``dtype`` ``[L, capacity, hidden]``). Plain slicing and views, so
    that compiled code (torch.compile) carves the result of the dispatch operator as eager code
    does."""
    import torch

    local = experts // world
    sizes = slot_sizes(world, experts, capacity, hidden, dtype.itemsize)
    out, start = {}, 0
    for name, size in sizes.items():
        out[name] = slot[start:start + size]
        start += _aligned(size)
    for name in ("source_rank", "source_index", "source_slot"):
        out[name] = out[name].view(torch.int32).view(local, capacity)
    out["table"] = out["table"].view(torch.int32)
    out["scales"] = out["scales"].view(torch.float32).view(local, capacity)
    out["data"] = out["data"].view(dtype).view(local, capacity, hidden)
    return out


#: Views an ``ops`` object keeps (:func:`memo`) before it drops them all: a few shapes' worth.
_MAX_VIEWS = 64


def memo(ops, key: tuple, make):
    """``make()``, kept in ``ops._moe_views`` under ``key`` (which names every tensor it views by
    its address): the views of the workspaces an eager call takes, cut once."""
    views = ops._moe_views.get(key)
    if views is None:
        if len(ops._moe_views) >= _MAX_VIEWS:
            ops._moe_views.clear()
        views = ops._moe_views[key] = make()
    return views


def carved(ops, slot, world: int, experts: int, capacity: int, hidden: int, dtype) -> dict:
    """:func:`carve_slot`, kept (:func:`memo`)."""
    return memo(ops, ("slot", slot.data_ptr(), slot.numel(), world, experts, capacity, hidden, dtype),
                lambda: carve_slot(slot, world, experts, capacity, hidden, dtype))


def dispatch(ops, tokens, topk_ids, topk_weights, num_experts: int, capacity: int, fp8: bool):
    """``ctx.ops.moe_dispatch`` by the two kernels above (arguments checked:
    :func:`iris_triton.operations.moe.dispatch`), ``capacity`` rows per expert: ``(slot, counts,
    pair_slots, call, sequence, plan)``: this call's slot of the receive buffers (uint8, valid until
    the dispatch after next; :func:`carve_slot` cuts it into the result's tensors), the rows each
    local expert received (int32 ``[L]``), each pair's slot among its expert's rank's rows (int32
    ``[T, k]``, -1: sent nowhere), the call's number on the device (int32 ``[1]``) and on the
    host, and the call's plan (:mod:`iris_triton.operations.moe_plans`; None where it has none)."""
    import torch

    from iris_triton.operations.fused_ops import _announced_call
    from iris_triton.operations.moe_plans import DispatchPlan

    ctx = ops._context
    (T, H), k = tokens.shape, topk_ids.shape[1]
    dtype = torch.float8_e4m3fn if fp8 else tokens.dtype
    sequence = ops._moe_calls
    ops._moe_calls = sequence + 1
    parity = sequence & 1
    counts = torch.empty(num_experts // ctx.world_size, dtype=torch.int32, device=ctx.device)
    call = torch.empty(1, dtype=torch.int32, device=ctx.device)
    pair_slots = torch.empty(T, k, dtype=torch.int32, device=ctx.device)
    x, token_scales, ids = tokens.contiguous(), None, topk_ids.contiguous()
    quantized = fp8 and ctx.kernel_device_type == "cpu"  # the interpreter's float8 conversion is wrong
    if quantized:
        amax = x.float().abs().amax(dim=1)
        token_scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        x = (x.float() / token_scales[:, None]).to(torch.float8_e4m3fn)
    with _announced_call(ctx, "moe_dispatch", (tokens, topk_ids, topk_weights), "direct") as signature:
        launches = DispatchLaunches.of(ops, T, H, k, num_experts, capacity, dtype, signature, quantized)
        with ctx._call("ops.moe_dispatch", launches.outputs(parity, counts)):
            launches.launch(parity, x, token_scales, ids, pair_slots, counts, call)
    # Debug mode checks every call's ids on the host: no plan skips that.
    plannable = not (quantized or ctx.config.debug) and x is tokens and ids is topk_ids and \
        topk_weights.is_contiguous()
    plan = DispatchPlan.of(ops, launches, parity, x, ids, num_experts, capacity, fp8) if plannable else None
    return launches.slots[parity], counts, pair_slots, call, sequence, plan


@attrs.define(eq=False)
class DispatchLaunches:
    """The two launches of a dispatch of one shape on one ``ctx.ops``, prepared for both parities
    of the receive buffers: what :func:`dispatch` launches, and its plans
    (:mod:`iris_triton.operations.moe_plans`) again."""

    slots: tuple
    """The receive buffers' two slots (uint8 views of the workspace)."""
    buffers: tuple
    """Each slot carved (:func:`carve_slot`)."""
    context: Any
    control: dict
    routing: tuple
    """``(positions, chunk_counts)``: each pair's position (int32 ``[T, k]``) and each chunk's
    counts (int32 ``[chunks, E + 1]``), the routing's scratch between the two launches of a call,
    on the heap (:func:`_scratch`)."""
    signature: int
    shape: tuple
    """``(T, H, E, L, capacity)``."""
    route_grid: tuple
    route_constexprs: dict
    push_grid: tuple
    push_constexprs: dict
    quantized: bool
    scratch: tuple
    """Per parity, ``(pair_slots, call, counts)``: each pair's slot (int32 ``[T, k]``), the call's
    number (int32 ``[1]``) and the rows each local expert received (int32 ``[L]``) on the heap,
    what a planned call (:mod:`iris_triton.operations.moe_plans`) uses for its handle's state and
    its result's counts instead of allocating them: a handle is refused on the host once the
    dispatch after next reused its parity (:func:`iris_triton.operations.moe.combine`)."""

    @classmethod
    def of(cls, ops, T: int, H: int, k: int, E: int, capacity: int, dtype, signature: int,
           quantized: bool) -> "DispatchLaunches":
        import torch

        from iris_triton.operations.moe_routing import ROUTE_BLOCK

        ctx = ops._context
        world, rank = ctx.world_size, ctx.rank
        size = slot_bytes(world, E, capacity, H, dtype.itemsize)
        # Parity p in region p, laid out by the workspace's size: calls of every shape (a capacity
        # follows the tokens by default) put a parity in the same place, never in the other's.
        space, half = ctx.workspaces.regions("moe_slots", 2, size, fill=0)
        slots = tuple(memo(ops, ("space", space.data_ptr(), p * half, size),
                           lambda p=p: space[p * half:p * half + size]) for p in (0, 1))
        chunks = max(1, -(-T // ROUTE_BLOCK))
        e_block, k_block = bucket(E), bucket(k)
        programs, block_h, warps = _launch(ctx, H)
        common = dict(K=k, K_BLOCK=k_block, E_BLOCK=e_block, BLOCK_T=ROUTE_BLOCK, RANK=rank, WORLD=world)
        scratch, routing = _scratch(ops, T, k, chunks, E, E // world)
        return cls(slots=slots, buffers=tuple(carved(ops, slot, world, E, capacity, H, dtype) for slot in slots),
                   scratch=scratch, routing=routing, context=ctx.get_device_context(), control=_control(ops),
                   signature=signature, shape=(T, H, E, E // world, capacity), route_grid=(chunks,),
                   route_constexprs=common, push_grid=(programs,),
                   push_constexprs=dict(common, BLOCK_H=block_h, PROGRAMS_BLOCK=bucket(programs),
                                        FP8=dtype == torch.float8_e4m3fn, QUANTIZED=quantized, **warps),
                   quantized=quantized)

    def outputs(self, parity: int, counts) -> tuple:
        """What a call of ``parity`` writes, which a failure poisons: its slot's buffers and ``counts``."""
        b = self.buffers[parity]
        return b["data"], b["scales"], counts, b["source_rank"], b["source_index"], b["source_slot"]

    def route_arguments(self, parity: int, ids, call) -> tuple:
        """:func:`announce_route_kernel`'s runtime arguments for a call."""
        control, T, E = self.control, self.shape[0], self.shape[2]
        return (self.context, ids, *self.routing, control["routed"], control["calls"], call, control["headers"],
                self.buffers[parity]["table"], control["table"], self.signature, T, E)

    def push_arguments(self, parity: int, x, token_scales, ids, pair_slots, counts) -> tuple:
        """:func:`push_kernel`'s runtime arguments for a call (``token_scales``: the quantized
        tokens' scales, or None)."""
        control, b = self.control, self.buffers[parity]
        scales = b["scales"] if token_scales is None else token_scales
        return (self.context, x, scales, ids, self.routing[0], pair_slots, self.routing[1], control["calls"],
                control["headers"], b["table"], control["table"], control["done"], control["pushed"], counts,
                b["data"], b["scales"], b["source_rank"], b["source_index"], b["source_slot"], self.signature,
                *self.shape)

    def launch(self, parity: int, x, token_scales, ids, pair_slots, counts, call) -> None:
        """Launch both kernels for a call (through the JIT's cache: :class:`LaunchCache`)."""
        _ROUTE.launch(self.route_grid, *self.route_arguments(parity, ids, call), **self.route_constexprs)
        _PUSH.launch(self.push_grid, *self.push_arguments(parity, x, token_scales, ids, pair_slots, counts),
                     **self.push_constexprs)


#: Where a parity's pair slots start in its region of the state workspace (int32 words, after the
#: call's number; 16-byte aligned as the kernels are compiled for).
_SLOTS_AT = 4


def _scratch(ops, T: int, k: int, chunks: int, E: int, L: int) -> tuple:
    """``(scratch, routing)``: :attr:`DispatchLaunches.scratch` and :attr:`DispatchLaunches.routing`
    for ``T`` tokens of ``k`` pairs in ``chunks`` chunks, ``E`` experts, ``L`` of them local (views
    cut once: :func:`memo`). Parity ``p``'s state lies in region ``p`` of the workspace, the
    routing's scratch in region 2 (:meth:`iris.collectives.workspaces.Workspaces.regions`: laid out
    by the workspace's size, so calls of every shape put each in the same place). On the heap
    rather than allocated apart: a workspace outlives the CUDA graphs that captured it."""
    import torch

    pairs = T * k
    counts_at = _SLOTS_AT + -(-pairs // _SLOTS_AT) * _SLOTS_AT  # after the pair slots, 16-byte aligned
    needed = max(counts_at + L, pairs + chunks * (E + 1))  # int32 words of each region
    space, region = ops._context.workspaces.regions("moe_state", 3, 4 * needed)

    def cut() -> tuple:
        words = space.view(torch.int32)
        first = [p * region // 4 for p in (0, 1, 2)]
        # The call's number first, where a later call of another shape puts its own, never a slot.
        state = tuple((words[f + _SLOTS_AT:f + _SLOTS_AT + pairs].view(T, k), words[f:f + 1],
                       words[f + counts_at:f + counts_at + L]) for f in first[:2])
        routing = words[first[2]:first[2] + pairs].view(T, k), \
            words[first[2] + pairs:first[2] + pairs + chunks * (E + 1)].view(chunks, E + 1)
        return state, routing

    return memo(ops, ("state", space.data_ptr(), region, T, k, chunks, E, L), cut)


def _control(ops) -> dict:
    """The MoE protocol's int32 words on the heap (views cut once per ``ops``: :func:`memo`): the
    dispatch count, the routing programs finished (:func:`announce_route_kernel`) and the pushing
    programs finished (:func:`push_kernel`), the headers (two rows by call parity, then the
    announcements), the routing tables' flags, the pushing programs' flags, the returning
    programs' flags by the dispatch's parity, and combine's headers (two rows by the dispatch's
    parity)."""
    import torch

    ctx = ops._context
    world, programs = ctx.world_size, _programs(ctx)
    sizes = {"calls": 1, "routed": 1, "pushed": 1, "headers": 3 * world, "table": world, "done": world * programs,
             "back": 2 * world * programs, "combine_headers": 2 * world}
    space = ctx.workspaces.get("moe_control", 4 * sum(sizes.values()), fill=0)

    def cut() -> dict:
        words = space.view(torch.int32)
        out, start = {}, 0
        for name, size in sizes.items():
            out[name] = words[start:start + size]
            start += size
        return out

    return memo(ops, ("control", space.data_ptr()), cut)


def combine(ops, expert_out, topk_ids, topk_weights, pair_slots, call, counts, slot, num_experts: int,
            capacity: int):
    """``ctx.ops.moe_combine`` by :func:`return_kernel` and :func:`reduce_kernel` (arguments
    checked: :func:`iris_triton.operations.moe.combine`; the rest is the dispatch's, as
    :func:`dispatch` returned it): ``([T, hidden]`` in ``expert_out``'s dtype``, launches)``, the
    launches (:class:`CombineLaunches`) for the call's plan. The dispatch's parity (which half of
    the return buffers) is read on the device from its number."""
    import torch

    from iris_triton.operations.fused_ops import _announced_call

    ctx = ops._context
    T, H = topk_ids.shape[0], expert_out.shape[2]
    out = torch.empty(T, H, dtype=expert_out.dtype, device=ctx.device)
    x, ids, weights = expert_out.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
    with ctx._call("ops.moe_combine", (out,)), _announced_call(ctx, "moe_combine", (expert_out, topk_ids,
                                                                                   topk_weights), "direct") as sig:
        launches = CombineLaunches.of(ops, expert_out, T, topk_ids.shape[1], num_experts, capacity, sig)
        launches.launch(slot, out, x, ids, pair_slots, weights, counts, call)
    return out, launches


@attrs.define(eq=False)
class CombineLaunches:
    """The two launches of a combine of one shape on one ``ctx.ops``: what :func:`combine`
    launches, and its plans (:mod:`iris_triton.operations.moe_plans`) again."""

    ops: Any
    context: Any
    control: dict
    back: Any
    back_stride: int
    signature: int
    shape: tuple
    """``(T, H, E, L, capacity)``."""
    grid: tuple
    return_constexprs: dict
    reduce_constexprs: dict

    @classmethod
    def of(cls, ops, expert_out, T: int, k: int, E: int, capacity: int, signature: int) -> "CombineLaunches":
        ctx = ops._context
        (L, _, H), element = expert_out.shape, expert_out.element_size()
        back_stride = _aligned(T * k * H * element) // element
        programs, block_h, warps = _launch(ctx, H)
        common = dict(K=k, BLOCK_H=block_h, RANK=ctx.rank, WORLD=ctx.world_size, **warps)
        return cls(ops=ops, context=ctx.get_device_context(), control=_control(ops),
                   back=ctx.workspaces.get("moe_back", 2 * back_stride * element).view(expert_out.dtype),
                   back_stride=back_stride, signature=signature, shape=(T, H, E, L, capacity), grid=(programs,),
                   return_constexprs=common,
                   reduce_constexprs=dict(common, K_BLOCK=bucket(k), PROGRAMS_BLOCK=bucket(programs)))

    def sources(self, slot) -> dict:
        """The dispatch's ``slot`` carved: its sources and its routing table."""
        import torch

        ctx = self.ops._context
        T, H, E, L, capacity = self.shape
        return carved(self.ops, slot, ctx.world_size, E, capacity, 0, torch.uint8)  # the sources lie before the data

    def return_arguments(self, buffers: dict, x, counts, call) -> tuple:
        """:func:`return_kernel`'s runtime arguments for a call (``buffers``: :meth:`sources`)."""
        T, H, E, L, capacity = self.shape
        return (self.context, x, counts, buffers["source_rank"], buffers["source_index"], buffers["source_slot"],
                call, self.control["calls"], self.back, self.control["back"], self.back_stride,
                self.control["combine_headers"], self.signature, H, L, capacity)

    def reduce_arguments(self, out, x, ids, pair_slots, weights, call) -> tuple:
        """:func:`reduce_kernel`'s runtime arguments for a call."""
        T, H, E, L, capacity = self.shape
        return (self.context, out, x, self.back, self.control["back"], self.back_stride, self.grid[0], ids,
                pair_slots, weights, call, self.control["calls"], T, H, L)

    def launch(self, slot, out, x, ids, pair_slots, weights, counts, call) -> None:
        """Launch both kernels for a call (through the JIT's cache: :class:`LaunchCache`)."""
        buffers = self.sources(slot)
        _RETURN.launch(self.grid, *self.return_arguments(buffers, x, counts, call), **self.return_constexprs)
        _REDUCE.launch(self.grid, *self.reduce_arguments(out, x, ids, pair_slots, weights, call),
                       **self.reduce_constexprs)


# -- combine -----------------------------------------------------------------------------------------


@triton.jit
def _combined_dispatch(dctx, call_in, calls, back, back_flags, back_stride, FLAGS: tl.constexpr):
    """``(call, back, back_flags, ok)`` of a combine: its dispatch's number, that dispatch's parity's
    half of the return buffers (``back_stride`` elements apart) and of their flags (``FLAGS``
    apart), and whether the dispatch's receive buffers still hold its rows (no dispatch reused
    them since: at most one more dispatch made; else the failure is recorded)."""
    call = tl.load(call_in)
    parity = call & 1
    ok = tl.load(calls) - call <= 2
    if not ok:
        record_failure(dctx, dctx.rank, STALE_DISPATCH * 256 + COMBINE_SITE)
    return call, back + parity * back_stride, back_flags + parity * FLAGS, ok


@triton.jit
def return_kernel(context, expert_out, counts, source_rank, source_index, source_slot, call_in, calls, back,
                  back_flags, back_stride, headers, signature, H, L, capacity, K: tl.constexpr, BLOCK_H: tl.constexpr,
                  RANK: tl.constexpr, WORLD: tl.constexpr):
    """Combine's first step: the call announced in every peer's combine header (program 0; its
    dispatch's parity's row of ``headers``), and once every peer announced the same call (bounded
    waits; another call is recorded as a mismatch: a peer's rows of another size or type would land
    outside the rows this rank's buffers hold), every row received from a peer sends its expert
    output (``expert_out[l, i]``, ``i < counts[l]``) into row ``[t, j]`` of ``back`` (``[T, K, H]``,
    the dispatch's parity) on its source rank (``source_*[l, i]``: rank, token ``t``, slot ``j``);
    rows from this rank stay where they are (:func:`reduce_kernel` reads them there). Then this
    program's flag ``back_flags[RANK, p]`` := the dispatch's number + 1 on every rank. A stale
    dispatch (:func:`_combined_dispatch`) sends nothing."""
    dctx = DeviceContext.initialize(context, RANK, WORLD)
    call, back, back_flags, fresh = _combined_dispatch(dctx, call_in, calls, back, back_flags, back_stride,
                                                       WORLD * tl.num_programs(0))
    announced = header_value(call, signature)
    row = headers + (call & 1) * WORLD
    if fresh & (tl.program_id(0) == 0) & (not failed(dctx)):
        announce(dctx, row, announced, RANK, WORLD)
    columns = tl.arange(0, BLOCK_H)
    if fresh & peers_announced(dctx, row, announced, RANK, WORLD, COMBINE_SITE, True):
        for expert in range(0, L):
            for i in range(tl.program_id(0), tl.load(counts + expert), tl.num_programs(0)):
                slot = expert * capacity + i
                source = tl.load(source_rank + slot)
                # Never a write to (or a base of) a rank that is none; this rank's rows stay.
                if (source >= 0) & (source < WORLD) & (source != RANK):
                    # 64-bit row offsets: a buffer of [L, capacity, H] or [T, K, H] can pass 2**31 elements.
                    target = back + (tl.load(source_index + slot) * K + tl.load(source_slot + slot)).to(tl.int64) * H
                    returned = expert_out + tl.cast(slot, tl.int64) * H
                    for h in range(0, H, BLOCK_H):
                        mask = h + columns < H
                        dctx.store(target + h + columns, tl.load(returned + h + columns, mask=mask), source, mask=mask)
        for q in tl.static_range(WORLD):
            dctx.signal(back_flags + RANK * tl.num_programs(0) + tl.program_id(0), call + 1, q)


@triton.jit
def _pair_weight(ids, weights, pair_slots, t, j, K: tl.constexpr):
    """The weight of pair ``(t, j)`` in token ``t``'s sum: its router weight plus those of the later
    pairs naming the same expert (a repeat was sent once, at the first); 0 for a pair sent nowhere."""
    e = tl.load(ids + t * K + j)
    weight = tl.load(weights + t * K + j)
    for later in tl.static_range(j + 1, K):
        weight += tl.where(tl.load(ids + t * K + later) == e, tl.load(weights + t * K + later), 0.0)
    return tl.where(tl.load(pair_slots + t * K + j) >= 0, weight, 0.0)


@triton.jit
def reduce_kernel(context, out, expert_out, back, back_flags, back_stride, programs, ids, pair_slots, weights,
                  call_in, calls, T, H, L, K: tl.constexpr, K_BLOCK: tl.constexpr,
                  BLOCK_H: tl.constexpr, PROGRAMS_BLOCK: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Combine's second step: once every rank's ``programs`` returning programs are done, ``out[t]``
    := ``sum_j w[t, j] * row(t, j)`` in float32 (:func:`_pair_weight`), ``row(t, j)`` the
    returned ``back[t, j]``, or for a pair whose expert is this rank's, its expert output where
    dispatch put it (``expert_out[slot]``, the pair's slot in ``pair_slots`` as :func:`push_kernel`
    left it). On a failure (a stale dispatch too, or one that failed, whose slots are not all
    written) nothing is read and ``out`` := all-ones bits."""
    dctx = DeviceContext.initialize(context, RANK, WORLD)
    call, back, back_flags, ok = _combined_dispatch(dctx, call_in, calls, back, back_flags, back_stride,
                                                    WORLD * programs)
    ok = ok & (not failed(dctx))
    for q in range(WORLD):
        if ok:
            ok = wait_all_or_record(dctx, back_flags + q * programs, programs, call + 1, q, COMBINE_SITE,
                                    PROGRAMS_BLOCK)
    columns = tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, K_BLOCK)
    for t in range(tl.program_id(0), T, tl.num_programs(0)):
        slots = tl.load(pair_slots + t * K + pairs, mask=pairs < K, other=-1)
        owners = tl.maximum(tl.load(ids + t * K + pairs, mask=pairs < K, other=0).to(tl.int32), 0) // L
        for h in range(0, H, BLOCK_H):
            mask = h + columns < H
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            # Masked loads rather than branches: every pair's row of the step is in flight at once.
            for j in tl.static_range(K):
                slot, owner = _pick(slots, j), _pick(owners, j)
                returned = back + tl.cast(t * K + j, tl.int64) * H
                if owner == RANK:
                    returned = expert_out + tl.cast(slot, tl.int64) * H
                # Nothing past a row's end, none of a pair sent nowhere (a bound rather than an and
                # with a scalar: the newest Triton's interpreter refuses a mask broadcast from one).
                row = tl.load(returned + h + columns, mask=h + columns < tl.where((slot >= 0) & ok, H, 0), other=0.0)
                acc = _fma(row.to(tl.float32), _pair_weight(ids, weights, pair_slots, t, j, K), acc)
            tl.store(out + tl.cast(t, tl.int64) * H + h + columns, _rounded(acc, out.dtype.element_ty), mask=mask)
    if not ok:
        poison_blocks(dctx, out, T * H, T * H, tl.program_id(0), tl.num_programs(0), BLOCK_H)


# The kernels' launches: an eager call pays the compiled kernel's launch, not the JIT's.
_ROUTE = LaunchCache(announce_route_kernel)
_PUSH = LaunchCache(push_kernel)
_RETURN = LaunchCache(return_kernel)
_REDUCE = LaunchCache(reduce_kernel)
