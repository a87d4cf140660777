"""``ctx.as_symmetric(t, in_place=True)``: a tensor's own memory mapped into every rank's heap.

On CPU ranks (``shm`` heaps) at worlds 1, 2 and 3, and on GPU ranks (``cuda-vmm`` heaps, memory
of torch's expandable segments) where a GPU is present: the result shares writes with the
original both ways, every peer reads and writes it as a heap tensor (host views and a collective's
kernels), ``ctx.free`` maps the heap's own memory back, and where a rank's memory cannot be mapped
every rank copies instead, with a warning naming the reason. Random data against torch.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import iris
from iris.testing import (RankReport, assert_rank_checks, interpreted_device, reports_on_available_ranks,
                          seeded_generator, spawn_reports)

ROWS = 1000
#: Where the tensor starts inside its memory: not at the start of a page or of an allocation.
LEAD = 1000


def _values(rank: int, n: int = ROWS) -> torch.Tensor:
    return torch.randn(n, generator=seeded_generator("as_symmetric", rank))


def _as_written(rank: int) -> torch.Tensor:
    """Rank ``rank``'s tensor after it wrote through the result and through the original."""
    expected = _values(rank).clone()
    expected[:10] = rank
    expected[10:20] = -rank
    return expected


def _mapped(rank: int, provider: str) -> bytes:
    report = RankReport(rank)
    ctx = iris.create(heap_size="64MiB", heap_provider=provider)
    device, world = ctx.device, ctx.world_size
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with report.section("mapped"):
        whole = torch.zeros(LEAD + ROWS + 7, device=device)
        original = whole[LEAD:LEAD + ROWS]
        original.copy_(_values(rank))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x = ctx.as_symmetric(original, in_place=True)
        report.check("mapped/no_copy", not caught or f"warned: {caught[0].message}")
        report.check("mapped/on_heap", ctx.is_symmetric(x) and not ctx.is_symmetric(original))
        report.check("mapped/values", torch.equal(x.cpu(), _values(rank)))
        x[:10] = rank
        original[10:20] = -rank
        sync()
        report.check("mapped/shared_both_ways", torch.equal(original.cpu(), _as_written(rank))
                     and torch.equal(x.cpu(), _as_written(rank)))
        ctx.barrier()
        for peer in range(world):
            seen = ctx.heap.peer_view(x, peer).cpu()
            report.check(f"mapped/read_by_host/{peer}", torch.equal(seen, _as_written(peer)))
        gathered = ctx.zeros(world * ROWS)
        ctx.ccl.all_gather(gathered, x)
        expected = torch.cat([_as_written(r) for r in range(world)])
        report.check("mapped/read_by_kernels", torch.equal(gathered.cpu(), expected))
        ctx.barrier()
        ctx.heap.peer_view(x, (rank + 1) % world)[20:30] = 1000 + rank
        sync()
        ctx.barrier()
        writer = (rank - 1) % world
        written = torch.full((10,), 1000.0 + writer)
        report.check("mapped/peer_write_lands_in_original", torch.equal(original[20:30].cpu(), written))
        report.check("mapped/neighbours_untouched", not whole[:LEAD].any() and not whole[LEAD + ROWS:].any())
    with report.section("freed"):
        kept = original.clone()
        offset, nbytes = ctx.heap.offset_of(x), x.numel() * x.element_size()
        ctx.free(x)
        # The heap's own memory is back where the tensor was mapped, in every rank's view of it.
        ctx.heap.view(offset, nbytes).fill_(rank + 1)
        sync()
        ctx.barrier()
        report.check("freed/original_unchanged", torch.equal(original, kept))
        seen = [ctx.heap.view(offset, nbytes, rank=peer).cpu() for peer in range(world)]
        filled = [torch.full((nbytes,), peer + 1, dtype=torch.uint8) for peer in range(world)]
        report.check("freed/heap_memory_again", all(map(torch.equal, seen, filled)))
    if world > 1:
        _refused(report, ctx, rank, device, sync)
    ctx.barrier()
    ctx.destroy()
    return report.packed()


def _refused(report: RankReport, ctx, rank: int, device: torch.device, sync) -> None:
    world = ctx.world_size
    with report.section("refused"):
        # Each rank's tensor starts at a different place in its memory: no common heap offset.
        skewed = torch.zeros(LEAD + ROWS + world, device=device)[LEAD + rank:LEAD + rank + ROWS]
        skewed.copy_(_values(rank))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            copy = ctx.as_symmetric(skewed, in_place=True)
        messages = [str(w.message) for w in caught]
        report.check("refused/warned_why", len(messages) == 1 and "copies the tensor" in messages[0]
                     and "different offsets" in messages[0] or f"warnings: {messages}")
        copy[:5] = -1.0
        sync()
        report.check("refused/a_copy", ctx.is_symmetric(copy) and torch.equal(skewed.cpu(), _values(rank)))
        moved = device.type == "cpu" and skewed.untyped_storage().is_shared()
        report.check("refused/storage_left_where_it_was", not moved)


CHECKS = ({"mapped/no_copy", "mapped/on_heap", "mapped/values", "mapped/shared_both_ways", "mapped/read_by_kernels",
           "mapped/peer_write_lands_in_original", "mapped/neighbours_untouched", "mapped/completed"},
          {"freed/original_unchanged", "freed/heap_memory_again", "freed/completed"},
          {"refused/warned_why", "refused/a_copy", "refused/storage_left_where_it_was", "refused/completed"})


def _expected(world: int, section: int):
    names = set(CHECKS[section])
    if section == 0:
        names |= {f"mapped/read_by_host/{peer}" for peer in range(world)}
    return names


@pytest.mark.parametrize("world", [1, 2, 3])
def test_cpu_ranks_map_a_tensor_in_place(world):
    reports = spawn_reports(_mapped, world, "shm", device=interpreted_device())
    for section, prefix in enumerate(("mapped/", "freed/", "refused/")):
        if world == 1 and prefix == "refused/":
            continue  # one rank has one offset: nothing to refuse
        assert_rank_checks(reports, prefix, _expected(world, section))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("world", [1, 2, 3])
def test_gpu_ranks_map_expandable_segments_in_place(world, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the ranks' own allocator
    reports = reports_on_available_ranks(_mapped, world, "cuda-vmm")
    for section, prefix in enumerate(("mapped/", "freed/", "refused/")):
        if world == 1 and prefix == "refused/":
            continue
        assert_rank_checks(reports, prefix, _expected(world, section))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this process's CUDA memory is torch's default, which cannot be "
                    "mapped; GPU ranks set up for it are checked above")
def test_an_upstream_context_maps_in_place_and_copies_with_the_reason_where_it_cannot():
    shmem = iris.iris(1 << 22)
    try:
        assert shmem.gpu_id == shmem.get_device().index
        plain = torch.arange(6.0, device=shmem.get_device())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mapped = shmem.as_symmetric(plain)
        mapped.fill_(7.0)
        assert shmem.is_symmetric(mapped) and torch.equal(plain.cpu(), torch.full((6,), 7.0)), "one memory"
        shared = torch.arange(4.0).share_memory_()
        where = shared.data_ptr()
        shmem.as_symmetric(shared).fill_(-1.0)
        assert shared.data_ptr() == where and torch.equal(shared, torch.full((4,), -1.0)), "mapped where it was"
        weights = torch.ones(3, device=shmem.get_device(), requires_grad=True)
        assert shmem.as_symmetric(weights).requires_grad, "as the copy does"
        empty = torch.empty(0, device=shmem.get_device())
        reason = r"copies the tensor .* instead of mapping its memory there.*\(rank 0: it has no elements\)"
        with pytest.warns(UserWarning, match=reason):
            shmem.as_symmetric(empty)
        on_heap = shmem.zeros(4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert shmem.as_symmetric(on_heap) is on_heap
        elsewhere = torch.empty(3, device="meta")
        with pytest.raises(RuntimeError, match=r"heap's device .* got one on meta; move it there first"):
            shmem.as_symmetric(elsewhere)
    finally:
        shmem.destroy()


def test_a_native_context_copies_unless_asked_to_map(ctx):
    plain = torch.arange(6.0, device=ctx.device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy = ctx.as_symmetric(plain)
    copy.fill_(7.0)
    assert torch.equal(plain.cpu(), torch.arange(6.0)), "the default is a copy of its own"
