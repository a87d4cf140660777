"""Matrix products overlapped with copy-engine transfers: cuBLAS computes, the DMA engines move.

The fused kernels of :mod:`iris_triton.operations.fused` move data with the multiprocessors and compute
with a Triton GEMM, which runs below cuBLAS (benchmarks/NOTES.md). Here the product is split by the
rows that ranks own, each part a ``torch.matmul`` at cuBLAS's speed, and the data moves by
``copy_`` into the peer's heap (a device-to-device copy over NVLink, done by the copy engines,
taking no multiprocessor from the GEMM) on a second stream, while the other part computes:

- ``all_gather_matmul``: the second stream copies this rank's rows of ``A`` into every peer's
  gathered ``A``, while this rank multiplies its own rows; then it multiplies each peer's rows
  once they arrived.
- ``matmul_reduce_scatter``: this rank first multiplies the rows every peer owns, the second
  stream copies each such partial result into its owner's receive buffer while this rank
  multiplies its own rows; then one kernel adds its own and the peers' partial results in rank
  order, in float32 for 16-bit types, and rounds once (:func:`sum_partials`), as the collectives
  and the fused kernels reduce.

Ranks synchronise through one-thread kernels with words on the heap, per operation: ``pushes``
and ``calls`` (this rank's count of copies and of products: each stream advances its own),
``arrived[q]`` (set by peer ``q`` when its data for this rank's call landed) and ``freed[q]``
(set by peer ``q`` when it no longer needs what this rank sent it). A rank copies into a peer
only after the peer freed the previous call's data, so one buffer serves every call; the counts
live on the device, so calls need no host work and can be captured in CUDA graphs. A call
announces itself as the collectives' calls do (:mod:`iris_triton.protocol.calls`): once the peers freed
the previous call's data, before its copies, this rank writes the call's header (its number, the
``pushes`` count, and its signature: operation, shapes, dtypes, method) into every peer's header
row of the call (``headers[call & 1]``), and the wait for the peers' data reads the headers while
it spins and checks the header of each peer whose flag arrived: a peer in a different call is
recorded as a mismatch with both headers, and the output is NaN. Every wait is
bounded and records a give-up in the context's fault words; the last kernel of a call fills its
output with NaN when a failure is recorded (:mod:`iris_triton.protocol.waits`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from iris_triton.protocol.calls import announce, header_value
from iris_triton.device.context import DeviceContext
from iris_triton.protocol.reductions import own_block, reduce_in_rank_order, stacked_block
from iris_triton.protocol.waits import failed, poison, site_code, wait_for_peer_call, wait_or_record

__all__ = ["CopyEngineOps", "sum_partials"]

#: Elements per program of :func:`sum_partials` (4 warps: 16 per thread, two 16-byte vectors of bf16).
SUM_BLOCK = 2048


@triton.jit
def wait_for_peers_kernel(context, counter, flags, headers, signature, AHEAD: tl.constexpr, RANK: tl.constexpr,
                          WORLD: tl.constexpr, SITE: tl.constexpr, ANNOUNCE: tl.constexpr):
    """Wait until every peer's ``flags[q]`` here reaches this rank's ``counter`` (the call's number)
    plus ``AHEAD``. With ``ANNOUNCE`` (the wait before this rank's copies, for the peers to free
    the previous call's data: then no peer still reads the header two calls back), then announce
    the call (``signature``) in header ``RANK`` of its row of ``headers`` on every peer; without
    (the wait for the peers' data), read the peers' headers while waiting, and check each peer's
    once its flag arrived (:func:`iris_triton.protocol.waits.wait_for_peer_call`)."""
    dctx = DeviceContext.initialize(context, RANK, WORLD)
    call = tl.load(counter)
    target = call + AHEAD
    row = headers + (call & 1) * WORLD
    announced = header_value(call, signature)
    for q in range(WORLD):  # one wait after another: a loop, as the collectives' waits are
        if q != RANK:
            if ANNOUNCE:
                wait_or_record(dctx, flags + q, target, q, SITE)
            else:
                wait_for_peer_call(dctx, flags + q, target, q, row, announced, SITE)
    if ANNOUNCE:
        if not failed(dctx):
            announce(dctx, row, announced, RANK, WORLD)


@triton.jit
def poison_if_failed_kernel(context, out, numel, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Fill ``out`` with NaN if a failure is recorded on this rank (a wait of the call gave up)."""
    dctx = DeviceContext.initialize(context, RANK, WORLD)
    if failed(dctx):
        poison(dctx, out, numel, BLOCK)


@triton.jit
def signal_peers_kernel(context, counter, flags, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Advance this rank's ``counter`` and set ``flags[RANK]`` on every peer to it (release, system
    scope: what this stream did before, copies included, is visible to whoever sees the flag);
    on a failed context no flag: its peers give up rather than take its data."""
    dctx = DeviceContext.initialize(context, RANK, WORLD)
    count = tl.load(counter) + 1
    tl.store(counter, count)
    if not failed(dctx):
        for q in tl.static_range(WORLD):
            if q != RANK:
                dctx.signal(flags + RANK, count, q)


@triton.jit
def sum_partials_kernel(out, own, parts, numel, part_stride, OWN: tl.constexpr, PARTS: tl.constexpr,
                        BLOCK: tl.constexpr):
    """``out`` := the sum of ``PARTS`` partial results in order, part ``k`` at ``parts + k *
    part_stride`` except part ``OWN``, read from ``own`` (which may be ``out``); accumulated in
    float32 for 16-bit floats and rounded once (:func:`iris_triton.protocol.reductions.reduce_in_rank_order`,
    as the collectives reduce)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    stride = tl.cast(part_stride, tl.int64)  # part k's offset may pass 2**31 where one part does not
    acc, _ = reduce_in_rank_order(own_block, stacked_block, (own, parts, offs, mask, stride), OWN, PARTS, "sum")
    tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)


def sum_partials(out: torch.Tensor, own: torch.Tensor, parts: torch.Tensor, position: int) -> torch.Tensor:
    """``out`` := ``parts[0] + parts[1] + ...`` in that order, with ``own`` in place of
    ``parts[position]``, accumulated in float32 for 16-bit floats and rounded once to ``out``'s
    dtype: one pass that reads every part and writes ``out`` once. ``out`` and ``own`` (which may
    be the same tensor) are contiguous with ``parts.shape[1:]``; ``parts`` is contiguous and of
    their dtype. No host synchronisation (CUDA-graph capturable)."""
    numel = out.numel()
    if numel == 0:
        return out
    sum_partials_kernel[(triton.cdiv(numel, SUM_BLOCK),)](out, own, parts, numel, parts[0].numel(), OWN=position,
                                                         PARTS=parts.shape[0], BLOCK=SUM_BLOCK, num_warps=4)
    return out


class _Sync:
    """The synchronisation words of one operation on this rank's heap (see the module's doc):
    ``[pushes, calls, arrived[world], freed[world], headers[3, world]]`` (the headers: a row per
    call parity, then a row of announcements that stays 0, which the waits also read)."""

    def __init__(self, context, name: str):
        world = context.world_size
        words = context.workspaces.get(f"{name}_sync", 4 * (2 + 5 * world), fill=0).view(torch.int32)
        self.pushes, self.calls = words[0:1], words[1:2]
        self.arrived, self.freed = words[2:2 + world], words[2 + world:2 + 2 * world]
        self.headers = words[2 + 2 * world:2 + 5 * world]


class CopyEngineOps:
    """The copy-engine form of ``ctx.ops``'s products; ``alongside``/``join`` run work on the
    operations' second stream and join it back (:class:`iris_triton.operations.fused_ops.FusedOps`)."""

    def __init__(self, context, alongside, join):
        self._context = context
        self._alongside = alongside
        self._join = join
        self._syncs: dict[str, _Sync] = {}
        self._scratch_space: torch.Tensor | None = None

    def all_gather_matmul(self, out: torch.Tensor, a_shard: torch.Tensor, b: torch.Tensor,
                          signature: int) -> torch.Tensor:
        """``all_gather(a_shard) @ b`` into ``out``, a call of ``signature`` (what it announces)."""
        ctx, rank, world = self._context, self._context.rank, self._context.world_size
        m, K = a_shard.shape
        gathered = self._buffer("all_gather_matmul", (world * m, K), a_shard.dtype)
        sync = self._sync("all_gather_matmul")
        with self._alongside():
            self._wait(sync, sync.pushes, sync.freed, 0, "all_gather_matmul", signature)
            for q in self._peers():
                ctx.heap.peer_view(gathered[rank * m:(rank + 1) * m], q).copy_(a_shard)
            self._signal(sync.pushes, sync.arrived)
        torch.matmul(a_shard, b, out=out[rank * m:(rank + 1) * m])
        self._wait(sync, sync.calls, sync.arrived, 1, "all_gather_matmul", signature)
        for q in self._peers():
            torch.matmul(gathered[q * m:(q + 1) * m], b, out=out[q * m:(q + 1) * m])
        self._signal(sync.calls, sync.freed)
        self._join()
        self._poison_if_failed(out)
        return out

    def matmul_reduce_scatter(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                              signature: int) -> torch.Tensor:
        """``reduce_scatter(a @ b)`` into ``out``, a call of ``signature`` (what it announces)."""
        ctx, rank, world = self._context, self._context.rank, self._context.world_size
        m, N = out.shape
        received = self._buffer("matmul_reduce_scatter", (world, m, N), out.dtype)
        partial = self._scratch((world - 1, m, N), out.dtype)
        sync = self._sync("matmul_reduce_scatter")
        peers = self._peers()
        for k, q in enumerate(peers):
            torch.matmul(a[q * m:(q + 1) * m], b, out=partial[k])
        with self._alongside():
            self._wait(sync, sync.pushes, sync.freed, 0, "matmul_reduce_scatter", signature)
            for k, q in enumerate(peers):
                ctx.heap.peer_view(received[rank], q).copy_(partial[k])
            self._signal(sync.pushes, sync.arrived)
        torch.matmul(a[rank * m:(rank + 1) * m], b, out=out)
        self._wait(sync, sync.calls, sync.arrived, 1, "matmul_reduce_scatter", signature)
        sum_partials(out, out, received, rank)  # out, this rank's own product, in place of received[rank]
        self._signal(sync.calls, sync.freed)
        self._join()
        self._poison_if_failed(out)
        return out

    # -- pieces ---------------------------------------------------------------------------------

    def _peers(self) -> list[int]:
        """The other ranks, starting after this one (so ranks do not all copy to rank 0 first)."""
        ctx = self._context
        return [(ctx.rank + k) % ctx.world_size for k in range(1, ctx.world_size)]

    def _buffer(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A heap buffer of ``shape``, the same on every rank (grown collectively when needed)."""
        nbytes = math.prod(shape) * dtype.itemsize
        space = self._context.workspaces.get(f"copy_engine_{name}", nbytes)
        return space[:nbytes].view(dtype).view(shape)

    def _scratch(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A local buffer of ``shape``: a view of one allocation that only grows (as the heap
        workspaces: make one call of each size and dtype before capturing). An allocation
        outgrown after a capture is kept, so graphs captured with it keep writing into memory no
        tensor reuses."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self._scratch_space is None or self._scratch_space.numel() < nbytes:
            workspaces = self._context.workspaces
            if self._scratch_space is not None and workspaces.graph_captured:
                workspaces.keep_for_graphs(self._scratch_space)
            self._scratch_space = torch.empty(nbytes, dtype=torch.uint8, device=self._context.device)
        return self._scratch_space[:nbytes].view(dtype).view(shape)

    def _sync(self, name: str) -> _Sync:
        if name not in self._syncs:
            self._syncs[name] = _Sync(self._context, f"copy_engine_{name}")
        return self._syncs[name]

    def _wait(self, sync: _Sync, counter, flags, ahead: int, site: str, signature: int) -> None:
        """Wait for ``flags`` to reach ``counter`` plus ``ahead``: for the peers' data (``ahead``
        1), or before the copies, for the peers to free the previous call's (0; then announce the
        call of ``signature``)."""
        ctx = self._context
        wait_for_peers_kernel[(1,)](ctx.get_device_context(), counter, flags, sync.headers, signature, AHEAD=ahead,
                                    RANK=ctx.rank, WORLD=ctx.world_size, SITE=site_code(site), ANNOUNCE=ahead == 0,
                                    num_warps=1)

    def _poison_if_failed(self, out: torch.Tensor) -> None:
        ctx = self._context
        poison_if_failed_kernel[(1,)](ctx.get_device_context(), out, out.numel(), RANK=ctx.rank, WORLD=ctx.world_size,
                                      BLOCK=1024)

    def _signal(self, counter, flags) -> None:
        ctx = self._context
        signal_peers_kernel[(1,)](ctx.get_device_context(), counter, flags, RANK=ctx.rank, WORLD=ctx.world_size,
                                  num_warps=1)
