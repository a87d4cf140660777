"""Every multi-rank path at worlds 3, 4 and 8 on ranks sharing one GPU (CUDA IPC between processes
on one device): the compiler, the memory model and the protocols of a real GPU at the world sizes
users run, without 8 GPUs.

Each family reuses its own module's worker (the checks against torch references on random
data that run at worlds 2 to 5 on CPU ranks there); one start of the ranks per world size runs
them all in turn, every rank on GPU 0 (:func:`iris.testing.reports_on_available_ranks`). The GPU time-slices the ranks'
kernels, so nothing here is timed, and the sizes are those of each module's GPU checks. Runs only
where exactly one GPU is visible (on more, each module's own tests spawn a GPU per rank); in
``scripts/gpu_check.sh``'s named steps ``shared-gpu-3-4`` and ``shared-gpu-8`` (``$IRIS_SHARED_FAMILIES``
picks some of the families).
"""

from __future__ import annotations

import os
import pickle
import time
import zlib

import pytest
import torch

import iris
from iris.testing import RankReport, assert_rank_checks, reports_on_available_ranks, seeded_generator
from test_ccl import _data

pytestmark = pytest.mark.skipif(torch.cuda.device_count() != 1, reason="runs ranks sharing exactly one visible GPU")

WORLDS = (3, 4, 8)


#: Elements per rank of the collectives' calls: not a multiple of any world size checked, more than
#: one block of every launch shape's programs, small enough for time-sliced ranks.
ELEMENTS = 4099
#: The collectives :func:`_collectives` checks, their dtypes, and those whose result only the root has.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather", "scatter")
CCL_DTYPES = (torch.bfloat16, torch.float32)
ROOT_ONLY = ("reduce", "gather")
#: Sizes of the sub-groups checked, where they divide the world.
SUBGROUP_SIZES = (2, 4)


def _collectives(rank: int, world: int) -> bytes:
    """Every collective by the automatic choice and by each algorithm that applies, bf16 and
    float32, against torch on every rank's data (roots: the last rank)."""
    report = RankReport(rank)
    ctx = iris.create("triton", heap_size="512MiB")
    root = world - 1
    for dtype in CCL_DTYPES:
        tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        n = ELEMENTS * world  # the whole input of the collectives that split it into ranks' segments
        inputs = [_data(dtype, n, "ccl", str(dtype), r) for r in range(world)]
        total = sum(x.float() for x in inputs)
        segment = n // world
        mine = inputs[rank]
        expected = {
            "all_reduce": total,
            "all_gather": torch.cat([x[:segment].float() for x in inputs]),
            "reduce_scatter": total[rank * segment:(rank + 1) * segment],
            "all_to_all": torch.cat([x[rank * segment:(rank + 1) * segment].float() for x in inputs]),
            "broadcast": inputs[root].float(),
            "reduce": total,
            "gather": torch.cat([x[:segment].float() for x in inputs]),
            "scatter": inputs[root][rank * segment:(rank + 1) * segment].float(),
        }
        for collective, reference in expected.items():
            probe = mine if collective not in ("all_gather", "gather") else mine[:segment]
            names = [None] + ctx.ccl.algorithms(collective, applying_to=probe.to(ctx.device),
                                                op="sum" if collective in ("all_reduce", "reduce_scatter",
                                                                           "reduce") else None)
            for algorithm in names:
                key = f"ccl/{collective}/{algorithm}/{str(dtype).removeprefix('torch.')}"
                with report.section(key):
                    result = _call(ctx, collective, mine, segment, root, algorithm)
                    if result is not None:
                        report.check(key, torch.allclose(result.float().cpu(), reference, **tolerance))
    with report.section("uneven"):
        rows = [[1 + (r + q) % 3 for q in range(world)] for r in range(world)]  # rows[r][q]: r sends q
        sources = [_data(torch.float32, sum(rows[r]) * 8, "uneven", r).view(-1, 8) for r in range(world)]
        sends, receives = rows[rank], [rows[q][rank] for q in range(world)]
        out = torch.zeros(sum(receives), 8, device=ctx.device)  # sizes differ between ranks: off the heap
        ctx.ccl.all_to_all_single(out, sources[rank].to(ctx.device), receives, sends)
        expected = torch.cat([sources[q][sum(rows[q][:rank]):sum(rows[q][:rank + 1])] for q in range(world)])
        report.check("ccl/uneven/all_to_all_single", torch.equal(out.cpu(), expected))
    with report.section("send_recv"):
        data = [_data(torch.bfloat16, 70001, "p2p", r) for r in range(world)]
        received = ctx.zeros(70001, dtype=torch.bfloat16)
        if rank % 2 == 0:  # even ranks send first, so a ring of any size makes progress
            ctx.ccl.send(ctx.as_symmetric(data[rank]), (rank + 1) % world)
            ctx.ccl.recv(received, (rank - 1) % world)
        else:
            ctx.ccl.recv(received, (rank - 1) % world)
            ctx.ccl.send(ctx.as_symmetric(data[rank]), (rank + 1) % world)
        report.check("ccl/send_recv/ring", torch.equal(received.cpu(), data[(rank - 1) % world]))
    ctx.barrier()
    report.check("ccl/no_wait_gave_up", not ctx.failed)
    ctx.destroy()
    return report.packed()


def _call(ctx, collective: str, mine: torch.Tensor, segment: int, root: int, algorithm):
    """``collective`` of this rank's ``mine`` (its first ``segment`` for the gathering ones); its
    result on this rank (None where it has none: the ranks but the root of :data:`ROOT_ONLY`)."""
    world, rank, ccl = ctx.world_size, ctx.rank, ctx.ccl
    x = ctx.as_symmetric(mine)
    if collective == "all_reduce":
        return ccl.all_reduce(x, algorithm=algorithm)
    if collective == "all_gather":
        out = ctx.zeros(world * segment, dtype=x.dtype)
        return ccl.all_gather(out, x[:segment], algorithm=algorithm)
    if collective == "reduce_scatter":
        return ccl.reduce_scatter(ctx.zeros(segment, dtype=x.dtype), x, algorithm=algorithm)
    if collective == "all_to_all":
        return ccl.all_to_all(ctx.zeros(world * segment, dtype=x.dtype), x, algorithm=algorithm)
    if collective == "broadcast":
        return ccl.broadcast(x, src=root, algorithm=algorithm)
    if collective == "reduce":
        ccl.reduce(x, dst=root, algorithm=algorithm)
        return x if rank == root else None
    if collective == "gather":
        out = ctx.zeros(world * segment, dtype=x.dtype)  # on every rank: allocations are collective
        ccl.gather(out if rank == root else None, x[:segment], dst=root, algorithm=algorithm)
        return out if rank == root else None
    out = ctx.zeros(segment, dtype=x.dtype)
    return ccl.scatter(out, x if rank == root else None, src=root, algorithm=algorithm)


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


def _hierarchical(rank, world):
    from test_hierarchical import _worker

    return _worker(rank, False)


def _subgroups(rank, world):
    """All_reduce and a fused product inside sub-groups of 2 and of 4 (4 x 2 and 2 x 4 at world 8),
    against torch on every rank's data."""
    report = RankReport(rank)
    ctx = iris.create("triton", heap_size="512MiB")
    for size in SUBGROUP_SIZES:
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


def _applying(collective: str, numel: int, dtype: torch.dtype, world: int) -> list[str]:
    """The algorithms of ``collective`` that take a call of ``numel`` elements of ``dtype`` on
    ``world`` GPU ranks of the Triton backend, as ``ctx.ccl.algorithms(..., applying_to=...)`` lists them."""
    from iris.collectives import REDUCING, CallShape, algorithm_registry

    shape = CallShape(collective=collective, nbytes=numel * dtype.itemsize, world_size=world, dtype=dtype,
                      device_type="cuda", language="triton", op="sum" if collective in REDUCING else None)
    registry = algorithm_registry(collective)
    return [name for name in registry.names() if registry.get(name).refusal(shape) is None]


def _collectives_names(rank: int, world: int) -> set[str]:
    """The checks of :func:`_collectives` on ``rank``: each call's section, and its result where
    this rank has one (the root, world - 1, of :data:`ROOT_ONLY`)."""
    names = {"ccl/uneven/all_to_all_single", "uneven/completed", "ccl/send_recv/ring", "send_recv/completed",
             "ccl/no_wait_gave_up"}
    for dtype in CCL_DTYPES:
        for collective in COLLECTIVES:
            probe = ELEMENTS if collective in ("all_gather", "gather") else ELEMENTS * world
            for algorithm in [None, *_applying(collective, probe, dtype, world)]:
                key = f"ccl/{collective}/{algorithm}/{str(dtype).removeprefix('torch.')}"
                names |= {f"{key}/completed"} | ({key} if collective not in ROOT_ONLY or rank == world - 1 else set())
    return names


def _fused_rounding_names(rank: int, world: int) -> set[str]:
    from test_fused import _layouts_names, _split_names, _world5_names

    return _world5_names() | _layouts_names() | _split_names()


def _rmsnorm_names(rank: int, world: int) -> set[str]:
    from test_all_reduce_rmsnorm import GROUP_METHODS, _call_names

    names = _call_names(world) | {"no_wait_failed/after_the_calls", "mismatch/raised", "mismatch/out_nan",
                                  "mismatch/completed"}
    if world == 3:  # ranks 0 and 2 make the group's calls
        names |= {"group/completed"} | ({f"group/{method}" for method in GROUP_METHODS} if rank != 1 else set())
    return names


def _moe_names(rank: int, world: int) -> set[str]:
    from test_moe import CASES, _dispatch_names

    cases = [name for name, *_ in CASES if name != "tight_capacity"]  # as _gpu_worker skips it
    return _dispatch_names(cases) | {f"combine/{name}" for name in cases}


def _tiles_names(rank: int, world: int) -> set[str]:
    from test_tile_collectives import _family_names

    return set().union(*_family_names(world).values()) | {f"{section}/completed" for section in (
        "all_reduces", "others", "errors")}


def _gluon_tiles_names(rank: int, world: int) -> set[str]:
    from test_tile_collectives import KERNEL_FAMILIES, _family_names

    names = _family_names(world)
    return set().union(*(names[family] for family in (*KERNEL_FAMILIES, "graph"))) | {
        "all_reduces/completed", "others/completed"}


def _subgroups_names(rank: int, world: int) -> set[str]:
    sizes = [size for size in SUBGROUP_SIZES if world % size == 0]
    return {f"groups/{size}/{check}" for size in sizes for check in ("all_reduce", "all_gather_matmul")} | {
        f"groups_of_{size}/completed" for size in sizes} | {"groups/no_wait_gave_up"}


def _hierarchical_names(rank: int, world: int) -> set[str]:
    from test_hierarchical import _names

    return _names(world, extras=False) | {"two_per_node/completed", "after/completed"}


#: Family: (worker, the worlds it runs at, the names of its worker's report on a rank of a world).
#: Each worker makes its own context and destroys it; the sizes are small (the GPU time-slices
#: the ranks, and each rank compiles its own kernels).
FAMILIES = {
    "collectives": (_collectives, WORLDS, _collectives_names),
    "fused_rounding": (_fused_rounding, WORLDS, _fused_rounding_names),
    "all_reduce_rmsnorm": (_rmsnorm, WORLDS, _rmsnorm_names),
    "moe": (_moe, WORLDS, _moe_names),
    "tile_collectives": (_tiles, WORLDS, _tiles_names),
    "tile_collectives_gluon": (_gluon_tiles, WORLDS, _gluon_tiles_names),
    "subgroups": (_subgroups, (4, 8), _subgroups_names),
    "hierarchical": (_hierarchical, (4, 8), _hierarchical_names),
}


def _families() -> dict:
    """:data:`FAMILIES`, or those named in ``$IRIS_SHARED_FAMILIES`` (comma-separated): a re-run of
    what a change touched, within one call of the GPU machine."""
    named = os.environ.get("IRIS_SHARED_FAMILIES")
    if not named:
        return FAMILIES
    unknown = set(named.split(",")) - set(FAMILIES)
    if unknown:
        raise ValueError(f"IRIS_SHARED_FAMILIES names {sorted(unknown)}; the families are {sorted(FAMILIES)}")
    return {family: FAMILIES[family] for family in named.split(",")}


def _progress(world: int, rank: int, line: str) -> None:
    """A line of how far the ranks got, in ``$IRIS_PROGRESS`` (rank 0's): what a run cut off by
    its time limit still tells."""
    path = os.environ.get("IRIS_PROGRESS")
    if path and rank == 0:
        with open(path, "a") as file:
            file.write(f"world {world}: {line} at {time.strftime('%H:%M:%S')}\n")


def _every_family(rank: int, world: int) -> bytes:
    """Each family's worker in turn on this rank (one start of the ranks for all of them: eight
    processes sharing a GPU take tens of seconds to start), its checks prefixed with its name."""
    report = RankReport(rank)
    for family, (worker, worlds, _) in _families().items():
        if world not in worlds:
            continue
        _progress(world, rank, f"{family} starts")
        with report.section(family):
            found = pickle.loads(zlib.decompress(worker(rank, world)))
            report.update({f"{family}/{name}": value for name, value in found.items()})
        failed = sum(1 for k, v in report.items() if k.startswith(f"{family}/") and v is not True)
        _progress(world, rank, f"{family} done, {failed} failed on rank 0")
    return report.packed()


def _prefixed(prefix: str, names, world: int):
    """A family's names on each rank (``names(rank, world)``) under its prefix, with its section's completion."""
    return lambda rank: {prefix + name for name in names(rank, world)} | {f"{prefix}completed"}


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world{w}")
def test_every_path_matches_torch_on_ranks_sharing_one_gpu(world):
    reports = reports_on_available_ranks(_every_family, world, world, timeout=120)
    problems = []
    for family, (_, worlds, names) in _families().items():
        if world in worlds:
            prefix = f"{family}/"
            mine = [{k: v for k, v in rep.items() if k.startswith(prefix)} for rep in reports]
            try:
                assert_rank_checks(mine, prefix, _prefixed(prefix, names, world))
            except AssertionError as error:
                problems.append(f"{family}: {str(error)[:1500]}")
    assert not problems, "\n".join(problems)
