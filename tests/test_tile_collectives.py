"""Tile collectives inside a kernel (``iris_triton.tiles``) across real ranks, against torch.

One spawn per world size (2 and 3 ranks; 3 with float32 only) runs every check, each rank returning ``{check: True |
False | error text}``: every collective of ``tests/tile_kernels.py`` over a ragged matrix (tiles
past its edges), with float32, bfloat16 and int32 elements, each reduction of all_reduce (float32), in
place where the collective allows it, three launches in a row on one sync (its call counts),
and the upstream-style calls without a sync between host barriers. Data is seeded per rank so
that every rank computes the reference (reductions in rank order, 16-bit floats in float32).

On GPUs also: a launch captured in a CUDA graph and replayed on new data, and the same checks of
kernels compiled by Gluon.

The failure checks: ranks that call different collectives on one tile see a mismatch, a tile
number outside the sync fails the call, and a peer that never launches makes the survivor give
up: each time the output holds NaN and ``ctx.check()`` raises ``IrisTimeoutError``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import iris
from iris.errors import IrisError, IrisTimeoutError
from iris.testing import (RankReport, assert_rank_checks, message_raised, reports_on_available_ranks,
                          seeded_generator)
from iris_triton.backend import interpreter_runs_kernel_loops
from iris_triton.device.frontend import TRITON

M, N = 37, 45
BLOCK_M, BLOCK_N = 16, 16
TILES = -(-M // BLOCK_M) * -(-N // BLOCK_N)
DTYPES = (torch.float32, torch.bfloat16, torch.int32)
#: The reductions checked (float32 only; the other types sum).
OPS = ("sum", "max", "prod", "avg", "min")
#: A wait in the failure checks gives up after this many seconds.
FAILURE_TIMEOUT = 3.0
#: Sizes ``ctx.tile_sync`` must refuse.
BAD_SYNC_SIZES = (0, -3, 2.0, True)
#: Replays of the captured all_reduce launch (GPUs).
GRAPH_REPLAYS = 3


def _data(dtype: torch.dtype, shape, *seed) -> torch.Tensor:
    g = seeded_generator(*seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-50, 50, shape, generator=g, dtype=dtype)


def _reduced(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    wide = [p.float() if p.dtype in (torch.bfloat16, torch.float16) else p for p in parts]
    acc = wide[0]
    for p in wide[1:]:
        acc = {"sum": torch.add, "avg": torch.add, "prod": torch.mul, "max": torch.maximum,
               "min": torch.minimum}[op](acc, p)
    if op == "avg":
        acc = acc / len(parts)
    return acc.to(parts[0].dtype)


def _case_lists(world: int, shared_gpu: bool) -> tuple[tuple[torch.dtype, ...], tuple[str, ...]]:
    """The dtypes and the float32 reductions checked on ``world`` ranks: every element type on 2
    ranks and float32 on more (the protocol is the same, the time is not); ranks time-slicing
    one GPU (``shared_gpu``) make every handshake wait for the other rank's time slice, so
    there fewer calls."""
    dtypes = DTYPES if world == 2 and not shared_gpu else DTYPES[:1]
    return dtypes, OPS[:2] if shared_gpu else OPS


class _Checks:
    def __init__(self, ctx, report: RankReport):
        from tile_kernels import tile_collective

        self.ctx, self.report = ctx, report
        #: Ranks time-slicing one GPU make every handshake wait for the other rank's time slice:
        #: few calls there, each tile in a program of its own.
        self.shared_gpu = ctx.device.type == "cuda" and torch.cuda.device_count() < ctx.world_size
        self.dtypes, self.ops = _case_lists(ctx.world_size, self.shared_gpu)
        self.kernel = ctx.frontend.kernel(tile_collective)
        self.sync = ctx.tile_sync(TILES * 3)

    def start(self, collective, src, dst, op="sum", chunk=1, root=0):
        """Launch the kernel (asynchronously on GPUs)."""
        ctx = self.ctx
        programs = TILES if self.shared_gpu else 2
        self.kernel[(programs,)](
            ctx.get_device_context(), src, dst, self.sync, src.shape[0], src.shape[1],
            dst.shape[0], dst.shape[1], src.stride(0), src.stride(1), dst.stride(0), dst.stride(1), chunk, root,
            CTX=ctx.frontend.device_context, RANK=ctx.rank, WORLD=ctx.world_size, COLLECTIVE=collective,
            TRACING=False, OP=op, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)

    def launch(self, *args, **kwargs):
        """Launch the kernel and wait for it, raising a failure it recorded."""
        self.start(*args, **kwargs)
        self.ctx.check()

    def inputs(self, dtype, shape, *seed):
        """Every rank's seeded input (``seed`` names the call), and this rank's copy on the heap."""
        parts = [_data(dtype, shape, "tile", r, str(dtype), shape, *seed) for r in range(self.ctx.world_size)]
        return parts, self.ctx.as_symmetric(parts[self.ctx.rank])

    def expect(self, name, got, want):
        exact = torch.equal(got.cpu(), want)
        if not exact and got.dtype.is_floating_point:
            exact = torch.allclose(got.cpu().float(), want.float(), rtol=1e-2 if got.dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-2 if got.dtype == torch.bfloat16 else 1e-5)
        self.report.check(name, exact)

    def all_reduces(self):
        ctx = self.ctx
        for dtype in self.dtypes:
            for op in self.ops if dtype == torch.float32 else OPS[:1]:
                for collective in ("all_reduce", "all_reduce_two_shot"):
                    for call in range(2 if op == "sum" else 1):  # a second call on the same tiles
                        parts, src = self.inputs(dtype, (M, N), collective, op, call)
                        dst = ctx.full((M, N), 7, dtype=dtype)
                        self.launch(collective, src, dst, op)
                        self.expect(f"{collective}/{dtype}/{op}/{call}", dst, _reduced(parts, op))
                in_place_parts, buf = self.inputs(dtype, (M, N), "in place")
                self.launch("all_reduce", buf, buf)
                self.expect(f"all_reduce/{dtype}/in_place", buf, _reduced(in_place_parts, "sum"))
                parts, buf = self.inputs(dtype, (M, N), "two-shot in place")
                self.launch("all_reduce_two_shot", buf, buf)
                self.expect(f"all_reduce_two_shot/{dtype}/in_place", buf, _reduced(parts, "sum"))

    def others(self):
        ctx, W, rank = self.ctx, self.ctx.world_size, self.ctx.rank
        tiles_n = -(-N // BLOCK_N)
        for dtype in self.dtypes:
            parts, src = self.inputs(dtype, (M, N), "reduce_scatter")
            before = _data(dtype, (M, N), "before", rank)
            dst = ctx.as_symmetric(before)
            self.launch("reduce_scatter", src, dst)
            want = before.clone()
            total = -(-M // BLOCK_M) * tiles_n
            for t in range(total):
                owner = min(t // (total // W), W - 1) if total // W else W - 1
                if owner == rank:
                    r, c = divmod(t, tiles_n)
                    rows, cols = slice(r * BLOCK_M, (r + 1) * BLOCK_M), slice(c * BLOCK_N, (c + 1) * BLOCK_N)
                    want[rows, cols] = _reduced([p[rows, cols] for p in parts], "sum")
            self.expect(f"reduce_scatter/{dtype}", dst, want)

            parts, src = self.inputs(dtype, (M, N), "all_gather")
            rows_out = ctx.zeros((W * M, N), dtype=dtype)
            self.launch("all_gather_rows", src, rows_out)
            self.expect(f"all_gather_rows/{dtype}", rows_out, torch.cat(parts, 0))
            columns_out = ctx.zeros((M, W * N), dtype=dtype)
            self.launch("all_gather_columns", src, columns_out)
            self.expect(f"all_gather_columns/{dtype}", columns_out, torch.cat(parts, 1))

            chunk = 11  # not a multiple of the tile: a tile spans several ranks' chunks
            parts, src = self.inputs(dtype, (M, W * chunk), "all_to_all")
            dst = ctx.zeros((M, W * chunk), dtype=dtype)
            self.launch("all_to_all", src, dst, chunk=chunk)
            want = torch.cat([p[:, rank * chunk:(rank + 1) * chunk] for p in parts], 1)
            self.expect(f"all_to_all/{dtype}", dst, want)

            for root in range(W):
                parts, src = self.inputs(dtype, (M, N), "broadcast", root)
                dst = ctx.zeros((M, N), dtype=dtype)
                self.launch("broadcast", src, dst, root=root)
                self.expect(f"broadcast/{dtype}/root{root}", dst, parts[root])
                dst = ctx.zeros((M, N), dtype=dtype)
                self.launch("gather", src, dst, root=root)
                self.expect(f"gather/{dtype}/root{root}", dst, parts[root])

    def without_sync(self):
        """Upstream iris's form: no sync, the host orders the ranks with barriers."""
        from tile_kernels import unsynchronised_all_gather

        ctx = self.ctx
        parts, src = self.inputs(torch.float32, (M, N), "unsynchronised")
        dst = ctx.zeros((ctx.world_size * M, N))
        ctx.barrier()
        TRITON.kernel(unsynchronised_all_gather)[(2,)](src, dst, ctx.get_heap_bases(), M, N, N, 1, N, 1,
                                                       RANK=ctx.rank, WORLD=ctx.world_size, BLOCK_M=BLOCK_M,
                                                       BLOCK_N=BLOCK_N)
        ctx.barrier()
        self.expect("without_sync/all_gather", dst, torch.cat(parts, 0))

    def graph(self):
        """GPUs: one all_reduce launch captured in a CUDA graph and replayed on new data: the call
        counts kept on the device tell the replays apart."""
        ctx = self.ctx
        src, dst = ctx.zeros((M, N)), ctx.zeros((M, N))
        self.launch("all_reduce", src, dst)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.start("all_reduce", src, dst)
        for replay in range(GRAPH_REPLAYS):
            parts = [_data(torch.float32, (M, N), "graph", r, replay) for r in range(ctx.world_size)]
            src.copy_(parts[ctx.rank])  # the last replay returned once every peer had read this rank's tiles
            graph.replay()
            ctx.check()
            self.expect(f"graph/all_reduce/replay{replay}", dst, _reduced(parts, "sum"))

    def errors(self):
        for bad in BAD_SYNC_SIZES:
            try:
                self.ctx.tile_sync(bad)
                self.report.check(f"tile_sync/refuses {bad!r}", False)
            except ValueError as error:
                self.report.check(f"tile_sync/refuses {bad!r}", "positive int" in str(error))


def _worker(rank: int, world: int, backend: str = "triton") -> bytes:
    report = RankReport(rank)
    ctx = iris.create(backend)
    checks = _Checks(ctx, report)
    sections = ("all_reduces", "others", "without_sync", "errors") if backend == "triton" else ("all_reduces", "others")
    if ctx.device.type == "cuda":
        sections += ("graph",)
    for name in sections:
        with report.section(name):
            getattr(checks, name)()
    ctx.destroy()
    return report.packed()


@pytest.fixture(scope="module", params=(2, 3), ids=lambda w: f"world{w}")
def reports(request):
    if torch.cuda.device_count() == 1 and request.param > 2:
        pytest.skip("3 ranks time-slicing one GPU wait a time slice per handshake; 3 CPU ranks cover it")
    return reports_on_available_ranks(_worker, request.param, request.param, timeout=120)


def _family_names(world: int) -> dict[str, set[str]]:
    """Each family's checks on every one of ``world`` ranks (run as :func:`reports_on_available_ranks`
    runs them: time-slicing GPU 0 where it is the one GPU), by family: the start of their names."""
    dtypes, ops = _case_lists(world, shared_gpu=torch.cuda.device_count() == 1)
    names = {}
    for collective in ("all_reduce", "all_reduce_two_shot"):
        names[collective] = {f"{collective}/{dtype}/{op}/{call}" for dtype in dtypes
                             for op in (ops if dtype == torch.float32 else OPS[:1])
                             for call in range(2 if op == "sum" else 1)} | {
            f"{collective}/{dtype}/in_place" for dtype in dtypes}
    for collective in ("reduce_scatter", "all_gather_rows", "all_gather_columns", "all_to_all"):
        names[collective] = {f"{collective}/{dtype}" for dtype in dtypes}
    for collective in ("broadcast", "gather"):
        names[collective] = {f"{collective}/{dtype}/root{root}" for dtype in dtypes for root in range(world)}
    names["without_sync"] = {"without_sync/all_gather", "without_sync/completed"}
    names["tile_sync"] = {f"tile_sync/refuses {bad!r}" for bad in BAD_SYNC_SIZES}
    names["graph"] = {f"graph/all_reduce/replay{replay}" for replay in range(GRAPH_REPLAYS)} | {"graph/completed"}
    return names


#: The families of the kernels in either front end; the Triton worker's checks also have these.
KERNEL_FAMILIES = ("all_reduce", "all_reduce_two_shot", "reduce_scatter", "all_gather_rows", "all_gather_columns",
                   "all_to_all", "broadcast", "gather")


@pytest.mark.parametrize("family", [*KERNEL_FAMILIES, "without_sync", "tile_sync"])
def test_tile_collectives_match_torch(reports, family):
    assert_rank_checks(reports, f"{family}/", _family_names(len(reports))[family])


@pytest.mark.gpu
def test_tile_collectives_in_gluon_kernels_match_torch():
    reports = reports_on_available_ranks(_worker, 2, 2, "gluon", backend="gluon", timeout=120)
    names = _family_names(len(reports))
    for family in (*KERNEL_FAMILIES, "graph"):
        assert_rank_checks(reports, f"{family}/", names[family])


@pytest.mark.gpu
def test_a_tile_collective_kernel_replays_in_a_cuda_graph(reports):
    gpus = torch.cuda.device_count()
    if gpus < len(reports) and gpus != 1:
        pytest.skip(f"{len(reports)} ranks ran on CPU ranks here ({gpus} GPUs)")
    assert_rank_checks(reports, "graph/", _family_names(len(reports))["graph"])


@pytest.mark.skipif(torch.cuda.device_count() < 2 and not interpreter_runs_kernel_loops(),
                    reason="the example runs on 2 CPU ranks here, and this Triton's interpreter cannot run its "
                           "loops with this numpy (pin numpy<2.4)")
def test_the_tile_gemm_example_matches_torch():
    example = Path(__file__).parents[1] / "examples" / "tile_gemm.py"
    proc = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "all match", proc.stdout


# -- failures ---------------------------------------------------------------------------------------------


#: The failure scenarios, in the order one start of the ranks runs them (the one where rank 1
#: never calls last: it leaves rank 1 asleep after rank 0 gave up).
FAILURES = ("mismatch", "outside", "absent")
#: Store key rank 0 sets once its wait for the absent rank 1 gave up.
GAVE_UP = "test_tile_collectives/absent/gave_up"


def _failures_worker(rank: int, world: int) -> bytes:
    """Every scenario of :data:`FAILURES` in turn, each on a fresh context; what each saw under
    its name (or the traceback of what raised)."""
    import traceback

    report = RankReport(rank)
    for scenario in FAILURES:
        try:
            report[scenario] = _failure(rank, world, scenario)
        except Exception:  # noqa: BLE001 - the scenario's test fails with it
            report[scenario] = {"raised": "nothing", "error": traceback.format_exc()[-3000:]}
    return report.packed()


def _failure(rank: int, world: int, scenario: str) -> dict:
    from tile_kernels import tile_collective

    report = {}
    store = torch.distributed.distributed_c10d._get_default_store()
    ctx = iris.create(timeout=FAILURE_TIMEOUT)
    sync = ctx.tile_sync(1 if scenario == "outside" else TILES)
    src = ctx.as_symmetric(_data(torch.float32, (M, N), "failure", rank))
    dst = ctx.zeros((M, N))
    ctx.barrier()
    collective = "all_gather_columns" if scenario == "mismatch" and rank == 1 else "all_reduce"
    start = time.monotonic()
    if not (scenario == "absent" and rank == 1):
        wide = ctx.zeros((M, world * N)) if collective == "all_gather_columns" else dst
        TRITON.kernel(tile_collective)[(1,)](
            ctx.get_device_context(), src, wide, sync, M, N, *wide.shape, N, 1, wide.stride(0), 1, 1, 0,
            CTX=TRITON.device_context, RANK=rank, WORLD=world, COLLECTIVE=collective,
            TRACING=False, OP="sum", BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
        report["raised"] = message_raised(ctx.check, IrisTimeoutError)
        report["seconds"] = time.monotonic() - start
        failed = torch.isnan(wide)
        if scenario == "outside":  # tile 0 is inside the sync of one tile and succeeds; every later one fails
            failed[:BLOCK_M, :BLOCK_N] = ~failed[:BLOCK_M, :BLOCK_N]
        report["nan"] = bool(failed.all())
        if scenario == "absent":
            store.set(GAVE_UP, "1")
    else:  # alive, but never calls: the peer's wait must give up (rank 1 waits until it has, at most 2 timeouts)
        try:
            store.wait([GAVE_UP], timedelta(seconds=2 * FAILURE_TIMEOUT))
        except Exception:  # noqa: BLE001 - the peer's report says what it saw
            pass
    try:
        ctx.destroy()
    except IrisError:
        pass
    return report


@pytest.fixture(scope="module")
def failure_reports() -> list[dict]:
    """Both ranks' reports of every failure scenario, from one start of 2 ranks."""
    return reports_on_available_ranks(_failures_worker, 2, 2, timeout=FAILURE_TIMEOUT)


@pytest.mark.parametrize("scenario", FAILURES)
def test_a_failed_tile_collective_poisons_its_tile_and_raises(failure_reports, scenario):
    reports = [rep[scenario] for rep in failure_reports]
    survivors = reports if scenario != "absent" else reports[:1]
    for rank, report in enumerate(survivors):
        assert report["raised"] != "nothing", f"rank {rank}: ctx.check() raised nothing {report.get('error', '')}"
        expected = {"mismatch": "made a different call", "outside": "outside the tile sync", "absent": "gave up"}
        assert expected[scenario] in report["raised"], report["raised"]
        assert report["nan"], f"rank {rank}: the failed calls' tiles are not all NaN (or a good tile is)"
        if scenario == "absent":
            assert report["seconds"] < 10 * FAILURE_TIMEOUT, f"rank {rank} gave up after {report['seconds']:.1f} s"
