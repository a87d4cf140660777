"""Every multi-rank path at worlds 3, 4 and 8 on ranks sharing one GPU (CUDA IPC between processes
on one device): the compiler, the memory model and the protocols of a real GPU at the world sizes
users run, without 8 GPUs.

Each family reuses its own module's worker (the checks against torch references on random
data that run at worlds 2 to 5 on CPU ranks there); one start of the ranks per world size runs
them all in turn, every rank on GPU 0 (:func:`iris.testing.reports_on_available_ranks`). The GPU time-slices the ranks'
kernels, so nothing here is timed, and the sizes are those of each module's GPU checks. Runs only
where exactly one GPU is visible (on more, each module's own tests spawn a GPU per rank); in
``scripts/gpu_check.sh``'s named steps ``shared-gpu-3-4`` and ``shared-gpu-8``.
"""

from __future__ import annotations

import pickle
import zlib

import pytest
import torch

import iris
from iris.testing import RankReport, assert_rank_checks, reports_on_available_ranks, seeded_generator

pytestmark = pytest.mark.skipif(torch.cuda.device_count() != 1, reason="runs ranks sharing exactly one visible GPU")

WORLDS = (3, 4, 8)


def _ccl(rank, world):
    from test_ccl import _ccl_worker

    return _ccl_worker(rank, "triton", "cuda")


def _rooted(rank, world):
    from test_ccl_rooted import _worker

    return _worker(rank, world)


def _fused(rank, world):
    from test_fused import _fused_worker

    return _fused_worker(rank, "cuda")


def _fused_rounding(rank, world):
    from test_fused import _world5_worker  # any world size: each operation and method, rounded once

    return _world5_worker(rank, "cuda")


def _rmsnorm(rank, world):
    from test_all_reduce_rmsnorm import _worker

    return _worker(rank, world)


def _moe(rank, world):
    from test_moe import _gpu_worker

    return _gpu_worker(rank, world)


def _tiles(rank, world):
    from test_tile_collectives import _worker

    return _worker(rank, world, "triton")


def _gluon_tiles(rank, world):
    from test_tile_collectives import _worker

    return _worker(rank, world, "gluon")


def _uneven(rank, world):
    from test_all_to_all_v import _worker

    return _worker(rank, "triton", "cuda")


def _p2p(rank, world):
    from test_p2p import _p2p_worker

    return _p2p_worker(rank, "cuda")


def _hierarchical(rank, world):
    from test_hierarchical import _worker

    return _worker(rank, False)


def _subgroups(rank, world):
    """All_reduce and a fused product inside sub-groups of 2 and of 4 (4 x 2 and 2 x 4 at world 8),
    against torch on every rank's data."""
    report = RankReport(rank)
    ctx = iris.create("triton", heap_size="512MiB")
    for size in (2, 4):
        if world % size:
            continue
        with report.section(f"groups_of_{size}"):
            group, _ = ctx.new_subgroups(size)
            members = range(rank // size * size, rank // size * size + size)
            data = [torch.randn(4099, generator=seeded_generator("groups", size, r)) for r in range(world)]
            mine = data[rank].to(ctx.device, copy=True)  # reduced in place; data keeps the inputs
            ctx.ccl.all_reduce(mine, group=group)
            expected = sum(data[r] for r in members)
            report.check(f"groups/{size}/all_reduce", torch.allclose(mine.cpu(), expected, rtol=1e-5, atol=1e-5))
            m, k, n = 64, 128, 96
            a = [torch.randn(m, k, generator=seeded_generator("mm", size, r)).to(torch.bfloat16) for r in range(world)]
            b = torch.randn(k, n, generator=seeded_generator("mm-b", size)).to(torch.bfloat16)
            out = torch.empty(size * m, n, dtype=torch.bfloat16, device=ctx.device)
            ctx.ops.all_gather_matmul(out, a[rank].to(ctx.device), b.to(ctx.device), group=group)
            expected = torch.cat([a[r] for r in members]).float() @ b.float()
            report.check(f"groups/{size}/all_gather_matmul",
                         torch.allclose(out.cpu().float(), expected, rtol=2e-2, atol=2e-2))
    ctx.barrier()
    report.check("groups/no_wait_gave_up", not ctx.failed)
    ctx.destroy()
    return report.packed()


#: Family: (worker, the worlds it runs at). Each worker makes its own context and destroys it.
FAMILIES = {
    "collectives": (_ccl, WORLDS),
    "rooted": (_rooted, WORLDS),
    "fused": (_fused, WORLDS),
    "fused_rounding": (_fused_rounding, WORLDS),
    "all_reduce_rmsnorm": (_rmsnorm, WORLDS),
    "moe": (_moe, WORLDS),
    "tile_collectives": (_tiles, WORLDS),
    "tile_collectives_gluon": (_gluon_tiles, WORLDS),
    "uneven_all_to_all": (_uneven, WORLDS),
    "send_recv": (_p2p, WORLDS),
    "subgroups": (_subgroups, (4, 8)),
    "hierarchical": (_hierarchical, (4, 8)),
}


def _every_family(rank: int, world: int) -> bytes:
    """Each family's worker in turn on this rank (one start of the ranks for all of them: eight
    processes sharing a GPU take tens of seconds to start), its checks prefixed with its name."""
    report = RankReport(rank)
    for family, (worker, worlds) in FAMILIES.items():
        if world not in worlds:
            continue
        with report.section(family):
            found = pickle.loads(zlib.decompress(worker(rank, world)))
            report.update({f"{family}/{name}": value for name, value in found.items()})
    return report.packed()


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world{w}")
def test_every_path_matches_torch_on_ranks_sharing_one_gpu(world):
    reports = reports_on_available_ranks(_every_family, world, world, timeout=150)
    problems = []
    for family, (_, worlds) in FAMILIES.items():
        if world in worlds:
            try:
                assert_rank_checks(reports, f"{family}/", minimum=world)
            except AssertionError as error:
                problems.append(f"{family}: {str(error)[:1500]}")
    assert not problems, "\n".join(problems)
