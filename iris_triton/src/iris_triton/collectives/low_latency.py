"""Low-latency all_reduce: every word carries its own flag (entry point ``iris.ccl.all_reduce``
``low_latency``).

The exchange of :mod:`iris_triton.collectives.kernels` orders data and signal with a release (a system-scope
fence that waits until the pushed data reached the peer) and an acquire on the peer: two
link round trips per call, which dominate small calls. Here the data signals itself instead:

- The input is sent as 32-bit *payload* words (four 8-bit elements, two 16-bit ones, one 32-bit
  element, or half of a 64-bit one), each pushed into the peer's workspace as one 64-bit word whose high
  half is the call's flag: its number plus one and its signature (16 bits each:
  :func:`iris_triton.protocol.calls.header_value`). A 64-bit aligned store reaches the peer whole, so a
  word that holds this call's flag holds this call's payload. No fence, no separate flag; a peer
  that made a different call (another size, dtype or op) never sends this flag. Program 0 also
  writes the flag into every peer's call header, where every algorithm announces its calls
  (:mod:`iris_triton.protocol.calls`), and the waits read the headers: a peer that made a different call,
  whatever algorithm it runs, fails the call as soon as its header lands, instead of taking its
  data or being waited for.
- The receiver reads its local workspace (volatile loads) until every word it needs carries the
  call's flag (waiting on one word's flag meanwhile, as iris's bounded waits do), then reduces in
  rank order (every rank gets the same bits).
- The workspace has two slots, used by alternate calls. A rank's call ``k + 2`` writes into the
  slot of call ``k``; it starts only after its call ``k + 1`` read every peer's call ``k + 1``
  words, which each peer pushed after finishing its call ``k``: nothing is overwritten before it
  was read. Flags carry call numbers, which differ between the calls that share a slot, and the
  workspace is zeroed when allocated (no flag is 0), so no word left from an earlier call carries
  a later call's flag.
- Call numbers are the per-program call counts of the collectives (:mod:`iris_triton.protocol.calls`),
  so these calls interleave with the other collectives'.

Every word costs twice its payload on the link, so this wins only where latency dominates;
the automatic choice (:func:`iris.collectives.choose`) takes it for small calls
(:data:`iris_triton.tuning.ALL_REDUCE_CHOSEN_UP_TO`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iris.collectives import Algorithm, CollectiveCall
from iris_triton.protocol.calls import LANES, announce, call_number, count_call, header_value, headers_of
from iris_triton.device.frontend import SHARED_SOURCE_LANGUAGES
from iris_triton.protocol.reductions import reduce_in_rank_order
from iris_triton.device.tracing import OPERATION_EVENT
from iris_triton.tuning import ALL_REDUCE_CHOSEN_UP_TO, LOW_LATENCY_SHAPES
from iris_triton.protocol.waits import failed, poison_blocks, publish, read_when_arrived, site_code

__all__ = ["ALL_REDUCE_LOW_LATENCY", "MAX_BYTES", "low_latency_kernel"]

_PAYLOAD_MASK: tl.constexpr = tl.constexpr(0xFFFFFFFF)
#: What a wait of this kernel that gives up records (:mod:`iris_triton.protocol.waits`).
_SITE: tl.constexpr = tl.constexpr(site_code("all_reduce"))


@triton.jit
def _payload(inp, w, n, SIZE: tl.constexpr):
    """Payload words ``w`` (int64, low 32 bits) of ``n`` elements of ``SIZE`` bytes at ``inp``."""
    if SIZE == 1:
        words = tl.load(inp + 4 * w, mask=4 * w < n, other=0).to(tl.int8, bitcast=True).to(tl.int64) & 0xFF
        for k in tl.static_range(1, 4):
            byte = tl.load(inp + 4 * w + k, mask=4 * w + k < n, other=0).to(tl.int8, bitcast=True).to(tl.int64)
            words = words | ((byte & 0xFF) << (8 * k))
    elif SIZE == 2:
        low = tl.load(inp + 2 * w, mask=2 * w < n, other=0).to(tl.int16, bitcast=True).to(tl.int64)
        high = tl.load(inp + 2 * w + 1, mask=2 * w + 1 < n, other=0).to(tl.int16, bitcast=True).to(tl.int64)
        words = (low & 0xFFFF) | ((high & 0xFFFF) << 16)
    elif SIZE == 4:
        words = tl.load(inp + w, mask=w < n).to(tl.int32, bitcast=True).to(tl.int64)
    else:
        tl.static_assert(SIZE == 8, "element size must be 1, 2, 4 or 8 bytes")
        element = tl.load(inp + w // 2, mask=w // 2 < n).to(tl.int64, bitcast=True)
        words = element >> (32 * (w % 2))
    return words & _PAYLOAD_MASK


@triton.jit
def _flag_differs(words, flag):
    """Lanes whose word does not carry ``flag`` in its high half (not yet this call's)."""
    return (words >> 32) != flag


@triton.jit
def _first_flag(buffer, w):
    """The high half (the flag) of the block's first word."""
    return (buffer + tl.min(w, axis=0)).to(tl.pointer_type(tl.int32)) + 1


@triton.jit
def _arrived(dctx, buffer, w, mask, flag, where, SITE: tl.constexpr):
    """``(payload, arrived)`` of words ``w`` of ``buffer`` once all of them carry ``flag`` in
    their high half (:func:`iris_triton.protocol.waits.read_when_arrived`, waiting meanwhile on the first
    word's, and on the peers' headers); ``where`` is ``(peer, headers)``."""
    peer, headers = where
    words, arrived = read_when_arrived(dctx, buffer, w, mask, flag, peer, headers, flag, _flag_differs, _first_flag,
                                       "eq", SITE)
    return words & _PAYLOAD_MASK, arrived


@triton.jit
def _received(dctx, buffer, e, mask, flag, peer, headers, SIZE: tl.constexpr, DTYPE: tl.constexpr,
              SITE: tl.constexpr):
    """``(elements, arrived)``: elements ``e`` (of ``DTYPE``, ``SIZE`` bytes) that ``peer``
    pushed into ``buffer``."""
    where = (peer, headers)
    if SIZE == 1:
        words, arrived = _arrived(dctx, buffer, e // 4, mask, flag, where, SITE)
        bits = ((words >> (8 * (e % 4))) & 0xFF).to(tl.int8)
    elif SIZE == 2:
        words, arrived = _arrived(dctx, buffer, e // 2, mask, flag, where, SITE)
        bits = ((words >> (16 * (e % 2))) & 0xFFFF).to(tl.int16)
    elif SIZE == 4:
        words, arrived = _arrived(dctx, buffer, e, mask, flag, where, SITE)
        bits = words.to(tl.int32)
    else:
        low, low_arrived = _arrived(dctx, buffer, 2 * e, mask, flag, where, SITE)
        high, arrived = _arrived(dctx, buffer, 2 * e + 1, mask, flag, where, SITE)
        bits = low | (high << 32)
        arrived = arrived & low_arrived
    return bits.to(DTYPE, bitcast=True), arrived


@triton.jit
def _own_elements(args):
    dctx, inp, slot, capacity, e, mask, flag, headers = args
    return tl.load(inp + e, mask=mask)


@triton.jit
def _peer_elements(q, args):
    dctx, inp, slot, capacity, e, mask, flag, headers = args
    SIZE: tl.constexpr = inp.dtype.element_ty.primitive_bitwidth // 8
    return _received(dctx, slot + q * capacity, e, mask, flag, q, headers, SIZE, inp.dtype.element_ty, _SITE)


def low_latency_kernel(context, inp, out, ws, sync, programs, n, words, capacity, signature, CTX: tl.constexpr,
                       TRACING: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, OP: tl.constexpr,
                       SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """All-reduce ``n`` elements of ``SIZE`` bytes from ``inp`` into ``out`` (may be ``inp``):
    push this rank's ``words`` payload words, flagged, into every peer's slot region ``RANK``
    (regions of ``capacity`` words in ``ws``, int64), then reduce what every peer pushed here.
    Program ``p`` pushes word blocks ``p, p + P, ...`` of ``BLOCK`` words and then reduces the
    elements of those same blocks, so an in-place call reads no element after it was written. A
    wait that gives up fills ``out`` with NaN (integers: -1; :mod:`iris_triton.protocol.waits`)."""
    dctx = CTX.initialize(context, RANK, WORLD, TRACING)
    call = call_number(sync)
    span = dctx.tracing.begin(OPERATION_EVENT + _SITE, nbytes=n * SIZE, op=call)
    flag = header_value(call, signature)
    headers = headers_of(sync, programs, call, WORLD)
    slot = ws + (call & 1) * WORLD * capacity
    ok = not failed(dctx)  # a failed context sends peers nothing, and its output is NaN
    if ok & (tl.program_id(0) == 0):  # where every algorithm announces its calls: one write per peer
        announce(dctx, headers, flag, RANK, WORLD)
    if ok:
        for start in range(tl.program_id(0) * BLOCK, words, tl.num_programs(0) * BLOCK):
            w = dctx.block_offsets(ws, start, BLOCK)
            packed = (flag.to(tl.int64) << 32) | _payload(inp, w, n, SIZE)
            for q in tl.static_range(WORLD):
                if q != RANK:
                    publish(dctx, slot + RANK * capacity + w, packed, q, w < words)
    ELEMENTS: tl.constexpr = BLOCK * 4 // SIZE
    for start in range(tl.program_id(0) * ELEMENTS, n, tl.num_programs(0) * ELEMENTS):
        e = dctx.block_offsets(inp, start, ELEMENTS)
        mask = e < n
        args = (dctx, inp, slot, capacity, e, mask, flag, headers)
        acc, arrived = reduce_in_rank_order(_own_elements, _peer_elements, args, RANK, WORLD, OP)
        tl.store(out + e, acc.to(out.dtype.element_ty), mask=mask)
        ok = ok & arrived
    count_call(sync, programs, call, dctx.block_offsets(sync, 0, LANES))
    if not ok:
        poison_blocks(dctx, out, n, n, tl.program_id(0), tl.num_programs(0), ELEMENTS)
    dctx.tracing.end(span)


#: Most bytes per rank a call may have: the workspace holds twice the input per peer and slot,
#: which is worth it only where latency dominates (the automatic choice stops far below).
MAX_BYTES = 1 << 20


def _all_reduce(call: CollectiveCall):
    ctx, n, size = call.context, call.input.numel(), call.input.element_size()
    words = triton.cdiv(n * size, 4)
    ws, region_bytes = ctx.workspaces.slot_regions("low_latency", words * 8, fill=0)
    shape = LOW_LATENCY_SHAPES[ctx.kernel_device_type]
    front = ctx.frontend
    grid = (max(1, min(ctx.programs, triton.cdiv(words, shape["BLOCK"]))),)
    return front.launch(
        low_latency_kernel, grid, context=ctx.get_device_context(), inp=call.input, out=call.output,
        ws=ws.view(torch.int64), sync=ctx.collective_sync(), programs=ctx.programs, n=n, words=words,
        capacity=region_bytes // 8, signature=call.signature, CTX=front.device_context, TRACING=ctx.tracing.enabled,
        RANK=ctx.rank, WORLD=ctx.world_size, OP=call.op, SIZE=size, **shape)


ALL_REDUCE_LOW_LATENCY = Algorithm(
    name="low_latency", collective="all_reduce", run=_all_reduce, languages=SHARED_SOURCE_LANGUAGES,
    description="one-shot with a flag in every 64-bit word: no fence, no separate signal; for small calls",
    max_bytes=MAX_BYTES, priority=30, chosen_up_to=ALL_REDUCE_CHOSEN_UP_TO["low_latency"])
