"""Collectives (``ctx.ccl``) across real ranks, for every backend whose kernels run here.

One spawn per (backend, world size) runs every collective x dtype x op x size against torch
references built from every rank's input (gathered on the host), with heap and plain tensors,
forced and automatic algorithms, many back-to-back calls with changing data, and CUDA graph
capture on GPUs. Each rank returns ``{check name: True | False | error text}``. Beyond two ranks
each dtype runs at one of the sizes (:func:`_cases`): every dtype and every size still meets
three ranks, and the dtype x size grid is the two-rank world's. On CPU ranks the multi-round size
runs one op per dtype in turn (:func:`_ops`). One more spawn, of five ranks, runs every collective
(the rooted ones too) on sizes that are not multiples of five (:func:`_check_world5`): uneven
segments, some of them empty.
"""

from __future__ import annotations

import pickle
import traceback
import zlib
from contextlib import contextmanager

import attrs

import pytest
import torch

import iris
import iris.collectives.workspaces as workspaces_module
from iris.testing import (
    RankReport,
    assert_rank_checks,
    backend_rank_device,
    interpreted_device,
    seeded_generator,
    spawn_reports,
)
from iris.collectives import Algorithm, algorithm_registry, choose, register_algorithm
from iris.errors import IrisError
from iris_triton import tuning
from iris_triton.collectives import low_latency
from iris_triton.collectives import sentinel

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64)
OPS = ("sum", "max", "min")
#: Elements per rank: one element, odd sizes, and a size that takes several pipelined rounds per
#: program in one-shot and (2 ranks) two-shot (CPU ranks: BLOCK 64, ROUND 2, 2 programs; GPUs:
#: the launch shapes of iris_triton.tuning.COLLECTIVE_SHAPES up to 64 MiB, 132 programs).
SIZES = {"cpu": (1, 37, 600), "cuda": (1, 37, 4099, 10 * 4096 * 132 + 5)}
#: Sizes at which each dtype runs one op, in turn (CPU ranks: the multi-round size, whose calls
#: take most of the matrix's time; every op meets every dtype and algorithm at the smaller sizes,
#: and the multi-round schedule with some dtype).
ONE_OP_AT = {"cpu": (600,), "cuda": ()}
BACK_TO_BACK = {"cpu": 20, "cuda": 1000}
#: Element counts the back-to-back calls alternate between: one block (one program) and blocks
#: for more programs than the GPU has multiprocessors.
BACK_TO_BACK_SIZES = {"cpu": (37, 129), "cuda": (129, 4096 * 140 + 3)}
#: all_reduce algorithms checked by name (None: the automatic choice, which picks one of them;
#: checked on GPUs, where calls are cheap).
ALL_REDUCE_ALGORITHMS = {"cpu": ("low_latency", "sentinel", "one_shot", "two_shot"),
                         "cuda": ("low_latency", "sentinel", "one_shot", "two_shot", None)}


def _cases(device_type: str, world: int) -> list[tuple[int, torch.dtype]]:
    """The (elements per rank, dtype) pairs the matrix runs: every pair on two ranks; on more, each
    dtype at one size in turn (the element handling a dtype needs does not depend on the world
    size, which the sizes' splitting between ranks does)."""
    sizes = SIZES[device_type]
    if world == 2:
        return [(size, dtype) for size in sizes for dtype in DTYPES]
    return [(sizes[i % len(sizes)], dtype) for i, dtype in enumerate(DTYPES)]


def _ops(device_type: str, size: int, dtype: torch.dtype) -> tuple[str, ...]:
    """The reductions the matrix runs at ``size`` in ``dtype`` (:data:`ONE_OP_AT`)."""
    if size in ONE_OP_AT[device_type]:
        return (OPS[DTYPES.index(dtype) % len(OPS)],)
    return OPS


def _refusal(algorithm: str | None, t: torch.Tensor) -> str | None:
    """What the error of an all_reduce ``algorithm`` that does not take ``t`` says, or None."""
    nbytes = t.numel() * t.element_size()
    if algorithm == "low_latency" and nbytes > low_latency.MAX_BYTES:
        return "at most"
    if algorithm == "sentinel" and not t.dtype.is_floating_point:
        return "takes bfloat16, float16, float32 tensors"
    if algorithm == "sentinel" and nbytes > sentinel.MAX_BYTES:
        return "at most"
    return None


def _data(dtype: torch.dtype, n: int, *seed) -> torch.Tensor:
    """Seeded values every rank can recompute; small integers so sums cannot overflow."""
    g = seeded_generator(*seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g).to(dtype)


def _reference_reduce(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    """Reduction in rank order, accumulating 16-bit floats in float32 as the kernels do."""
    wide = [t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors]
    acc = wide[0]
    for t in wide[1:]:
        acc = acc + t if op == "sum" else torch.maximum(acc, t) if op == "max" else torch.minimum(acc, t)
    return acc.to(tensors[0].dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point:
        return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-2 if a.element_size() == 2 else 1e-5,
                                                     atol=1e-2 if a.element_size() == 2 else 1e-5)
    return torch.equal(a, b)


def _all_reduce_or_refusal(ctx, report: RankReport, t: torch.Tensor, op: str, algorithm, key: str) -> bool:
    """All-reduce ``t`` in place by ``algorithm`` and return True; or, where the algorithm does
    not apply to ``t``, check that the call is refused with the reason (``key/refused``) and return
    False."""
    refusal = _refusal(algorithm, t)
    if refusal is None:
        ctx.ccl.all_reduce(t, op=op, algorithm=algorithm)
        return True
    try:
        ctx.ccl.all_reduce(t, op=op, algorithm=algorithm)
        refused = False
    except IrisError as error:
        refused = refusal in str(error)
    report.check(f"{key}/refused", refused)
    return False


def _check_matrix(ctx, report: RankReport) -> None:
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    on_the_heap = []

    def _tensor(ctx, values: torch.Tensor, on_heap: bool) -> torch.Tensor:
        values = values.to(ctx.device)
        if not on_heap:
            return values.clone()
        on_the_heap.append(ctx.as_symmetric(values))
        return on_the_heap[-1]

    for size, dtype in _cases(device.type, world):
        name = f"{str(dtype).removeprefix('torch.')}/n{size}"
        mine = [_data(dtype, world * size, q, size, str(dtype)) for q in range(world)]
        on_heap = (size + DTYPES.index(dtype)) % 2 == 0  # alternate heap and plain tensors
        for op in _ops(device.type, size, dtype):
            expected = _reference_reduce(mine, op)
            for algorithm in ALL_REDUCE_ALGORITHMS[device.type]:
                t = _tensor(ctx, mine[rank], on_heap)
                if not _all_reduce_or_refusal(ctx, report, t, op, algorithm, f"all_reduce/{algorithm}/{op}/{name}"):
                    continue
                result = t.cpu()
                report.check(f"all_reduce/{algorithm or 'auto'}/{op}/{name}", _same(result, expected))
                everyone = ctx.comm.all_gather_object(result)
                report.check(f"all_reduce/{algorithm or 'auto'}/{op}/{name}/identical_on_all_ranks",
                             all(torch.equal(everyone[0], r) for r in everyone))
            out = torch.empty(size, dtype=dtype, device=device)
            ctx.ccl.reduce_scatter(out, _tensor(ctx, mine[rank], on_heap), op=op)
            report.check(f"reduce_scatter/{op}/{name}", _same(out.cpu(), expected[rank * size:(rank + 1) * size]))
        x = mine[rank][:size]
        out = torch.full((world, size), 7, dtype=dtype, device=device)
        ctx.ccl.all_gather(out, _tensor(ctx, x, on_heap))
        report.check(f"all_gather/{name}", torch.equal(out.cpu(), torch.stack([m[:size] for m in mine])))
        out = torch.empty(world * size, dtype=dtype, device=device)
        ctx.ccl.all_to_all(out, _tensor(ctx, mine[rank], on_heap))
        report.check(f"all_to_all/{name}", torch.equal(
            out.cpu(), torch.cat([mine[q][rank * size:(rank + 1) * size] for q in range(world)])))
        src = (size + 1) % world
        t = _tensor(ctx, x, on_heap)
        ctx.ccl.broadcast(t, src=src)
        report.check(f"broadcast/src{src}/{name}", torch.equal(t.cpu(), mine[src][:size]))
        ctx.barrier()
        report.check(f"no_wait_failed/{name}", not ctx.failed)
        while on_the_heap:
            ctx.free(on_the_heap.pop())


def _check_back_to_back(ctx, report: RankReport) -> None:
    """Many calls in a row, no host synchronisation between them, each with new data, sizes
    alternating between a one-program grid and a grid of several programs: a stale workspace slot
    or flag would show as a wrong result."""
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    calls = BACK_TO_BACK[device.type]
    base = {n: torch.stack([_data(torch.float32, n, q, "b2b") for q in range(world)]).to(device)
            for n in BACK_TO_BACK_SIZES[device.type]}
    results, gathered = [], []
    for i in range(calls):
        n = BACK_TO_BACK_SIZES[device.type][i % 2]
        results.append(base[n][rank] + i)
        algorithm = ("low_latency", "sentinel", "one_shot", "two_shot")[i // 2 % 4]
        if algorithm == "low_latency" and n * 4 > low_latency.MAX_BYTES:
            algorithm = None  # too large for it: the automatic choice
        ctx.ccl.all_reduce(results[i], algorithm=algorithm)
        gathered.append(torch.empty(world, n, device=device))
        ctx.ccl.all_gather(gathered[i], base[n][rank] * (i + 1))
    reduced_ok = gathered_ok = True
    for i in range(calls):
        b = base[BACK_TO_BACK_SIZES[device.type][i % 2]]
        reduced_ok &= torch.allclose(results[i], b.sum(0) + world * i, atol=1e-4)
        gathered_ok &= torch.equal(gathered[i], b * (i + 1))
    report.check("back_to_back/all_reduce", bool(reduced_ok))
    report.check("back_to_back/all_gather", bool(gathered_ok))


def _check_cuda_graph(ctx, report: RankReport) -> None:
    device = ctx.device
    n = 4099
    x = ctx.zeros(n)
    out = ctx.zeros(ctx.world_size, n)
    for _ in range(2):  # warm up: compile and size the workspace before capturing
        ctx.ccl.all_reduce(x)
        ctx.ccl.all_gather(out, x)
    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        ctx.ccl.all_reduce(x)
        ctx.ccl.all_gather(out, x)
    ok = True
    for replay in range(20):
        mine = _data(torch.float32, n, ctx.rank, "graph", replay).to(device)
        everyone = [_data(torch.float32, n, q, "graph", replay).to(device) for q in range(ctx.world_size)]
        x.copy_(mine)
        ctx.barrier()
        graph.replay()
        torch.cuda.synchronize(device)
        reduced = sum(everyone[1:], everyone[0])
        ok &= torch.allclose(x, reduced, atol=1e-5) and torch.equal(out, reduced.expand(ctx.world_size, n))
    report.check("cuda_graph/replays_match_eager_reference", ok)
    # Larger eager calls grow both workspaces the graph uses, and new tensors take heap memory:
    # the graph keeps replaying into the workspaces it was captured with, untouched by them.
    big = ctx.zeros(64 << 10)
    ctx.ccl.all_reduce(big, algorithm="low_latency")
    ctx.ccl.all_gather(ctx.zeros(ctx.world_size, 64 << 10), big)
    others = [ctx.full((1 << 20,), 7.0) for _ in range(4)]
    mine = _data(torch.float32, n, ctx.rank, "graph", "grown").to(device)
    everyone = [_data(torch.float32, n, q, "graph", "grown").to(device) for q in range(ctx.world_size)]
    x.copy_(mine)
    ctx.barrier()
    graph.replay()
    torch.cuda.synchronize(device)
    reduced = sum(everyone[1:], everyone[0])
    report.check("cuda_graph/replays_after_the_workspaces_grew",
                 torch.allclose(x, reduced, atol=1e-5) and torch.equal(out, reduced.expand(ctx.world_size, n))
                 and all(bool((t == 7.0).all()) for t in others))


def _ccl_worker(rank: int, backend: str, device: str) -> bytes:
    report = RankReport(rank)
    report["device_type"] = device  # the tests count the checks the matrix makes there
    # The largest int64 calls need ~175 MiB of workspace, which grows (free, then allocate) with the sizes.
    ctx = iris.create(backend, heap_size="2GiB" if device == "cuda" else "32MiB", device=device)
    with report.section("matrix"):
        _check_matrix(ctx, report)
    with report.section("back_to_back"):
        _check_back_to_back(ctx, report)
    if device == "cuda":
        with report.section("cuda_graph"):
            _check_cuda_graph(ctx, report)
    ctx.barrier()
    ctx.destroy()
    return report.packed()


#: The five-rank world's (elements per rank, dtype): none a multiple of five, so that the segments
#: ranks own are uneven: fewer elements than ranks (two-shot segments of 1, 1, 1, 0, 0), one block
#: (segments of 8 and a last of 5), and two rounds of a program in each two-shot segment of 257
#: elements (the last 255) and in one-shot (CPU ranks: BLOCK 64, ROUND 2, 2 programs). The
#: sentinel refuses int32 (checked as such).
WORLD5_CASES = ((3, torch.int32), (37, torch.bfloat16), (1283, torch.float32))
#: Sizes of :data:`WORLD5_CASES` at which only all_reduce runs: its algorithms' rounds per program.
#: The other collectives' segments are the ranks' elements, uneven at the smaller sizes already,
#: and each of their calls at this size costs seconds in the interpreter.
WORLD5_ALL_REDUCE_ONLY = (1283,)
#: The roots of the five-rank world's broadcast, reduce, gather and scatter, taken in turn: none
#: is rank 0.
WORLD5_ROOTS = (3, 1)


def _check_world5(ctx, report: RankReport) -> None:
    """Every collective on five ranks, in one pass: all_reduce by each algorithm (sum, and max at
    one size) at each of :data:`WORLD5_CASES`; reduce_scatter, all_gather, all_to_all, broadcast,
    reduce, gather and scatter at those not in :data:`WORLD5_ALL_REDUCE_ONLY`; heap and plain
    tensors in turn; against the host references."""
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    on_the_heap = []

    def tensor(values: torch.Tensor, on_heap: bool) -> torch.Tensor:
        if not on_heap:
            return values.to(device).clone()
        on_the_heap.append(ctx.as_symmetric(values.to(device)))
        return on_the_heap[-1]

    for i, (size, dtype) in enumerate(WORLD5_CASES):
        while on_the_heap:  # the previous case's
            ctx.free(on_the_heap.pop())
        name = f"{str(dtype).removeprefix('torch.')}/n{size}"
        on_heap = i % 2 == 0
        root = WORLD5_ROOTS[i % len(WORLD5_ROOTS)]
        mine = [_data(dtype, world * size, q, size, str(dtype), "world5") for q in range(world)]
        op = "max" if i == 1 else "sum"
        expected = _reference_reduce(mine, op)
        for algorithm in ALL_REDUCE_ALGORITHMS["cpu"]:
            t = tensor(mine[rank][:size], on_heap)
            if not _all_reduce_or_refusal(ctx, report, t, op, algorithm, f"world5/all_reduce/{algorithm}/{op}/{name}"):
                continue
            report.check(f"world5/all_reduce/{algorithm}/{op}/{name}",
                         _same(t.cpu(), _reference_reduce([m[:size] for m in mine], op)))
        if size in WORLD5_ALL_REDUCE_ONLY:
            continue
        mine_at = slice(rank * size, (rank + 1) * size)  # this rank's segment of a world * size input
        out = torch.empty(size, dtype=dtype, device=device)
        ctx.ccl.reduce_scatter(out, tensor(mine[rank], on_heap), op=op)
        report.check(f"world5/reduce_scatter/{op}/{name}", _same(out.cpu(), expected[mine_at]))
        x = mine[rank][:size]
        out = torch.full((world, size), 7, dtype=dtype, device=device)
        ctx.ccl.all_gather(out, tensor(x, on_heap))
        report.check(f"world5/all_gather/{name}", torch.equal(out.cpu(), torch.stack([m[:size] for m in mine])))
        out = torch.empty(world * size, dtype=dtype, device=device)
        ctx.ccl.all_to_all(out, tensor(mine[rank], on_heap))
        report.check(f"world5/all_to_all/{name}", torch.equal(out.cpu(), torch.cat([m[mine_at] for m in mine])))
        t = tensor(x, on_heap)
        ctx.ccl.broadcast(t, src=root)
        report.check(f"world5/broadcast/src{root}/{name}", torch.equal(t.cpu(), mine[root][:size]))
        t = tensor(x, on_heap)
        ctx.ccl.reduce(t, dst=root, op=op)
        report.check(f"world5/reduce/{op}/dst{root}/{name}", _same(
            t.cpu(), _reference_reduce([m[:size] for m in mine], op) if rank == root else x))
        out = torch.full((world, size), 7, dtype=dtype, device=device)
        ctx.ccl.gather(out, tensor(x, on_heap), dst=root)
        report.check(f"world5/gather/dst{root}/{name}", torch.equal(
            out.cpu(), torch.stack([m[:size] for m in mine]) if rank == root else torch.full((world, size), 7,
                                                                                           dtype=dtype)))
        out = tensor(torch.full((size,), 7, dtype=dtype), on_heap)
        ctx.ccl.scatter(out, tensor(mine[root], on_heap), src=root)
        report.check(f"world5/scatter/src{root}/{name}", torch.equal(out.cpu(), mine[root][mine_at]))
    ctx.barrier()
    report.check("world5/no_wait_failed", not ctx.failed)


def _world5_worker(rank: int, device: str) -> bytes:
    report = RankReport(rank)
    ctx = iris.create("triton", heap_size="2GiB" if device == "cuda" else "32MiB", device=device)
    with report.section("world5"):
        _check_world5(ctx, report)
    ctx.barrier()
    ctx.destroy()
    return report.packed()


def test_world5_every_collective_matches_torch_on_uneven_segments():
    device = backend_rank_device("triton", 5)
    reports = spawn_reports(_world5_worker, 5, device, device=device)
    # Per rank and case: each all_reduce algorithm's result (or its refusal), and one check of each
    # other collective where they run; then world5/no_wait_failed and world5/completed.
    others = ("reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce", "gather", "scatter")
    algorithms = len(ALL_REDUCE_ALGORITHMS["cpu"])
    per_rank = sum(algorithms + (0 if size in WORLD5_ALL_REDUCE_ONLY else len(others)) for size, _ in WORLD5_CASES) + 2
    assert_rank_checks(reports, "world5/", 5 * per_rank)


@pytest.fixture(scope="module", params=[(backend, world) for backend in ("triton", "gluon") for world in (2, 3)],
                ids=lambda p: f"{p[0]}-world{p[1]}")
def reports(request) -> list[dict]:
    backend, world = request.param
    device = backend_rank_device(backend, world)
    return spawn_reports(_ccl_worker, world, backend, device, device=device)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast"])
def test_collective_matches_torch(reports, collective):
    # Per rank, for each size, dtype and op: each all_reduce algorithm's result and that it is the
    # same on every rank, or its refusal where it does not take the call (of world * size
    # elements); one reduce_scatter check. One check of each other collective per size and dtype.
    device_type, world = reports[0]["device_type"], len(reports)
    calls = [(size, dtype, op) for size, dtype in _cases(device_type, world) for op in _ops(device_type, size, dtype)]
    if collective == "all_reduce":
        checks = sum(1 if _refusal(algorithm, torch.empty(world * size, dtype=dtype, device="meta")) else 2
                     for size, dtype, _ in calls for algorithm in ALL_REDUCE_ALGORITHMS[device_type])
    elif collective == "reduce_scatter":
        checks = len(calls)
    else:
        checks = len(_cases(device_type, world))
    assert_rank_checks(reports, f"{collective}/", checks * world)


def test_no_device_wait_timed_out(reports):
    assert_rank_checks(reports, "no_wait_failed/", len(_cases(reports[0]["device_type"], len(reports))) * len(reports))


def test_back_to_back_calls_see_no_stale_data(reports):
    assert_rank_checks(reports, "back_to_back/", {"back_to_back/all_reduce", "back_to_back/all_gather",
                                                  "back_to_back/completed"})


def test_cuda_graph_capture_and_replay(reports):
    if reports[0]["device_type"] != "cuda":
        pytest.skip("CUDA graphs need GPU ranks")
    assert_rank_checks(reports, "cuda_graph/", {"cuda_graph/replays_match_eager_reference",
                                                "cuda_graph/replays_after_the_workspaces_grew", "cuda_graph/completed"})


# -- single-rank checks (the session context) -------------------------------------------------------------


def test_algorithms_are_registered_for_every_collective(ctx):
    assert ctx.ccl.algorithms("all_reduce") == ["low_latency", "one_shot", "sentinel", "two_shot"]
    for collective in ("all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        assert "direct" in ctx.ccl.algorithms(collective)
    with pytest.raises(ValueError, match="unknown collective"):
        ctx.ccl.algorithms("all_scatter")


def _chosen(nbytes: int, world: int, dtype: torch.dtype, collective: str = "all_reduce", device: str = "cuda",
            language: str = "triton") -> str:
    return choose(collective, nbytes, world, dtype, device, language).name


def test_automatic_choice_depends_only_on_size_world_and_dtype():
    bf16, i32 = torch.bfloat16, torch.int32
    assert _chosen(8 << 10, 2, bf16) == "low_latency"
    assert _chosen(256 << 10, 2, i32) == "low_latency"
    assert _chosen((256 << 10) + 2, 2, bf16) == "sentinel"
    assert _chosen(4 << 20, 2, torch.float32) == "sentinel"
    assert _chosen(8 << 20, 2, torch.float16) == "sentinel"
    assert _chosen(1 << 20, 2, i32) == "one_shot"  # the sentinel takes floats only
    assert _chosen(1 << 20, 3, bf16) == "one_shot"  # not measured on 3 ranks
    assert _chosen((8 << 20) + 2, 2, bf16) == "two_shot"
    assert _chosen(256 << 20, 4, bf16) == "two_shot"
    assert _chosen(64 << 10, 5, bf16, device="cpu") == "low_latency"
    assert _chosen(1, 8, bf16, collective="all_gather") == "direct"
    assert _chosen(1 << 20, 2, bf16, language="gluon") == "sentinel"


def test_the_automatic_choice_stays_within_each_algorithms_own_limit():
    # The tuning says where an algorithm is fastest; the declarations say what it takes.
    for name, limits in tuning.ALL_REDUCE_CHOSEN_UP_TO.items():
        declared = algorithm_registry("all_reduce").get(name).max_bytes
        assert declared is None or max(limits.values()) <= declared, name
    for world in (2, 3, 4, 8):
        for nbytes in (1, 8 << 10, 1 << 20, 8 << 20, (8 << 20) + 2, 64 << 20):
            for dtype in (torch.bfloat16, torch.float32, torch.int32):
                algorithm = _chosen(nbytes, world, dtype)
                limit = {"low_latency": low_latency.MAX_BYTES, "sentinel": sentinel.MAX_BYTES}.get(algorithm)
                assert limit is None or nbytes <= limit, (world, nbytes, dtype, algorithm)


def test_a_plugin_algorithm_wins_the_automatic_choice_where_it_declares_itself_better(ctx):
    # Declared for float32 calls up to 4 KiB with a priority above every built-in: chosen there,
    # and nowhere else (other dtypes, larger calls, world sizes it does not declare).
    seen = []
    better = Algorithm(name="test_better", collective="all_reduce", run=lambda call: seen.append(call.input.numel()),
                       languages=(), dtypes={torch.float32}, priority=100, chosen_up_to={None: 4096})
    with _registered(better):
        assert _chosen(4096, 2, torch.float32) == "test_better"
        assert _chosen(4096, 2, torch.float32, language="some_other_language") == "test_better"
        assert _chosen(4100, 2, torch.float32) == "low_latency"
        assert _chosen(64, 2, torch.bfloat16) == "low_latency"
        x = ctx.ones(16)
        ctx.ccl.all_reduce(x)
        assert seen == [16]
        ctx.ccl.all_reduce(ctx.ones(16, dtype=torch.int32))
        assert seen == [16]  # not for int32: a built-in ran
    with _registered(attrs.evolve(better, name="test_three_ranks", world_sizes=range(3, 4))):
        assert _chosen(64, 2, torch.float32) == "low_latency"
        assert _chosen(64, 3, torch.float32) == "test_three_ranks"


def test_an_algorithm_named_where_it_does_not_apply_is_refused_with_the_reason(ctx):
    gluon_only = Algorithm(name="test_gluon_only", collective="all_gather", run=lambda call: None,
                           languages={"gluon"})
    with _registered(gluon_only):
        x = ctx.ones(4)
        with pytest.raises(IrisError, match=r"algorithm 'test_gluon_only' cannot run this call: it is implemented "
                                            r"for gluon kernels, and this context's backend compiles triton kernels; "
                                            r"choose one of \['direct'\]"):
            ctx.ccl.all_gather(ctx.zeros(ctx.world_size * 4), x, algorithm="test_gluon_only")


def test_unknown_algorithm_lists_the_registered_ones(ctx):
    t = ctx.ones(4)
    with pytest.raises(IrisError, match=r"unknown all_reduce algorithm 'ring'; installed: .*one_shot"):
        ctx.ccl.all_reduce(t, algorithm="ring")


@contextmanager
def _registered(algorithm: Algorithm):
    """``algorithm`` registered in process for the block, then the registry as it was."""
    with algorithm_registry(algorithm.collective).restored():
        register_algorithm(algorithm)
        yield algorithm


def test_a_registered_algorithm_is_selectable(ctx):
    seen = []
    with _registered(Algorithm(name="test_recorder", collective="broadcast", languages=(),
                               run=lambda call: seen.append(call.src))):
        ctx.ccl.broadcast(ctx.ones(3), src=0, algorithm="test_recorder")
        assert seen == [0]
        assert "test_recorder" in ctx.ccl.algorithms("broadcast")


def test_an_identical_call_runs_the_algorithms_repeat(ctx):
    runs, repeats = [], []

    def run(call):
        runs.append(call.input.data_ptr())
        return lambda stream: repeats.append(call.input.data_ptr())

    with _registered(Algorithm(name="test_repeating", collective="broadcast", run=run, languages=())):
        a, b = ctx.ones(8), ctx.ones(8)
        for tensor in (a, a, a, b, b):
            ctx.ccl.broadcast(tensor, algorithm="test_repeating")
        assert runs == [a.data_ptr(), b.data_ptr()]  # checked and prepared once per tensor
        assert repeats == [a.data_ptr(), a.data_ptr(), b.data_ptr()]
        with pytest.raises(IrisError, match="not contiguous"):  # a different layout is checked again
            ctx.ccl.broadcast(ctx.ones(4, 4).t(), algorithm="test_repeating")
        ctx.workspaces.get("collectives", ctx.workspaces.get("collectives", 1).numel() + 1024)  # drops every repeat
        ctx.ccl.broadcast(a, algorithm="test_repeating")
        assert runs == [a.data_ptr(), b.data_ptr(), a.data_ptr()]


def test_a_registration_drops_the_repeats_and_choices_made_before(ctx):
    # An identical call repeats the earlier launch, until the registered algorithms change: then
    # the automatic choice is made again (a better algorithm registered since wins).
    ran = []

    def recording(name):
        def run(call):
            ran.append(name)
            return lambda stream: ran.append(f"{name} repeat")

        return run

    first = Algorithm(name="test_first", collective="broadcast", run=recording("first"), languages=(), priority=100)
    second = attrs.evolve(first, name="test_second", run=recording("second"), priority=200)
    x = ctx.ones(8)
    with _registered(first):
        ctx.ccl.broadcast(x)
        ctx.ccl.broadcast(x)
        with _registered(second):
            ctx.ccl.broadcast(x)
            ctx.ccl.broadcast(x)
    assert ran == ["first", "first repeat", "second", "second repeat"]


def _one_more_algorithm_on_rank_1(rank: int) -> str:
    with algorithm_registry("broadcast").restored():
        if rank == 1:
            register_algorithm(Algorithm(name="test_only_here", collective="broadcast", run=lambda call: None,
                                         languages=()))
        try:
            iris.create(heap_size="1MiB", device="cpu").destroy()
            return "created"
        except IrisError as error:
            return str(error)


def _two_rank_worker(rank: int, kernels: bool) -> bytes:
    """The two-rank checks that need a context of their own, in one start of the ranks, each
    part's outcome (or its traceback) under its name: the low-latency slots (``kernels``: where
    the kernels run on CPU ranks), a capture on one rank, then ranks with different algorithms
    installed (last: its contexts fail to be created)."""
    parts = {"low_latency_slots": lambda: _low_latency_slot_flags(rank, 40) if kernels else None,
             "captured": lambda: _one_rank_captured_worker(rank, "cpu"),
             "different_algorithms": lambda: _one_more_algorithm_on_rank_1(rank)}
    outcomes = {}
    for name, part in parts.items():
        try:
            outcomes[name] = part()
        except Exception:  # noqa: BLE001 - the part's test fails with it
            outcomes[name] = f"raised on rank {rank}: {traceback.format_exc()[-3000:]}"
    return zlib.compress(pickle.dumps(outcomes))  # as RankReport.packed(), for spawn_reports


@pytest.fixture(scope="module")
def two_rank_outcomes() -> list[dict]:
    """Every rank's :func:`_two_rank_worker` outcomes, from one start of 2 CPU ranks."""
    try:
        interpreted_device()
        kernels = True
    except pytest.skip.Exception:
        kernels = False
    return spawn_reports(_two_rank_worker, 2, kernels, device="cpu")


def _outcomes(two_rank_outcomes: list[dict], part: str) -> list:
    for outcome in (o[part] for o in two_rank_outcomes):
        assert not (isinstance(outcome, str) and outcome.startswith("raised on rank")), outcome
    return [o[part] for o in two_rank_outcomes]


def test_ranks_with_different_algorithms_installed_cannot_create_a_context(two_rank_outcomes):
    # The automatic choice would differ between them: every rank raises, listing each rank's.
    for outcome in _outcomes(two_rank_outcomes, "different_algorithms"):
        assert "the ranks have different collective algorithms installed" in outcome, outcome
        assert "'test_only_here'" in outcome and "install the same iris plugins on every rank" in outcome


def test_low_latency_all_reduce_refuses_large_calls(ctx):
    t = ctx.ones(low_latency.MAX_BYTES // 4 + 1)
    with pytest.raises(IrisError, match=r"'low_latency' cannot run this call: it takes at most 1 MiB per rank, "
                                        r"this call has 1048580 bytes; choose one of "
                                        r"\['one_shot', 'sentinel', 'two_shot'\]"):
        ctx.ccl.all_reduce(t, algorithm="low_latency")
    ctx.free(t)


def test_sentinel_all_reduce_refuses_integers_and_large_calls(ctx):
    t = ctx.ones(8, dtype=torch.int32)
    with pytest.raises(IrisError, match="'sentinel' cannot run this call: it takes bfloat16, float16, float32 tensors, "
                                        "this call has int32"):
        ctx.ccl.all_reduce(t, algorithm="sentinel")
    big = ctx.ones(sentinel.MAX_BYTES // 4 + 1)
    with pytest.raises(IrisError, match=r"at most 8 MiB per rank.*\['one_shot', 'two_shot'\]"):
        ctx.ccl.all_reduce(big, algorithm="sentinel")
    ctx.free(t)
    ctx.free(big)


@pytest.mark.parametrize("captured", ["repeated_collective", "workspace_request"])
def test_a_workspace_outgrown_after_a_graph_capture_stays_allocated_for_the_graph(ctx, monkeypatch, captured):
    # A graph captured with a workspace's address replays into it after the workspace grew: the
    # old one must not be freed and handed to another tensor. The capture is simulated (the
    # check that reads torch's capture state is replaced), so this runs on CPU ranks too. It is
    # seen in a repeated collective (which asks for no workspace) or in a workspace request (as
    # fused operations make per call).
    with iris.create(heap_size="1MiB", device=ctx.device.type) as c:
        old = c.workspaces.get("graphed", 4096)
        old.fill_(5)
        x = c.ones(4)
        c.ccl.all_reduce(x)  # the warm-up call before capturing
        monkeypatch.setattr(workspaces_module, "capturing", lambda device_type: True)
        if captured == "repeated_collective":
            c.ccl.all_reduce(x)
        else:
            c.workspaces.get("graphed", 16)
        with pytest.raises(IrisError, match="cannot happen inside a CUDA graph capture; before capturing, make one "
                                            "call of each size and dtype"):
            c.workspaces.get("graphed", 8192)
        monkeypatch.setattr(workspaces_module, "capturing", lambda device_type: False)
        new = c.workspaces.get("graphed", 8192)
        others = [c.full((4096,), 9, dtype=torch.uint8) for _ in range(3)]  # would take the freed memory
        assert new.numel() >= 8192 and bool((old == 5).all())
        assert all(not _overlaps(old, t) for t in [new, *others])
        # Once no graph will replay, the kept workspace goes back to the heap.
        used = c.heap.allocator.used_bytes
        c.workspaces.release_graph_buffers()
        assert c.heap.allocator.used_bytes <= used - 4096 and not c.workspaces.graph_captured


def _one_rank_captured_worker(rank: int, device: str) -> bytes:
    report = RankReport(rank)
    ctx = iris.create(heap_size="1MiB", device=device)
    ctx.workspaces.get("graphed", 4096)
    if rank == 0:  # only rank 0 captured a call that used it
        capturing = workspaces_module.capturing
        workspaces_module.capturing = lambda device_type: True
        try:
            ctx.workspaces.get("graphed", 16)
        finally:
            workspaces_module.capturing = capturing
    ctx.workspaces.get("graphed", 8192)
    offsets = ctx.comm.all_gather_object(ctx.heap.offset_of(ctx.empty(4096, dtype=torch.uint8)))
    report.check("captured/heaps_still_match", len(set(offsets)) == 1)
    report.check("captured/known_on_every_rank", ctx.workspaces.graph_captured)
    ctx.barrier()
    ctx.destroy()
    return report.packed()


def test_a_capture_on_one_rank_keeps_outgrown_workspaces_on_every_rank(two_rank_outcomes):
    # Keeping on one rank and freeing on another would leave the ranks' heaps different.
    reports = [pickle.loads(zlib.decompress(p)) for p in _outcomes(two_rank_outcomes, "captured")]
    assert_rank_checks(reports, "captured/", {"captured/heaps_still_match", "captured/known_on_every_rank"})


def _low_latency_slot_flags(rank: int, n: int) -> list[list[int]]:
    """Two consecutive low-latency calls of ``n`` float32 elements, then, per workspace slot, the
    distinct flags (high halves) of the words the peer pushed into this rank's region for it."""
    ctx = iris.create(heap_size="16MiB", device="cpu")
    x = ctx.ones(n)
    for _ in range(2):
        ctx.ccl.all_reduce(x, algorithm="low_latency")
    # The calls' own workspace (the same request: one 64-bit word per 32-bit payload word).
    ws, region_bytes = ctx.workspaces.slot_regions("low_latency", n * 8, fill=0)
    words, capacity, peer = ws.view(torch.int64), region_bytes // 8, 1 - rank
    flags = [sorted(set((words[(slot * 2 + peer) * capacity:][:n] >> 32).tolist())) for slot in (0, 1)]
    ctx.destroy()
    return flags


def test_consecutive_low_latency_calls_use_the_two_slots_in_turn(two_rank_outcomes):
    # Call k + 1 must not write where a slow peer may still read call k: the two calls' words sit
    # in different slots, each slot holding one call's flag. (A slow peer rarely loses that race
    # on CPU ranks, so the slow-peer tests alone would not notice one shared slot.)
    interpreted_device()  # skips where the kernels cannot run on CPU ranks
    for rank, flags in enumerate(_outcomes(two_rank_outcomes, "low_latency_slots")):
        first, second = flags
        assert len(first) == len(second) == 1 and 0 not in first + second and first != second, \
            f"rank {rank}: flags of the peer's words per slot: {flags}"


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() < b.data_ptr() + b.numel() * b.element_size() and b.data_ptr() < a.data_ptr() + a.numel()


def test_single_rank_collectives_are_identities(ctx):
    x = torch.randn(1000, device=ctx.device)
    t = x.clone()
    ctx.ccl.all_reduce(t)
    assert torch.equal(t, x)
    out = torch.empty(1, 1000, device=ctx.device)
    ctx.ccl.all_gather(out, x)
    assert torch.equal(out[0], x)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c: c.ccl.all_reduce(torch.ones(4, dtype=torch.float64, device=c.device)), "dtype torch.float64"),
        (lambda c: c.ccl.all_reduce(torch.ones(4, 4, device=c.device).t()), "not contiguous"),
        (lambda c: c.ccl.all_reduce(torch.ones(4, device=c.device), op="band"), "op must be one of"),
        (lambda c: c.ccl.all_gather(torch.ones(3, device=c.device), torch.ones(4, device=c.device)),
         "needs world_size"),
        (lambda c: c.ccl.all_gather(torch.ones(4, dtype=torch.int32, device=c.device), torch.ones(4, device=c.device)),
         "differs from input dtype"),
        (lambda c: c.ccl.reduce_scatter(torch.ones(3, device=c.device), torch.ones(4, device=c.device)),
         "needs input / world_size"),
        (lambda c: c.ccl.broadcast(torch.ones(4, device=c.device), src=1), "not a rank"),
        (lambda c: (lambda t: c.ccl.all_to_all(t[:4], t[2:]))(torch.ones(6, device=c.device)), "overlap"),
    ],
    ids=["dtype", "contiguity", "op", "gather_size", "dtype_mismatch", "scatter_size", "src", "overlap"],
)
def test_bad_calls_raise_clear_errors(ctx, call, message):
    with pytest.raises((IrisError, ValueError), match=message):
        call(ctx)


def test_tensor_on_another_device_is_rejected(ctx):
    if ctx.device.type == "cpu":
        pytest.skip("needs a GPU context to have another device")
    with pytest.raises(IrisError, match="move it with"):
        ctx.ccl.all_reduce(torch.ones(4))
