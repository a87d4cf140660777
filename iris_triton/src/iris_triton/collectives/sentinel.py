"""Sentinel all_reduce: floating-point data that announces itself, at no cost on the link (entry
point ``iris.ccl.all_reduce`` ``sentinel``).

The one-shot all_reduce of :mod:`iris_triton.collectives.kernels` orders data and signal with a release (a
system-scope fence that waits until the pushed data reached the peer) and an acquire on the peer;
the low-latency one (:mod:`iris_triton.collectives.low_latency`) carries a flag in every word, which doubles
the bytes on the link. Here the receiving workspace holds a *sentinel* wherever no data is:

- Every byte of the workspace is 0xFF when allocated: an all-ones element, which is a NaN in
  bf16, fp16 and fp32 alike. A sender replaces an all-ones element of its input by the same NaN
  with the sign bit clear (so no value pushed is the sentinel, and a NaN stays a NaN), then
  pushes its input into every peer's region with plain vector stores: no fence, no flag.
- A receiver reads its own workspace (volatile loads) until no element of the block is the
  sentinel (waiting meanwhile as iris's bounded waits do), writes the sentinel back, and reduces
  in rank order, its own input taken with the same replacement, so every rank gets the same bits.
  An aligned 2- or 4-byte element reaches the peer whole, so an element that is not the sentinel
  holds this call's value.
- The workspace has two slots, used by alternate calls (call numbers are the collectives' call
  counts, :mod:`iris_triton.protocol.calls`). A rank's call ``k + 2`` writes into the slot of call ``k``;
  it starts only after its call ``k + 1`` received every peer's call ``k + 1`` data, which each
  peer pushed after finishing its call ``k``, reset of the slot included. Regions are laid out in
  bytes by the workspace's size, so calls of any dtype and size use the same slots.
- A wait that gives up fails the context (:mod:`iris_triton.protocol.waits`): nothing reads the workspace
  again, so a late peer's data that lands afterwards is never taken for a later call's.

It moves the bytes of a one-shot with one link crossing of latency, for 16- and 32-bit floats.
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
from iris_triton.tuning import ALL_REDUCE_CHOSEN_UP_TO, SENTINEL_SHAPES
from iris_triton.protocol.waits import failed, peers_announced, poison_blocks, publish, read_when_arrived, site_code

__all__ = ["ALL_REDUCE_SENTINEL", "MAX_BYTES", "SENTINEL_BYTE", "SENTINEL_DTYPES", "sentinel_kernel"]

#: The value of every byte of the workspace where no data is.
SENTINEL_BYTE = 0xFF
#: What a wait of this kernel that gives up records (:mod:`iris_triton.protocol.waits`).
_SITE: tl.constexpr = tl.constexpr(site_code("all_reduce"))


@triton.jit
def _sendable(inp, e, mask, BITS: tl.constexpr):
    """This rank's elements ``e`` of ``inp`` as ``BITS`` integers, the all-ones pattern (the
    sentinel) replaced by the same NaN with its sign bit clear: what its peers receive."""
    bits = tl.load(inp + e, mask=mask).to(BITS, bitcast=True)
    return tl.where(bits == -1, bits & ((1 << (BITS.primitive_bitwidth - 1)) - 1), bits)


@triton.jit
def _is_sentinel(bits, sentinel):
    return bits == sentinel


@triton.jit
def _first_word(buffer, e):
    """The 32-bit word holding the block's first element (it changes when the block lands)."""
    return (buffer + tl.min(e, axis=0)).to(tl.pointer_type(tl.int32))


@triton.jit
def _own_elements(args):
    """This rank's elements, with the replacement its peers see."""
    dctx, inp, slot, capacity, e, mask, headers, announced = args
    return _sendable(inp, e, mask, slot.dtype.element_ty).to(inp.dtype.element_ty, bitcast=True)


@triton.jit
def _peer_elements(q, args):
    """``(elements, arrived)``: peer q's elements once they all landed; the sentinel goes back,
    for the slot's next call."""
    dctx, inp, slot, capacity, e, mask, headers, announced = args
    region = slot + q * capacity
    bits, arrived = read_when_arrived(dctx, region, e, mask, -1, q, headers, announced, _is_sentinel, _first_word,
                                      "ne", _SITE)
    tl.store(region + e, bits | -1, mask=mask)
    return bits.to(inp.dtype.element_ty, bitcast=True), arrived


def sentinel_kernel(context, inp, out, ws, sync, programs, n, capacity, signature, CTX: tl.constexpr,
                    TRACING: tl.constexpr,
                    RANK: tl.constexpr, WORLD: tl.constexpr, OP: tl.constexpr, BLOCK: tl.constexpr,
                    LAG: tl.constexpr):
    """All-reduce ``n`` floats from ``inp`` into ``out`` (may be ``inp``): push this rank's
    elements into every peer's slot region ``RANK`` (regions of ``capacity`` elements of ``ws``,
    integers of the floats' size), then reduce what every peer pushed here.

    Program ``p`` owns blocks ``p, p + P, ...``. Step ``i`` pushes its block ``i`` and reduces
    its block ``i - LAG`` (a program with at most ``LAG`` blocks pushes them all, then reduces
    them), so the reduction of blocks that landed runs while later blocks cross the link; a
    block is reduced only after it was pushed, so an in-place call reads no element after it was
    written. A program announces the call (its number and ``signature``) to its peers first, and
    checks what they announced last: the data carry no call number, so a peer that made a
    different call fails the call instead of passing its data off as this call's. Its waits read
    the headers too, so such a peer fails the call as soon as its header lands, whatever
    algorithm it runs."""
    dctx = CTX.initialize(context, RANK, WORLD, TRACING)
    call = call_number(sync)
    span = dctx.tracing.begin(OPERATION_EVENT + _SITE, nbytes=n * (inp.dtype.element_ty.primitive_bitwidth // 8),
                              op=call)
    headers = headers_of(sync, programs, call, WORLD)
    announced = header_value(call, signature)
    announce(dctx, headers, announced, RANK, WORLD)
    slot = ws + (call & 1) * WORLD * capacity
    BITS: tl.constexpr = ws.dtype.element_ty
    first, stride = tl.program_id(0) * BLOCK, tl.num_programs(0) * BLOCK
    blocks = tl.cdiv(n - first, stride)
    lag = tl.minimum(blocks, LAG)
    alive = not failed(dctx)  # a failed context sends peers nothing, and its output is NaN
    ok = alive  # and every block so far arrived
    for step in range(0, blocks + lag):
        if (step < blocks) & alive:
            e = dctx.block_offsets(inp, first + step * stride, BLOCK)
            bits = _sendable(inp, e, e < n, BITS)
            for q in tl.static_range(WORLD):
                if q != RANK:
                    publish(dctx, slot + RANK * capacity + e, bits, q, e < n)
        if step >= lag:
            e = dctx.block_offsets(inp, first + (step - lag) * stride, BLOCK)
            args = (dctx, inp, slot, capacity, e, e < n, headers, announced)
            acc, arrived = reduce_in_rank_order(_own_elements, _peer_elements, args, RANK, WORLD, OP)
            tl.store(out + e, acc.to(out.dtype.element_ty), mask=e < n)
            ok = ok & arrived
    ok = ok & peers_announced(dctx, headers, announced, RANK, WORLD, _SITE, True)
    count_call(sync, programs, call, dctx.block_offsets(sync, 0, LANES))
    if not ok:
        poison_blocks(dctx, out, n, n, tl.program_id(0), tl.num_programs(0), BLOCK)
    dctx.tracing.end(span)


#: The dtypes it takes: an all-ones element is a NaN in each.
SENTINEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Most bytes per rank a call may have: the workspace holds two slots of every rank's input.
MAX_BYTES = 8 << 20
#: The workspace seen as integers of the elements' size.
_BITS = {2: torch.int16, 4: torch.int32}


def _all_reduce(call: CollectiveCall):
    ctx, n, size = call.context, call.input.numel(), call.input.element_size()
    world = ctx.world_size
    ws, region_bytes = ctx.workspaces.slot_regions("sentinel", n * size, fill=SENTINEL_BYTE)
    shape = SENTINEL_SHAPES[ctx.kernel_device_type]
    front = ctx.frontend
    grid = (max(1, min(ctx.programs, triton.cdiv(n, shape["BLOCK"]))),)
    return front.launch(
        sentinel_kernel, grid, context=ctx.get_device_context(), inp=call.input, out=call.output,
        ws=ws[: 2 * world * region_bytes].view(_BITS[size]), sync=ctx.collective_sync(), programs=ctx.programs,
        n=n, capacity=region_bytes // size, signature=call.signature, CTX=front.device_context,
        TRACING=ctx.tracing.enabled, RANK=ctx.rank, WORLD=world, OP=call.op, **shape)


ALL_REDUCE_SENTINEL = Algorithm(
    name="sentinel", collective="all_reduce", run=_all_reduce, languages=SHARED_SOURCE_LANGUAGES,
    description="one-shot into a workspace that holds a NaN sentinel until data lands: no fence, no flag, "
                "the bytes of a one-shot; floating-point tensors",
    dtypes=SENTINEL_DTYPES, max_bytes=MAX_BYTES, priority=20, chosen_up_to=ALL_REDUCE_CHOSEN_UP_TO["sentinel"])
