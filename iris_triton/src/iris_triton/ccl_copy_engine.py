"""Collectives carried by the copy engines (algorithm ``copy_engine``): all_gather, all_to_all
and all_reduce.

For large calls the link's bandwidth decides. On 2 x H200 the multiprocessors' remote stores
move 358-370 GB/s and a ``copy_`` into a peer's heap (the DMA engines) 380-394 GB/s, without
taking a multiprocessor. Here data moves by ``copy_`` into the peers' workspace, on the
context's second stream (:mod:`iris_triton.streams`), chunk by chunk with a signal after each;
the current stream waits for each chunk of every peer and consumes it (copies it into the output,
or reduces it) while later chunks travel:

- all_gather and all_to_all: every rank sends its input (all_to_all: segment ``q``) to every
  peer ``q``, which copies it into its output.
- all_reduce, two-shot: rank ``q`` reduces segment ``q`` of every rank's tensor as its chunks
  arrive and sends each reduced chunk back the same way; every rank then takes the reduced
  segments into its tensor. Each segment is reduced by one rank only, with torch's elementwise
  operations, so every rank ends with the same bits.

Synchronisation: one-thread kernels (:mod:`iris_triton.copy_engine`) on int32 words on the heap:
``sent`` (chunks this rank sent each peer; advanced by the second stream), ``received`` (chunks
it consumed from each peer; advanced at the end of a call), ``arrived[q]`` (peer ``q``'s
``sent``) and ``freed[q]`` (peer ``q``'s ``received``). A rank sends a call's first chunk only
after every peer consumed everything sent before (``freed[q] >= sent``), so one workspace serves
calls of every size; the counts live on the device, so calls need no host work and can be
captured in CUDA graphs. Every wait is bounded and records the peer when it gives up.
"""

from __future__ import annotations

import attrs
import torch
import triton

from iris.collectives import Algorithm, CollectiveCall
from iris_triton.copy_engine import heap_buffer, peers, signal_peers, wait_for_peers
from iris_triton.streams import alongside, join

__all__ = ["ALL_GATHER_COPY_ENGINE", "ALL_REDUCE_COPY_ENGINE", "ALL_TO_ALL_COPY_ENGINE"]

#: Most chunks per call, and the smallest chunk (bytes of one segment) per device type: fewer
#: chunks wait less, more chunks hide more of the consuming behind the transfers.
MAX_CHUNKS = 8
MIN_CHUNK_BYTES = {"cuda": 4 << 20, "cpu": 256}
#: Chunk boundaries fall on multiples of this many elements (aligned copies).
CHUNK_ALIGNMENT = 128


@attrs.frozen
class _Sync:
    """This rank's synchronisation words (see the module's doc)."""

    sent: torch.Tensor
    received: torch.Tensor
    arrived: torch.Tensor
    freed: torch.Tensor

    @classmethod
    def of(cls, context) -> "_Sync":
        world = context.world_size
        words = context.ccl.workspace(4 * (2 + 2 * world), name="copy_engine_sync", zeroed=True).view(torch.int32)
        return cls(sent=words[0:1], received=words[1:2], arrived=words[2:2 + world],
                   freed=words[2 + world:2 + 2 * world])


def _chunks(context, elements: int, element_size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of the chunks of a segment of ``elements`` (the same on every rank)."""
    count = max(1, min(MAX_CHUNKS, triton.cdiv(elements * element_size, MIN_CHUNK_BYTES[context.device.type])))
    size = triton.cdiv(triton.cdiv(elements, count), CHUNK_ALIGNMENT) * CHUNK_ALIGNMENT
    return [(start, min(start + size, elements)) for start in range(0, elements, size)]


def _send(context, rows: torch.Tensor, pieces) -> None:
    """Copy each ``(peer, offset, piece)`` of ``pieces`` into row ``rank`` of that peer's
    ``rows`` (heap), at ``offset``, on the current stream."""
    for q, offset, piece in pieces:
        if piece.numel():
            context.heap.peer_view(rows[context.rank, offset:offset + piece.numel()], q).copy_(piece)


def _combine(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    """``acc := op(acc, other)`` elementwise, in place."""
    if op == "sum":
        acc.add_(other)
    elif op == "max":
        torch.maximum(acc, other, out=acc)
    else:
        torch.minimum(acc, other, out=acc)


def _gather_rows(call: CollectiveCall, m: int, source) -> None:
    """Send ``source(q)`` (``m`` elements) to every peer ``q`` and copy what every peer sent into
    segment ``q`` of the output (all_gather, all_to_all); this rank's own segment is
    ``source(rank)``."""
    ctx, out = call.context, call.output.view(-1)
    rank = ctx.rank
    rows = heap_buffer(ctx, "copy_engine", (ctx.world_size, m), call.input.dtype)
    sync = _Sync.of(ctx)
    chunks = _chunks(ctx, m, call.input.element_size())
    with alongside(ctx):
        wait_for_peers(ctx, sync.sent, sync.freed, 0, call.collective)
        for start, stop in chunks:
            _send(ctx, rows, [(q, start, source(q)[start:stop]) for q in peers(ctx)])
            signal_peers(ctx, sync.sent, sync.arrived)
    out[rank * m:(rank + 1) * m].copy_(source(rank))
    for k, (start, stop) in enumerate(chunks):
        wait_for_peers(ctx, sync.received, sync.arrived, k + 1, call.collective)
        for q in peers(ctx):
            out[q * m + start:q * m + stop].copy_(rows[q, start:stop])
    signal_peers(ctx, sync.received, sync.freed, len(chunks))
    join(ctx)


def _all_gather(call: CollectiveCall) -> None:
    _gather_rows(call, call.input.numel(), lambda q: call.input)


def _all_to_all(call: CollectiveCall) -> None:
    m = call.input.numel() // call.context.world_size
    _gather_rows(call, m, lambda q: call.input[q * m:(q + 1) * m])


def _all_reduce(call: CollectiveCall) -> None:
    ctx, x = call.context, call.input
    rank, world, n = ctx.rank, ctx.world_size, x.numel()
    m = triton.cdiv(n, world)
    inputs, reduced = heap_buffer(ctx, "copy_engine", (2, world, m), x.dtype).unbind(0)
    sync = _Sync.of(ctx)
    chunks = _chunks(ctx, m, x.element_size())

    def segment(q: int, start: int, stop: int) -> torch.Tensor:
        """Chunk ``[start, stop)`` of segment ``q`` of ``x`` (the last segment may be shorter)."""
        return x[min(q * m + start, n):min(q * m + stop, n)]

    with alongside(ctx):
        wait_for_peers(ctx, sync.sent, sync.freed, 0, "all_reduce")
        for start, stop in chunks:
            _send(ctx, inputs, [(q, start, segment(q, start, stop)) for q in peers(ctx)])
            signal_peers(ctx, sync.sent, sync.arrived)
    for k, (start, stop) in enumerate(chunks):
        wait_for_peers(ctx, sync.received, sync.arrived, k + 1, "all_reduce")
        mine = segment(rank, start, stop)
        for q in range(world):
            if q != rank:
                _combine(mine, inputs[q, start:start + mine.numel()], call.op)
        with alongside(ctx):
            _send(ctx, reduced, [(q, start, mine) for q in peers(ctx)])
            signal_peers(ctx, sync.sent, sync.arrived)
    for k, (start, stop) in enumerate(chunks):
        wait_for_peers(ctx, sync.received, sync.arrived, len(chunks) + k + 1, "all_reduce")
        for q in peers(ctx):
            theirs = segment(q, start, stop)
            theirs.copy_(reduced[q, start:start + theirs.numel()])
    signal_peers(ctx, sync.received, sync.freed, 2 * len(chunks))
    join(ctx)


ALL_GATHER_COPY_ENGINE = Algorithm(
    name="copy_engine", collective="all_gather", run=_all_gather,
    description="copy engines carry the input to every peer in chunks; for large calls")
ALL_TO_ALL_COPY_ENGINE = Algorithm(
    name="copy_engine", collective="all_to_all", run=_all_to_all,
    description="copy engines carry segment q to rank q in chunks; for large calls")
ALL_REDUCE_COPY_ENGINE = Algorithm(
    name="copy_engine", collective="all_reduce", run=_all_reduce,
    description="two-shot with copy engines carrying the chunks; torch reduces them; for large calls")
