"""Upstream iris's tile collectives (``iris.x``) in its forms, across real ranks, against torch.

Upstream's kernels call ``iris.x.all_gather(tile, dst_view, dim, ctx)`` and
``all_reduce_atomic(tile, dst_view, ctx)`` (pushes, no sync: the host orders the ranks), and
``all_reduce_one_shot / all_reduce_two_shot / reduce_scatter(tile, src_view, dst_view, locks,
ctx)`` after storing their partial tile and setting their own lock; ``all_to_all`` and ``gather``
take the same arguments as iris's own. The library's ``upstream_tile_collective`` kernel calls
them so (:mod:`iris_triton.tiles.kernel`); a kernel written here as upstream's tests write theirs
checks the module's names and an upstream-convention context (``iris.iris``).

One spawn per world size (2 and 3 ranks) runs every check, on a ragged matrix (tiles past its
edges; upstream's own tests keep to multiples of the tile there) with seeded random data per
rank, so that every rank computes the reference: sums in rank order, 16-bit floats in float32,
except the atomic all-reduce, whose additions land in any order.

The failure check: a peer that never sets its lock makes a pulling call give up within the
timeout, write NaN into its tile, and ``ctx.check()`` raise ``IrisTimeoutError``, where upstream's
call spins for ever.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import triton
import triton.language as tl

import iris
import iris.x
from iris.errors import IrisError, IrisTimeoutError
from iris.testing import (RankReport, assert_rank_checks, message_raised, reports_on_available_ranks,
                          seeded_generator)

M, N = 37, 45
BLOCK = (16, 16)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: The collectives of the library's kernel whose checks are exact (every rank sums in rank order).
COLLECTIVES = ("all_gather_rows", "all_gather_columns", "all_reduce_one_shot", "all_reduce_two_shot",
               "reduce_scatter", "all_to_all", "gather", "all_reduce_atomic")
#: A wait in the failure check gives up after this many seconds.
FAILURE_TIMEOUT = 3.0


def _data(dtype: torch.dtype, shape, *seed) -> torch.Tensor:
    return torch.randn(shape, generator=seeded_generator(*seed)).to(dtype)


def _summed(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    return total.to(parts[0].dtype)


def _owned_mask(rank: int, world: int) -> torch.Tensor:
    """The elements of the ``M x N`` matrix in the tiles ``rank`` owns in a reduce-scatter:
    contiguous runs of ``tiles // world`` in row-major order, the last rank the rest too."""
    tiles_m, tiles_n = -(-M // BLOCK[0]), -(-N // BLOCK[1])
    per_rank = tiles_m * tiles_n // world
    mask = torch.zeros(M, N, dtype=torch.bool)
    for tile in range(tiles_m * tiles_n):
        owner = min(tile // per_rank, world - 1) if per_rank else world - 1
        if owner == rank:
            row, column = divmod(tile, tiles_n)
            mask[row * BLOCK[0]:(row + 1) * BLOCK[0], column * BLOCK[1]:(column + 1) * BLOCK[1]] = True
    return mask


def _expected(collective: str, parts: list[torch.Tensor], rank: int, before: torch.Tensor) -> torch.Tensor:
    world = len(parts)
    if collective == "all_gather_rows":
        return torch.cat(parts, 0)
    if collective == "all_gather_columns":
        return torch.cat(parts, 1)
    if collective == "all_to_all":  # column chunk q of the output: rank q's chunk ``rank``
        chunk = parts[0].shape[1] // world
        return torch.cat([part[:, rank * chunk:(rank + 1) * chunk] for part in parts], 1)
    if collective == "gather":
        return parts[(rank + 1) % world]
    if collective == "reduce_scatter":
        return torch.where(_owned_mask(rank, world), _summed(parts), before)
    return _summed(parts)


def _shapes(collective: str, world: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The input's and the output's shape."""
    if collective == "all_gather_rows":
        return (M, N), (world * M, N)
    if collective == "all_gather_columns":
        return (M, N), (M, world * N)
    if collective == "all_to_all":
        return (M, world * N), (M, world * N)
    return (M, N), (M, N)


def _checks(ctx, report: RankReport) -> None:
    from iris_triton.tiles.kernel import launch_upstream_tile_collective

    world, rank = ctx.world_size, ctx.rank
    for collective in COLLECTIVES:
        for dtype in DTYPES:
            shape, out_shape = _shapes(collective, world)
            parts = [_data(dtype, shape, "upstream tiles", collective, str(dtype), r) for r in range(world)]
            src = ctx.as_symmetric(parts[rank])
            dst = ctx.zeros(out_shape, dtype=dtype)
            if collective == "reduce_scatter":
                dst.copy_(_data(dtype, out_shape, "untouched", rank))
            before = dst.cpu().clone()
            ctx.barrier()
            launch_upstream_tile_collective(ctx, collective, src, dst, block=BLOCK)
            ctx.barrier()  # upstream's contract: the host orders the ranks around the kernel
            want = _expected(collective, parts, rank, before)
            got = dst.cpu()
            ok = torch.equal(got, want)
            if not ok and (collective == "all_reduce_atomic" or dtype == torch.bfloat16):
                # additions in any order; the interpreter rounds float32 to bfloat16 otherwise than a GPU
                tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype] * world
                ok = torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance)
            report.check(f"{collective}/{dtype}", ok or f"rank {rank}: largest difference "
                                                         f"{(got.float() - want.float()).abs().max().item()}")


@triton.jit
def _upstream_style_kernel(input_ptr, temp_ptr, output_ptr, locks, M: tl.constexpr, N: tl.constexpr,
                           stride_m: tl.constexpr, stride_n: tl.constexpr, context_tensor, cur_rank: tl.constexpr,
                           world_size: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr):
    """A one-shot all-reduce as upstream's tile kernels are written: the names from ``iris.x``
    and ``iris.DeviceContext``, sizes and strides as compile-time constants."""
    ctx = iris.DeviceContext.initialize(context_tensor, cur_rank, world_size)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    for tile_id in range(tl.program_id(0), tl.cdiv(M, BLOCK_SIZE_M) * num_pid_n, tl.num_programs(0)):
        pid_m = tile_id // num_pid_n
        pid_n = tile_id % num_pid_n
        rm, rn, mask = iris.x.tile_layout(pid_m, pid_n, M, N, BLOCK_SIZE_M, BLOCK_SIZE_N)
        offsets = rm[:, None] * stride_m + rn[None, :] * stride_n
        data = tl.load(input_ptr + offsets, mask=mask, other=0)
        tl.store(temp_ptr + offsets, data, mask=mask)
        tl.atomic_xchg(locks + tile_id, 1, sem="release", scope="sys")
        tile = iris.x.Tile(pid_m, pid_n, BLOCK_SIZE_M, BLOCK_SIZE_N, data)
        src_view = iris.x.make_tensor_view(temp_ptr, M, N, stride_m, stride_n)
        dst_view = iris.x.make_tensor_view(output_ptr, M, N, stride_m, stride_n)
        iris.x.all_reduce_one_shot(tile, src_view, dst_view, locks, ctx)


def _launch_upstream_style(shmem, src, dst, locks) -> None:
    temp = shmem.zeros(M, N, dtype=src.dtype)
    _upstream_style_kernel[(2,)](src, temp, dst, locks, M, N, N, 1, shmem.get_device_context(), shmem.get_rank(),
                                 shmem.get_num_ranks(), BLOCK[0], BLOCK[1])


def _upstream_context_checks(report: RankReport) -> None:
    shmem = iris.iris(1 << 24)  # upstream's conventions
    rank, world = shmem.get_rank(), shmem.get_num_ranks()
    parts = [_data(torch.float32, (M, N), "upstream style", r) for r in range(world)]
    src = shmem.zeros(M, N)
    src.copy_(parts[rank])
    dst = shmem.zeros(M, N)
    locks = shmem.zeros(-(-M // BLOCK[0]) * -(-N // BLOCK[1]), dtype=torch.int32)
    shmem.barrier()
    _launch_upstream_style(shmem, src, dst, locks)
    shmem.barrier()
    report.check("upstream_style/all_reduce_one_shot", torch.equal(dst.cpu(), _summed(parts)))
    shmem.destroy()


def _worker(rank: int, world: int) -> bytes:
    report = RankReport(rank)
    with report.section("library_kernel"):
        ctx = iris.create()
        _checks(ctx, report)
        ctx.destroy()
    with report.section("upstream_style"):
        _upstream_context_checks(report)
    return report.packed()


@pytest.fixture(scope="module", params=(2, 3), ids=lambda w: f"world{w}")
def reports(request):
    """Every rank's checks at each world (on one GPU, its ranks share it)."""
    return reports_on_available_ranks(_worker, request.param, request.param, timeout=180)


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_upstream_tile_collectives_match_torch(reports, collective):
    assert_rank_checks(reports, f"{collective}/", {f"{collective}/{dtype}" for dtype in DTYPES})


def test_an_upstream_style_kernel_runs_on_an_upstream_context(reports):
    assert_rank_checks(reports, "upstream_style/", {"upstream_style/all_reduce_one_shot", "upstream_style/completed"})
    assert_rank_checks(reports, "library_kernel/", {"library_kernel/completed"})


#: Store key rank 0 sets once its wait for the absent rank 1 gave up.
GAVE_UP = "test_upstream_tiles/absent/gave_up"


def _absent_lock_worker(rank: int, world: int) -> bytes:
    """Rank 1 never launches, so its lock is never set: rank 0's one-shot all-reduce must give up."""
    report = RankReport(rank)
    store = torch.distributed.distributed_c10d._get_default_store()
    ctx = iris.create(timeout=FAILURE_TIMEOUT)
    src = ctx.as_symmetric(_data(torch.float32, (M, N), "absent", rank))
    dst = ctx.zeros((M, N))
    locks = ctx.zeros(-(-M // BLOCK[0]) * -(-N // BLOCK[1]), dtype=torch.int32)
    ctx.barrier()
    if rank == 0:
        start = time.monotonic()
        _launch_upstream_style(ctx, src, dst, locks)
        report["raised"] = message_raised(ctx.check, IrisTimeoutError)
        report["seconds"] = time.monotonic() - start
        report["nan"] = bool(torch.isnan(dst).all())
        store.set(GAVE_UP, "1")
    else:
        try:
            store.wait([GAVE_UP], timedelta(seconds=4 * FAILURE_TIMEOUT))
        except Exception:  # noqa: BLE001 - rank 0's report says what it saw
            pass
    try:
        ctx.destroy()
    except IrisError:
        pass
    return report.packed()


def test_a_lock_never_set_makes_the_pulling_call_give_up_with_nan(tmp_path):
    reports = reports_on_available_ranks(_absent_lock_worker, 2, 2, timeout=60)
    waiting = reports[0]
    assert "gave up" in waiting["raised"], waiting["raised"]
    assert waiting["nan"], "the call that gave up left numbers in its tiles"
