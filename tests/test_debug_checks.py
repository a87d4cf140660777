"""Checks that catch misuse of the symmetric heap across real rank processes (CPU ranks).

- Without debug mode, every ``ctx.barrier()`` and ``iris.create()`` compares the ranks' allocation
  digests and raises AsymmetricHeapError on every rank, naming the first call that differs.
- With ``IRIS_DEBUG=1``, a kernel's write into a block the target rank has not allocated (yet, or
  any more, or past the end of a tensor) stops the kernel with the rank, the peer and the offset.
- A tensor that ends exactly at the heap's end is on the heap, in ``is_symmetric`` and in kernels.

Spawning ranks costs seconds, so one worker per world size makes every check and reports them.
"""

from __future__ import annotations

import os
import pickle
import re
import zlib

import pytest
import torch
import triton
import triton.language as tl

import iris
from iris.errors import AsymmetricHeapError, IrisError
from iris.heap import SymmetricHeap
from iris.heap.mapping import HeapMapping
from iris.testing import RankReport, assert_rank_checks, interpreted_device

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="CPU ranks need /dev/shm")

HEAP = "1MiB"
FIX = "allocate and free the same sizes in the same order on every rank"
#: The writing device functions a write into a freed block must stop.
WRITES = ("store", "put", "copy", "atomic_add", "atomic_cas")
#: The device functions an access into another node's heap must stop.
OFF_NODE = ("store", "put", "load")


# -- kernels (the write checks are compiled in when IRIS_DEBUG=1 as iris is imported) ----------------------


@triton.jit
def remote_write_kernel(dst, src, heap_bases, offset, n, RANK: tl.constexpr, PEER: tl.constexpr, HOW: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Writes n elements at ``dst + offset`` on PEER, by one of iris's writing device functions."""
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    if HOW == "store":
        iris.store(dst + offset + offs, tl.full((BLOCK,), 7.0, tl.float32), RANK, PEER, heap_bases, mask=mask)
    elif HOW == "put":
        iris.put(src + offs, dst + offset + offs, RANK, PEER, heap_bases, mask=mask)
    elif HOW == "copy":
        iris.copy(src + offs, dst + offset + offs, RANK, PEER, RANK, heap_bases, mask=mask)
    elif HOW == "atomic_add":
        iris.atomic_add(dst + offset + offs, 7.0, RANK, PEER, heap_bases, mask=mask)
    elif HOW == "atomic_cas":
        iris.atomic_cas((dst + offset).to(tl.pointer_type(tl.int32), bitcast=True), 0, 7, RANK, PEER, heap_bases)
    else:
        tl.static_assert(HOW == "load", "HOW: store, put, copy, atomic_add, atomic_cas or load")
        tl.store(src + offs, iris.load(dst + offset + offs, RANK, PEER, heap_bases, mask=mask), mask=mask)


def _write(ctx, dst, offset: int, n: int, peer: int, how: str = "store") -> str:
    """Launch one remote write; what stopped it ("" when nothing did)."""
    src = ctx.heap.peer_view(dst, ctx.rank)  # any local heap memory of the right type
    try:
        remote_write_kernel[(1,)](dst, src, ctx.get_heap_bases(), offset, n, RANK=ctx.rank, PEER=peer, HOW=how,
                                  BLOCK=64)
    except IrisError as error:  # the check's own error, not Triton's InterpreterError around its repr
        return f"{type(error).__name__}: {error}"
    return ""


def _caught(message: str, rank: int, peer: int, offset: int, what: str) -> bool | str:
    """Whether ``message`` is the debug check's report of ``what`` at ``offset`` (else the message)."""
    verb = "wrote to" if what == "unallocated" else "addressed"
    wanted = f"rank {rank} {verb} rank {peer}'s heap at byte offset {offset},"
    return (message.startswith("IrisError: iris (IRIS_DEBUG)") and wanted in message) or message or "not caught"


# -- the worker ----------------------------------------------------------------------------------------------


def _asymmetric_error(ctx, steps) -> str:
    """Run ``steps(ctx)``, then the barrier: the AsymmetricHeapError text, or "" if none."""
    steps(ctx)
    try:
        ctx.barrier()
    except AsymmetricHeapError as error:
        return str(error)
    return ""


def _digest_checks(report: RankReport, rank: int, world: int) -> None:
    """Asymmetry caught by the barrier with debug mode off (no per-call comparison)."""
    ctx = iris.create(heap_size=HEAP, device="cpu", debug=False)
    ctx.zeros(5)
    ctx.barrier()  # the same calls so far: the digests agree
    report.check("digest/same_calls_pass", True)

    held: list[torch.Tensor] = []
    error = _asymmetric_error(ctx, lambda c: held.extend([c.zeros(1024 + 16384 * rank), c.zeros(100)]))
    a = held[0]
    mine = f"rank {rank}: call #"
    report["digest/allocation_size_caught"] = (
        f"allocate({4 * (1024 + 16384 * rank)} bytes at offset {ctx.heap.offset_of(a)}, ({1024 + 16384 * rank},) "
        f"torch.float32)" in error and mine in error and FIX in error and "ctx.barrier()" in error) or error
    indices = set(re.findall(r"rank \d+: call #(\d+)", error))
    report["digest/one_index_for_all_ranks"] = len(indices) == 1 or error
    report["digest/names_every_rank"] = all(f"rank {q}: call #" in error for q in range(world)) or error
    report["digest/same_text_everywhere"] = len(set(ctx.comm.all_gather_object(error))) == 1
    # Still asymmetric: every later barrier says so, before any rank writes into a peer again.
    report["digest/later_barrier_still_raises"] = _asymmetric_error(ctx, lambda c: None) == error or "no error"
    ctx.destroy()

    cases = {
        "free": lambda c, t: c.free(t[rank % 2]),
        "order": lambda c, t: [c.zeros(n) for n in ((10, 300) if rank == 0 else (300, 10))],
        "extra_call": lambda c, t: c.zeros(3) if rank == world - 1 else None,
    }
    for name, steps in cases.items():
        ctx = iris.create(heap_size=HEAP, device="cpu", debug=False)
        pair = [ctx.zeros(8), ctx.zeros(8)]
        ctx.barrier()
        error = _asymmetric_error(ctx, lambda c, steps=steps, pair=pair: steps(c, pair))
        report[f"digest/{name}_caught"] = (FIX in error and f"rank {rank}: " in error) or error or "not caught"
        if name == "free":
            report["digest/free_named"] = "free(256 bytes at offset" in error or error
        if name == "extra_call":
            report["digest/missing_call_named"] = "no call #" in error or error
        ctx.destroy()

    # Same bytes in the same order, other shapes: the layout is symmetric, so no error.
    ctx = iris.create(heap_size=HEAP, device="cpu", debug=False)
    report["digest/shape_alone_is_not_asymmetry"] = _asymmetric_error(
        ctx, lambda c: c.zeros((4, 8) if rank == 0 else (32,))) == ""
    ctx.destroy()


def _create_check(report: RankReport, rank: int) -> None:
    """iris.create() compares the digests after set-up: one rank's extra set-up allocation."""
    from iris_triton.backend import TritonDeviceOps

    original = TritonDeviceOps._setup

    def setup_with_an_extra_allocation(self):
        original(self)
        if self.rank == 1:
            self.zeros(1)

    TritonDeviceOps._setup = setup_with_an_extra_allocation
    try:
        iris.create(heap_size=HEAP, device="cpu", debug=False)
        error = ""
    except AsymmetricHeapError as caught:
        error = str(caught)
    finally:
        TritonDeviceOps._setup = original
    report["create/asymmetric_set_up_caught"] = ("iris.create()" in error and FIX in error) or error or "not caught"


def _off_node_check(report: RankReport, rank: int, world: int) -> None:
    """IRIS_DEBUG=1, every rank a node of its own: a write into another node's heap stops the
    kernel, saying the peer is on another node; a write into this rank's own heap lands."""
    ctx = iris.create(heap_size=HEAP, device="cpu", node_size=1)
    x = ctx.zeros(64)
    ctx.barrier()
    for how in OFF_NODE:
        message = _write(ctx, x, 0, 64, (rank + 1) % world, how)
        report[f"nodes/{how}_to_another_node_caught"] = (
            f"rank {rank} addressed rank {(rank + 1) % world}'s heap, which is on another node" in message) or message
    report["nodes/own_heap_lands"] = _write(ctx, x, 0, 64, rank) == ""
    report.check("nodes/own_heap_landed", torch.equal(x, torch.full((64,), 7.0)))
    ctx.barrier()
    ctx.destroy()


def _write_checks(report: RankReport, rank: int, world: int) -> None:
    """IRIS_DEBUG=1: writes into blocks the target has not allocated stop the kernel first."""
    ctx = iris.create(heap_size=HEAP, device="cpu")
    peer = (rank + 1) % world
    x = ctx.zeros(64)
    base = ctx.heap.offset_of(x)
    ctx.barrier()
    # Allocated on the peer and after a barrier: the write lands.
    report["write/allocated_lands"] = _write(ctx, x, 0, 64, peer) == ""
    ctx.barrier()
    report.check("write/allocated_landed", torch.equal(x, torch.full((64,), 7.0)))

    # Past the end of the tensor, into the peer's free heap: stopped, nothing written there.
    message = _write(ctx, x, 64, 64, peer)
    report["write/past_the_tensor_caught"] = _caught(message, rank, peer, base + 256, "unallocated")
    ctx.barrier()
    report.check("write/past_the_tensor_not_landed", not ctx.heap.view(base + 256, 256).any())

    # Freed on every rank (after a barrier): every writing function is stopped; a read is not.
    y = ctx.zeros(64)
    y_offset = ctx.heap.offset_of(y)
    ctx.barrier()
    ctx.free(y)
    ctx.barrier()  # freed on every rank
    for how in WRITES:
        message = _write(ctx, y, 0, 64, peer, how)
        report[f"write/{how}_into_freed_caught"] = _caught(message, rank, peer, y_offset, "unallocated")
    report["write/load_from_freed_not_checked"] = _write(ctx, y, 0, 64, peer, "load") == "" or "load was stopped"

    # Not yet allocated: the peer (rank 1) marks its map only after rank 0 has tried to write.
    ctx.barrier()
    if rank == 1:
        mark = ctx.heap._mark

        def late_mark(offset, nbytes, value):
            ctx.comm.barrier()  # rank 0 has written by now
            mark(offset, nbytes, value)

        ctx.heap._mark = late_mark
    z = ctx.zeros(64)
    if rank == 1:
        del ctx.heap._mark
    else:
        if rank == 0:
            message = _write(ctx, z, 0, 64, 1)
            report["write/not_yet_allocated_caught"] = _caught(message, 0, 1, ctx.heap.offset_of(z), "unallocated")
        ctx.comm.barrier()
    ctx.barrier()
    report.check("write/not_yet_allocated_not_landed", not z.any())

    # The heap's boundaries: a tensor ending exactly at the heap's end is on it, in kernels too.
    last = ctx.empty(ctx.heap.allocator.largest_free_block // 4)
    end = ctx.heap.offset_of(last) + last.numel() * 4
    report.check("bounds/last_tensor_ends_at_the_heap_end", end == ctx.heap_size)
    report.check("bounds/last_tensor_is_symmetric", ctx.is_symmetric(last) and ctx.is_symmetric(last[-1:]))
    report.check("bounds/heap_base_is_symmetric", ctx.is_symmetric(ctx.heap.local[:1]))
    ctx.barrier()
    report["bounds/last_element_writable"] = _write(ctx, last, last.numel() - 1, 1, peer) == ""
    ctx.barrier()
    report.check("bounds/last_element_written", last[-1].item() == 7.0)
    message = _write(ctx, last, last.numel(), 1, peer)
    report["bounds/first_byte_past_the_end_caught"] = _caught(message, rank, peer, ctx.heap_size, "outside")
    ctx.barrier()
    ctx.destroy()


def _worker(rank: int) -> bytes:
    report = RankReport(rank)
    world = torch.distributed.get_world_size()
    with report.section("digest"):
        _digest_checks(report, rank, world)
    with report.section("create"):
        _create_check(report, rank)
    with report.section("write"):
        _write_checks(report, rank, world)
    with report.section("nodes"):
        _off_node_check(report, rank, world)
    return report.packed()


@pytest.mark.parametrize("world", [2, 3])
def test_misuse_of_the_heap_is_caught_on_every_rank(world, monkeypatch):
    monkeypatch.setenv("IRIS_DEBUG", "1")  # the ranks import iris with the kernels' checks compiled in
    monkeypatch.setenv("IRIS_TIMEOUT", "60")
    reports = [pickle.loads(zlib.decompress(p)) for p in iris.spawn(_worker, world, device=interpreted_device())]
    assert_rank_checks(reports, "digest/", {f"digest/{name}" for name in (
        "same_calls_pass", "allocation_size_caught", "one_index_for_all_ranks", "names_every_rank",
        "same_text_everywhere", "later_barrier_still_raises", "free_caught", "order_caught", "extra_call_caught",
        "free_named", "missing_call_named", "shape_alone_is_not_asymmetry", "completed")})
    assert_rank_checks(reports, "create/", {"create/asymmetric_set_up_caught", "create/completed"})
    write = {f"write/{name}" for name in (
        "allocated_lands", "allocated_landed", "past_the_tensor_caught", "past_the_tensor_not_landed",
        *(f"{how}_into_freed_caught" for how in WRITES), "load_from_freed_not_checked",
        "not_yet_allocated_not_landed", "completed")}
    # Only rank 0 writes before its peer has allocated.
    assert_rank_checks(reports, "write/", lambda rank: write | ({"write/not_yet_allocated_caught"} if rank == 0
                                                                 else set()))
    assert_rank_checks(reports, "bounds/", {f"bounds/{name}" for name in (
        "last_tensor_ends_at_the_heap_end", "last_tensor_is_symmetric", "heap_base_is_symmetric",
        "last_element_writable", "last_element_written", "first_byte_past_the_end_caught")})
    assert_rank_checks(reports, "nodes/", {f"nodes/{how}_to_another_node_caught" for how in OFF_NODE} | {
        "nodes/own_heap_lands", "nodes/own_heap_landed", "nodes/completed"})


# -- contains at the heap's edges (no ranks needed) -------------------------------------------------------


class _OneRank:
    rank = 0
    world_size = 1


def test_contains_takes_a_tensor_ending_exactly_at_the_heap_end():
    size = 4096
    memory = torch.zeros(size + 512, dtype=torch.uint8)  # valid memory beyond the heap's end
    heap = SymmetricHeap(HeapMapping(size=size, peers=(memory[:size],)), _OneRank())
    assert heap.contains(memory[:1])  # starts at the base
    assert heap.contains(memory[size - 256 : size])  # ends exactly at the end
    assert heap.contains(memory[: size].view(torch.float32)[-1:])  # its last element
    assert not heap.contains(memory[size - 256 : size + 1])  # one byte past
    assert not heap.contains(memory[size - 4 : size + 4].view(torch.float32))  # one element past
    assert not heap.contains(memory[size : size + 1])  # starts at the end
    strided = memory[size - 257 : size].as_strided((2,), (256,))  # last element is the heap's last byte
    assert heap.contains(strided)
    assert not heap.contains(memory[size - 256 : size + 1].as_strided((2,), (256,)))
