"""Fused matmul + communication (``ctx.ops``) across real ranks, against torch.

One spawn per world size runs every operation by every method (copy engines, fused kernels,
sequential), bf16 and fp16, on shapes
with ragged tiles (small ones on CPU ranks, where kernels are interpreted), against a float32
reference built from every rank's inputs (each rank regenerates them from seeds); then calls
back to back with changing data and shapes (stale slots or flags would show), the checks of bad
input, and on GPUs CUDA-graph capture and replay.

A spawn of five ranks runs each operation (``matmul_all_gather`` too) by each method once, on
extents none of which is a multiple of the world size, and the 16-bit precision rule of the
reducing operations: every method adds the ranks' partial products in float32 and rounds once
(:func:`_rounded_once`), which a sum rounded to bf16 after each addition fails from four ranks on.
"""

from __future__ import annotations

import math

import pytest
import torch

import iris
from iris.testing import (
    RankReport,
    assert_rank_checks,
    backend_rank_device,
    interpreted_device,
    rank_device,
    seeded_generator,
    spawn_reports,
)
from iris.errors import IrisError
from iris_triton.operations.fused_ops import COPY_ENGINE_MIN_SHARE, METHODS, communication_share
from iris_triton.operations.gemm import split_launch, split_parts, split_slots
from fused_cases import cut_shape, parts_of, with_few_units

#: (rows per rank m, K, N): ragged against the tiles (CPU 16 x 16 x 16, GPU 128 x 256 x 64).
SHAPES = {"cpu": ((5, 16, 24), (21, 40, 33)), "cuda": ((1000, 1024, 1536), (2048, 4096, 2560))}
DTYPES = (torch.bfloat16, torch.float16)
BACK_TO_BACK = {"cpu": 12, "cuda": 48}


#: Operations whose ``a`` is this rank's ``m`` rows (the others take ``world * m`` rows).
ROW_SHARDED = ("all_gather_matmul", "matmul_all_gather")


def _inputs(kind: str, dtype, m: int, K: int, N: int, world: int, seed) -> tuple[list, list]:
    """Every rank's (a, b) for ``kind``, scaled so results are O(1)."""
    g = seeded_generator(kind, str(dtype), m, K, N, seed)
    rows = m if kind in ROW_SHARDED else world * m
    a = [torch.randn(rows, K, generator=g) / math.sqrt(K) for _ in range(world)]
    b = [torch.randn(K, N, generator=g) for _ in range(world)]
    return [x.to(dtype) for x in a], [x.to(dtype) for x in b]


def _integer_inputs(kind: str, dtype, m: int, K: int, N: int, world: int, seed) -> tuple[list, list]:
    """Every rank's (a, b) for ``kind`` (K <= 16), of integers 1 to 4: each rank's partial product
    is an integer from K to 16 K, which bf16 holds exactly, and their float32 sum is exact; the sums
    are large enough (around 100 per rank) that a bf16 sum rounded after each addition is off by
    more than one rounding once four ranks add (:func:`_rounded_once`)."""
    assert K <= 16, K  # partial products up to 256: exact in bf16
    g = seeded_generator("integers", kind, str(dtype), m, K, N, seed)
    rows = m if kind in ROW_SHARDED else world * m
    a = [torch.randint(1, 5, (rows, K), generator=g) for _ in range(world)]
    b = [torch.randint(1, 5, (K, N), generator=g) for _ in range(world)]
    return [x.to(dtype) for x in a], [x.to(dtype) for x in b]


def _reference(kind: str, a: list, b: list, rank: int, m: int) -> torch.Tensor:
    if kind == "all_gather_matmul":
        return torch.cat([x.float() for x in a]) @ b[rank].float()
    if kind == "matmul_all_gather":
        return torch.cat([x.float() @ y.float() for x, y in zip(a, b)])
    total = sum(x.float() @ y.float() for x, y in zip(a, b))
    return total[rank * m:(rank + 1) * m] if kind == "matmul_reduce_scatter" else total


def _run(ctx, kind: str, dtype, m: int, K: int, N: int, seed, method,
         inputs=_inputs) -> tuple[torch.Tensor, torch.Tensor]:
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    a, b = inputs(kind, dtype, m, K, N, world, seed)
    rows = m if kind == "matmul_reduce_scatter" else world * m
    out = torch.empty(rows, N, dtype=dtype, device=device)
    getattr(ctx.ops, kind)(out, a[rank].to(device), b[rank].to(device), method=method)
    return out, _reference(kind, a, b, rank, m)


def _close(out: torch.Tensor, expected: torch.Tensor) -> bool:
    return out.shape == expected.shape and torch.allclose(out.float().cpu(), expected, rtol=3e-2, atol=3e-2)


def _rounded_once(out: torch.Tensor, exact: torch.Tensor) -> bool | str:
    """Whether every element of ``out`` is one of the two values of its dtype nearest the float32
    ``exact`` (less than one unit in the last place away): one rounding, to nearest on GPUs,
    towards zero in Triton's interpreter (CPU ranks). Else the largest distance, in units."""
    got = out.float().cpu()
    if got.shape != exact.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(exact.shape)}"
    ulps = (got - exact).abs() / _unit_in_the_last_place(exact, out.dtype)
    return True if bool((ulps < 1).all()) else f"off by up to {float(ulps.max()):.3g} units in the last place"


def _unit_in_the_last_place(x: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of ``dtype``'s values at ``x``'s magnitude (``x`` float32, of normal magnitudes)."""
    _, exponent = torch.frexp(x)  # |x| = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.finfo(dtype).eps * torch.pow(2.0, exponent.float() - 1)


KINDS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


def _check_matrix(ctx, report: RankReport) -> None:
    for m, K, N in SHAPES[ctx.device.type]:
        for dtype in DTYPES:
            for kind in KINDS:
                for method in METHODS:
                    out, expected = _run(ctx, kind, dtype, m, K, N, "matrix", method)
                    report.check(f"matrix/{kind}/{method}/{dtype}/{m}x{K}x{N}", _close(out, expected))


#: Layouts of the fused kernels' operands, by name: how ``a`` and ``b`` are laid out (same values).
#: Descriptors read row-major operands, a column-major ``b`` (a linear layer's weight, transposed)
#: and rows padded to whole 16-byte units; a column stride of 2 takes the plain loop.
LAYOUTS = {
    "row_major": (lambda a: a, lambda b: b),
    "b_column_major": (lambda a: a, lambda b: b.t().contiguous().t()),
    "padded_rows": (lambda a: _padded(a, 8), lambda b: _padded(b, 8)),
    "strided_columns": (lambda a: _every_other_column(a), lambda b: _every_other_column(b)),
}


def _padded(x: torch.Tensor, extra: int) -> torch.Tensor:
    """``x`` in rows of ``extra`` more elements than its columns."""
    wider = torch.zeros(x.shape[0], x.shape[1] + extra, dtype=x.dtype, device=x.device)
    wider[:, :x.shape[1]] = x
    return wider[:, :x.shape[1]]


def _every_other_column(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a column stride of 2."""
    wider = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=x.dtype, device=x.device)
    wider[:, ::2] = x
    return wider[:, ::2]


def _check_layouts(ctx, report: RankReport) -> None:
    """Each fused product of operands of each of :data:`LAYOUTS`, against torch (extents whose rows
    are whole 16-byte units)."""
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    m, K, N = SHAPES[device.type][0]
    assert K % 8 == 0 and N % 8 == 0, (K, N)
    for kind in KINDS:
        a, b = _inputs(kind, torch.bfloat16, m, K, N, world, "layouts")
        expected = _reference(kind, a, b, rank, m)
        for layout, (lay_a, lay_b) in LAYOUTS.items():
            out = torch.empty(expected.shape, dtype=torch.bfloat16, device=device)
            getattr(ctx.ops, kind)(out, lay_a(a[rank].to(device)), lay_b(b[rank].to(device)), method="fused")
            report.check(f"layouts/{kind}/{layout}", _close(out, expected))


def _check_back_to_back(ctx, report: RankReport) -> None:
    """Calls in a row without host synchronisation, alternating shapes and the overlapping methods,
    each with new data."""
    shapes = SHAPES[ctx.device.type]
    pending = []
    for i in range(BACK_TO_BACK[ctx.device.type]):
        kind = KINDS[i % len(KINDS)]
        m, K, N = shapes[-1 - i // len(KINDS) % len(shapes)]  # each operation: the larger shape, then smaller
        method = ("fused", "copy_engine")[i // (len(KINDS) * len(shapes)) % 2]
        pending.append((kind, *_run(ctx, kind, torch.bfloat16, m, K, N, ("b2b", i), method)))
    for kind, out, expected in pending:
        report.check(f"back_to_back/{kind}/{len(report)}", _close(out, expected))
    # No wait gave up (a call whose wait gives up fills its output with NaN and fails the context).
    report.check("back_to_back/no_wait_gave_up", not ctx.failed)


def _check_bad_input(ctx, report: RankReport) -> None:
    device, world = ctx.device, ctx.world_size
    a = torch.randn(world * 4 + 1, 16, device=device, dtype=torch.bfloat16)
    b = torch.randn(16, 16, device=device, dtype=torch.bfloat16)
    out = torch.empty(4, 16, device=device, dtype=torch.bfloat16)
    cases = {
        "rows_not_divisible": (lambda: ctx.ops.matmul_reduce_scatter(out, a, b), "not divisible by the world size"),
        "float32": (lambda: ctx.ops.matmul_reduce_scatter(out, a.float(), b), "has dtype torch.float32"),
        "mixed_dtypes": (lambda: ctx.ops.all_gather_matmul(out, a, b.half()), "use one dtype"),
        "wrong_out_shape": (lambda: ctx.ops.all_gather_matmul(out, a, b), "out has shape"),
        "b_rows": (lambda: ctx.ops.all_gather_matmul(out, a, b[:8]), "b has shape"),
        "vector": (lambda: ctx.ops.matmul_all_reduce(out, a[0], b), "must be a matrix"),
        "out_not_contiguous": (lambda: ctx.ops.matmul_all_reduce(torch.empty(16, a.shape[0], device=device,
                                                                             dtype=a.dtype).t(), a, b),
                               "out is not contiguous"),
        "unknown_method": (lambda: ctx.ops.all_gather_matmul(torch.empty(world * a.shape[0], 16, device=device,
                                                                         dtype=a.dtype), a, b, method="ring"),
                           "is not one of copy_engine, fused, sequential"),
    }
    for name, (call, message) in cases.items():
        try:
            call()
            report.check(f"bad_input/{name}", False)
        except IrisError as error:
            report.check(f"bad_input/{name}", message in str(error))


#: (K steps, parts the last wave is cut into at every world size) of each call of
#: :func:`_check_split_last_wave`, in order (two calls of each; 3 and 4 parts are checked by
#: tests/test_bench_gemm.py, in the same loop).
SPLIT_CALLS = ((11, 2), (8, 2))


def _check_split_last_wave(report: RankReport, device: str) -> None:
    """all_gather_matmul whose last wave is cut along K (:mod:`fused_cases`: a context of its own,
    with few units), of two lengths, back to back with new data each time: the partial sums meet
    in the right tiles and nothing of one call's is left for the next."""
    ctx = with_few_units(iris.create("triton", heap_size="64MiB" if device == "cuda" else "32MiB", device=device))
    world, kind = ctx.world_size, ctx.device.type
    for call, (steps, parts) in enumerate(SPLIT_CALLS):
        report.check(f"split/{call}/cut_into_{parts}", parts_of(kind, world, steps) == parts)
        for repeat in range(2):
            out, expected = _run(ctx, "all_gather_matmul", torch.bfloat16, *cut_shape(kind, world, steps),
                                 ("split", call, repeat), "fused")
            report.check(f"split/{call}/{repeat}", _close(out, expected))
    ctx.barrier()  # raises if the context failed (a device-side wait gave up)
    ctx.destroy()


#: The overlapping methods captured in a CUDA graph, and the replays of each.
GRAPH_METHODS = ("fused", "copy_engine")
GRAPH_REPLAYS = 3


def _check_cuda_graph(ctx, report: RankReport) -> None:
    m, K, N = SHAPES["cuda"][0]
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    for method in GRAPH_METHODS:
        a = torch.empty(m, K, dtype=torch.bfloat16, device=device)
        b = torch.empty(K, N, dtype=torch.bfloat16, device=device)
        out = torch.empty(world * m, N, dtype=torch.bfloat16, device=device)
        ctx.ops.all_gather_matmul(out, a.zero_(), b.zero_(), method=method)  # size the buffers first
        torch.cuda.synchronize(device)
        stream = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            ctx.ops.all_gather_matmul(out, a, b, method=method)
        for replay in range(GRAPH_REPLAYS):
            inputs_a, inputs_b = _inputs("all_gather_matmul", torch.bfloat16, m, K, N, world, ("graph", replay))
            a.copy_(inputs_a[rank])
            b.copy_(inputs_b[rank])
            graph.replay()
            torch.cuda.synchronize(device)
            report.check(f"cuda_graph/{method}/replay{replay}",
                         _close(out, _reference("all_gather_matmul", inputs_a, inputs_b, rank, m)))


def _fused_worker(rank: int, device: str) -> bytes:
    report = RankReport(rank)
    ctx = iris.create("triton", heap_size="1GiB" if device == "cuda" else "32MiB", device=device)
    with report.section("matrix"):
        _check_matrix(ctx, report)
    with report.section("back_to_back"):
        _check_back_to_back(ctx, report)
    with report.section("split"):
        _check_split_last_wave(report, device)
    with report.section("bad_input"):
        _check_bad_input(ctx, report)
    if device == "cuda":
        with report.section("cuda_graph"):
            _check_cuda_graph(ctx, report)
    ctx.barrier()  # raises if the context failed (a device-side wait gave up)
    ctx.destroy()
    return report.packed()


#: The five-rank world's extents (rows per rank m, K, N): none a multiple of the world size, so
#: the rows each rank owns and the reduced segments are odd; K at most 16 for :func:`_integer_inputs`.
WORLD5_SHAPE = (7, 16, 29)
#: Rows of A of a matmul_all_reduce on five ranks that does not divide by the world size (it runs
#: sequentially: an all_reduce of 36 x 29 elements).
WORLD5_UNEVEN_ROWS = 36
#: The operations that add the ranks' products.
REDUCING = ("matmul_reduce_scatter", "matmul_all_reduce")


def _methods(kind: str) -> tuple[str, ...]:
    return ("sequential",) if kind == "matmul_all_gather" else METHODS


def _world5_worker(rank: int, device: str) -> bytes:
    """Each operation by each method once on five ranks, bf16: the gathering ones against the
    float32 reference within :func:`_close`, the reducing ones on :func:`_integer_inputs`, rounded
    once from the exact sum (:func:`_rounded_once`); a matmul_all_reduce of rows that do not divide
    by five (sequential)."""
    report = RankReport(rank)
    ctx = iris.create("triton", heap_size="1GiB" if device == "cuda" else "32MiB", device=device)
    m, K, N = WORLD5_SHAPE
    with report.section("world5"):
        for kind in ROW_SHARDED:
            for method in _methods(kind):
                out, expected = _run(ctx, kind, torch.bfloat16, m, K, N, "world5", method)
                report.check(f"world5/{kind}/{method}", _close(out, expected))
        for kind in REDUCING:
            for method in METHODS:
                out, expected = _run(ctx, kind, torch.bfloat16, m, K, N, "world5", method, inputs=_integer_inputs)
                report[f"world5/rounded_once/{kind}/{method}"] = _rounded_once(out, expected)
        g = seeded_generator("world5", "uneven")
        a = [(torch.randn(WORLD5_UNEVEN_ROWS, K, generator=g) / math.sqrt(K)).to(torch.bfloat16)
             for _ in range(ctx.world_size)]
        b = [torch.randn(K, N, generator=g).to(torch.bfloat16) for _ in range(ctx.world_size)]
        out = torch.empty(WORLD5_UNEVEN_ROWS, N, dtype=torch.bfloat16, device=ctx.device)
        ctx.ops.matmul_all_reduce(out, a[rank].to(ctx.device), b[rank].to(ctx.device))
        report.check("world5/matmul_all_reduce/uneven_rows",
                     _close(out, sum(x.float() @ y.float() for x, y in zip(a, b))))
    with report.section("layouts"):
        _check_layouts(ctx, report)
    with report.section("split"):
        _check_split_last_wave(report, device)
    ctx.barrier()  # raises if the context failed (a device-side wait gave up)
    report.check("world5/no_wait_gave_up", not ctx.failed)
    ctx.destroy()
    return report.packed()


@pytest.fixture(scope="module")
def world5_reports() -> list[dict]:
    device = backend_rank_device("triton", 5)
    return spawn_reports(_world5_worker, 5, device, device=device)


def _world5_names() -> set[str]:
    """The checks of :func:`_world5_worker` on every rank."""
    return {f"world5/{kind}/{method}" for kind in ROW_SHARDED for method in _methods(kind)} | {
        f"world5/rounded_once/{kind}/{method}" for kind in REDUCING for method in METHODS} | {
        "world5/matmul_all_reduce/uneven_rows", "world5/no_wait_gave_up", "world5/completed"}


def test_world5_every_operation_and_method_matches_torch(world5_reports):
    assert_rank_checks(world5_reports, "world5/", _world5_names())


def test_world5_16_bit_sums_are_rounded_once_by_every_method(world5_reports):
    # The partial products are exact, so every method's only rounding is the last one: a sum
    # rounded to bf16 after each addition (one rounding per rank) is off by up to 1.5 units here.
    assert_rank_checks(world5_reports, "world5/rounded_once/", {
        f"world5/rounded_once/{kind}/{method}" for kind in REDUCING for method in METHODS})


def test_sum_partials_adds_in_float32_and_rounds_once(ctx):
    # The copy-engine method's reduction, on its own: eight parts (a world of eight), one of them
    # this rank's own product, in bf16 and fp16; exact integer parts, so the float32 sum is exact.
    # The same check fails for a sum rounded after each addition (the data shows per-step rounding).
    from iris_triton.operations.copy_engine import sum_partials

    g = seeded_generator("sum_partials")
    for dtype, high in ((torch.bfloat16, 256), (torch.float16, 2048)):
        parts = torch.randint(high // 2, high + 1, (8, 5, 37), generator=g).to(dtype).to(ctx.device)
        own = torch.randint(high // 2, high + 1, (5, 37), generator=g).to(dtype).to(ctx.device)
        exact = parts.float().cpu()
        exact[3] = own.float().cpu()
        exact = exact.sum(0)
        out = torch.full_like(own, 7)
        assert sum_partials(out, own, parts, 3) is out
        assert _rounded_once(out, exact) is True, dtype
        stepwise = torch.zeros_like(own)
        for k in range(8):
            stepwise.add_(own if k == 3 else parts[k])
        assert _rounded_once(stepwise, exact) is not True, dtype
        sum_partials(own, own, parts, 3)  # in place: out is own
        assert torch.equal(own, out), dtype


#: Two calls per operation, the second smaller (rows per rank m, K, N).
SHRINKING = {"all_gather_matmul": ((21, 40, 8), (5, 16, 8)), "matmul_reduce_scatter": ((21, 16, 40), (10, 16, 50))}


SLOW_PEER_METHODS = ("fused", "copy_engine")


def _slow_peer_worker(rank: int) -> dict[tuple[str, str], list[bool]]:
    """Per operation of SHRINKING and overlapping method, in a context of its own: the operation
    twice, the second call smaller, with rank 0 held up in its first waits (after it sent its
    data, while it still reads what it received): rank 1's second call must not write where rank
    0 still reads. ``{(kind, method): [first call right, second call right]}``."""
    import time

    from iris_triton.operations import copy_engine
    from iris_triton.operations import fused

    waits = []

    def held_up(original):
        def wait(*args, **kwargs):
            waits.append(1)
            if rank == 0 and len(waits) <= 4:
                time.sleep(0.75)
            return original(*args, **kwargs)
        return wait

    fused.wait_for_peer_call = held_up(fused.wait_for_peer_call)
    copy_engine.wait_or_record = held_up(copy_engine.wait_or_record)
    copy_engine.wait_for_peer_call = held_up(copy_engine.wait_for_peer_call)
    results = {}
    for kind, shapes in SHRINKING.items():
        for method in SLOW_PEER_METHODS:
            ctx = iris.create("triton", heap_size="32MiB", device="cpu")
            waits.clear()  # each pair's first waits are held up
            results[kind, method] = []
            for m, K, N in shapes:
                a, b = _inputs(kind, torch.bfloat16, m, K, N, ctx.world_size, "slow peer")
                rows = ctx.world_size * m if kind == "all_gather_matmul" else m
                out = torch.empty(rows, N, dtype=torch.bfloat16)
                getattr(ctx.ops, kind)(out, a[rank], b[rank], method=method)
                results[kind, method].append(_close(out, _reference(kind, a, b, rank, m)))
            ctx.barrier()
            ctx.destroy()
    return results


@pytest.fixture(scope="module")
def slow_peer_results() -> list[dict[tuple[str, str], list[bool]]]:
    """Every rank's results of :func:`_slow_peer_worker`, from one spawn of 2 CPU ranks."""
    return iris.spawn(_slow_peer_worker, 2, device=interpreted_device(), start_method="forkserver")


@pytest.mark.parametrize("method", SLOW_PEER_METHODS)
@pytest.mark.parametrize("kind", list(SHRINKING))
def test_a_smaller_call_never_overwrites_what_a_slow_peer_still_reads(slow_peer_results, kind, method):
    assert [results[kind, method] for results in slow_peer_results] == [[True, True]] * 2


@pytest.fixture(scope="module", params=[2, 3], ids=lambda world: f"world{world}")
def reports(request) -> list[dict]:
    device = backend_rank_device("triton", request.param)
    return spawn_reports(_fused_worker, request.param, device, device=device)


def _device_type(reports) -> str:
    """Where the ranks of ``reports`` ran, as the fixture chose (a GPU per rank, else CPU ranks)."""
    return "cuda" if torch.cuda.device_count() >= len(reports) else "cpu"


def test_every_method_matches_torch(reports):
    assert_rank_checks(reports, "matrix/", {
        f"matrix/{kind}/{method}/{dtype}/{m}x{K}x{N}" for m, K, N in SHAPES[_device_type(reports)] for dtype in DTYPES
        for kind in KINDS for method in METHODS} | {"matrix/completed"})


def test_fused_products_of_every_layout_match_torch(world5_reports):
    assert_rank_checks(world5_reports, "layouts/", _layouts_names())


def _layouts_names() -> set[str]:
    return {f"layouts/{kind}/{layout}" for kind in KINDS for layout in LAYOUTS} | {"layouts/completed"}


def test_fused_kernels_read_by_descriptors_where_the_layouts_allow():
    # Tensor descriptors need a 16-byte aligned base, unit last strides and the other strides in
    # whole 16-byte units; anything else takes the plain loop (TMA=False).
    from iris_triton.operations.gemm import descriptors

    tile = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)
    a = torch.zeros(2, 8, 32, dtype=torch.bfloat16)
    a_form = ((1, 2, 8, 32), (512, 256, 32, 1))
    b = torch.zeros(32, 24, dtype=torch.bfloat16)
    row_major = descriptors(a, *a_form, b, tile)
    assert row_major["TMA"] and not row_major["B_COLUMN_MAJOR"]
    assert row_major["b_desc"].block_shape == [16, 16] and row_major["a_desc"].shape == [1, 2, 8, 32]
    weight = torch.zeros(24, 32, dtype=torch.bfloat16)  # N x K: its transpose is a column-major B
    column_major = descriptors(a, *a_form, weight.t(), tile)
    assert column_major["TMA"] and column_major["B_COLUMN_MAJOR"]
    assert column_major["b_desc"].shape == [24, 32]
    odd = torch.zeros(32, 25, dtype=torch.bfloat16)[:, :25]  # rows of 50 bytes
    misaligned = torch.zeros(32 * 24 + 1, dtype=torch.bfloat16)[1:].view(32, 24)
    strided = torch.zeros(32, 48, dtype=torch.bfloat16)[:, ::2]
    for plain_b in (odd, misaligned, strided):
        assert descriptors(a, *a_form, plain_b, tile) == dict(a_desc=None, b_desc=None, TMA=False,
                                                               B_COLUMN_MAJOR=False)
    assert not descriptors(a, (1, 2, 8, 31), (496, 248, 31, 1), b, tile)["TMA"]  # rows of A of 62 bytes


def test_back_to_back_calls_see_no_stale_data(reports):
    # Per rank: each call (named by its place in the report), back_to_back/no_wait_gave_up and
    # back_to_back/completed.
    assert_rank_checks(reports, "back_to_back/", (BACK_TO_BACK[_device_type(reports)] + 2) * len(reports))


def _split_names() -> set[str]:
    return {f"split/{call}/{check}" for call, (_, parts) in enumerate(SPLIT_CALLS)
            for check in (f"cut_into_{parts}", 0, 1)} | {"split/completed"}


def test_a_last_wave_cut_along_k_matches_torch(reports):
    assert_rank_checks(reports, "split/", _split_names())


def test_a_last_wave_cut_along_k_matches_torch_on_five_ranks(world5_reports):
    assert_rank_checks(world5_reports, "split/", _split_names())


@pytest.mark.parametrize(("tiles", "programs", "steps", "parts", "grid", "slots"), [
    (320, 132, 128, 2, 132, 56),  # QKV at 2,048 rows on an H100's 132 programs: 2 waves and 56 tiles
    (320, 124, 128, 1, 124, 0),  # beside the all-gather's pushing kernel: 72 tiles, two rounds of any cut
    (264, 132, 128, 1, 132, 0),  # whole waves
    (250, 132, 128, 1, 132, 0),  # a last wave of 118 tiles: two rounds of any cut
    (7168, 132, 128, 1, 132, 0),  # MLP up at 8,192 rows: 55 waves, a cut (in 3) would save under 1%
    (9, 8, 25, 4, 8, 3),  # a last wave of 1 tile: 4 parts in one round
    (320, 132, 7, 1, 132, 0),  # too few K steps for two parts of 4
    (56, 132, 128, 2, 132, 56),  # one partial wave, cut: every program launched
    (56, 132, 7, 1, 56, 0),  # one partial wave, not cut: a program per tile
])
def test_a_last_wave_is_cut_where_it_pays(tiles, programs, steps, parts, grid, slots):
    assert split_parts(tiles, programs, steps) == parts
    assert split_launch(tiles, programs, steps) == (parts, grid)
    assert split_slots(tiles, grid, parts) == slots


def test_bad_input_is_rejected_clearly(reports):
    assert_rank_checks(reports, "bad_input/", {f"bad_input/{case}" for case in (
        "rows_not_divisible", "float32", "mixed_dtypes", "wrong_out_shape", "b_rows", "vector", "out_not_contiguous",
        "unknown_method", "completed")})


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay(reports):
    if _device_type(reports) != "cuda":
        pytest.skip("CUDA graphs need GPU ranks")
    assert_rank_checks(reports, "cuda_graph/", {f"cuda_graph/{method}/replay{replay}" for method in GRAPH_METHODS
                                                for replay in range(GRAPH_REPLAYS)} | {"cuda_graph/completed"})


@pytest.mark.parametrize("layer, m, K, N, overlap", [
    ("QKV at M=8192", 8192 // 2, 8192, 5120, True),  # all_gather_matmul: rows per rank, K, N
    ("MLP up at M=8192", 8192 // 2, 8192, 28672, True),
    ("a product too long to hide anything", 64, 65536, 65536, False),
])
def test_automatic_choice_overlaps_where_there_is_communication_to_hide(layer, m, K, N, overlap):
    # all_gather_matmul on 2 ranks: the copy engines run when the communication's estimated share
    # of the product is large enough to be worth splitting the product for. The choice itself, as a
    # GPU context makes it (no GPU needed: it reads only the device type).
    from types import SimpleNamespace

    from iris_triton.operations.fused_ops import FusedOps

    flops, sent = 2 * 2 * m * N * K, m * K * 2
    gpu_context = SimpleNamespace(device=torch.device("cuda", 0), kernel_device_type="cuda",
                                  debug=lambda message: None, tuning=SimpleNamespace(entries={}),
                                  world_size=2)  # nothing tuned
    chosen = FusedOps._method(SimpleNamespace(_context=gpu_context), "all_gather_matmul", None, flops, sent,
                              torch.bfloat16, (N, K, m))
    assert chosen == ("copy_engine" if overlap else "sequential"), communication_share(flops, sent)
    assert (communication_share(flops, sent) >= COPY_ENGINE_MIN_SHARE) == overlap


def test_the_patterns_example_runs_and_checks_itself():
    # GEMM + all-scatter written with the device API, producer/consumer (fused kernels and copy
    # engines) and bulk-synchronous, each compared with torch by the example itself (exit status 1
    # when any is wrong).
    import subprocess
    import sys
    from pathlib import Path

    rank_device(2)  # the example's ranks: 2 GPUs, else CPU ranks (skips where the interpreter cannot run them)
    example = Path(__file__).resolve().parent.parent / "examples" / "fused_patterns.py"
    proc = subprocess.run([sys.executable, str(example), "--m", "20", "--k", "32", "--n", "24"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count(" correct ") == 4, proc.stdout
