"""Uneven all-to-all (``ctx.ccl.all_to_all_single`` with split sizes, ``ctx.ccl.all_to_all_vdev``)
across real CPU ranks, against ``torch.distributed.all_to_all_single`` on gloo in the same workers.

One spawn per world size (2 and 3) makes every check: split matrices drawn from a seed every rank
shares (random, with zero splits, every row to one rank, nothing at all, equal splits on one side
or both), 1-, 2- and 3-dimensional tensors, each dtype, heap and plain tensors; back-to-back calls
with changing splits; calls the host refuses; and calls that the device fails (bound exceeded,
different bounds, counts beyond the input, unmatched output sizes, a captured call that does not
fit its workspace), each on a fresh context since a failed one stays failed. Each rank returns
``{check name: True | False | error text}``.

Two worlds cover the split arithmetic: the split matrices are drawn per world, and on 3 ranks
they already hold rows and columns of different sums, zero splits beside non-zero ones, a rank
that receives from every peer and a rank that sends nothing (offsets into the input and the
output summed over more than one peer); 2 ranks is the one even world. A world of 4 runs the
same kernels and host checks with one more row and column of the same matrices.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import iris
import iris.collectives.workspaces as workspaces_module
from iris.collectives import SUPPORTED_DTYPES
from iris.errors import IrisError
from iris.testing import RankReport, assert_rank_checks, interpreted_device, seeded_generator, spawn_reports

#: float32, bfloat16, int32, and the 1-byte types where the collectives take them.
DTYPES = (torch.float32, torch.bfloat16, torch.int32) + tuple(
    d for d in (torch.int8, torch.float8_e4m3fn) if d in SUPPORTED_DTYPES)
#: Each case's shape after dim 0, by case index (cycled).
ROW_SHAPES = ((), (3,), (2, 2))
#: Split cases: (name, which sides pass None).
CASES = (("random", ()), ("zero_splits", ()), ("all_to_one_rank", ()), ("nothing", ()),
         ("equal_input", ("input",)), ("equal_output", ("output",)), ("equal_both", ("input", "output")))
BACK_TO_BACK = 8
#: Elements' bits as gloo moves them where it takes no such dtype.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _matrix(case: str, world: int, *seed) -> torch.Tensor:
    """``[source, destination]`` rows, the same on every rank."""
    g = seeded_generator(case, world, *seed)
    s = torch.randint(0, 5, (world, world), generator=g)
    if case == "zero_splits":
        s[0, :] = 0  # rank 0 sends nothing
        s[:, world - 1] = 0  # the last rank receives nothing
        s[torch.rand(world, world, generator=g) < 0.3] = 0
    elif case == "all_to_one_rank":
        s[:, [d for d in range(world) if d != 1 % world]] = 0
        s[:, 1 % world] += 1
    elif case == "nothing":
        s.zero_()
    elif case == "equal_input":
        s = s[:, :1].expand(world, world).clone()
    elif case == "equal_output":
        s = s[:1, :].expand(world, world).clone()
    elif case == "equal_both":
        s.fill_(int(s[0, 0]) + 1)
    return s


def _data(dtype: torch.dtype, shape, *seed) -> torch.Tensor:
    g = seeded_generator(*seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def _gloo(out: torch.Tensor, x: torch.Tensor, output_splits, input_splits) -> torch.Tensor:
    """torch.distributed's all_to_all_single (gloo) of ``x`` into ``out`` (by bits where gloo has
    no such dtype)."""
    if x.dtype in (torch.float32, torch.bfloat16, torch.int32, torch.int8):
        dist.all_to_all_single(out, x, output_splits, input_splits)
    else:
        bits = _BITS[x.element_size()]
        dist.all_to_all_single(out.view(bits), x.view(bits), output_splits, input_splits)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(_BITS.get(a.element_size(), a.dtype)),
                                                                      b.view(_BITS.get(b.element_size(), b.dtype)))


class _Tensors:
    """Inputs and outputs of one call, plain or in heap buffers the same size on every rank
    (a rank's rows are a view of them): the heap's allocations must match between ranks."""

    def __init__(self, ctx, on_heap: bool):
        self.ctx, self.on_heap, self.kept = ctx, on_heap, []

    def make(self, values: torch.Tensor, most_rows: int) -> torch.Tensor:
        if not self.on_heap:
            return values.to(self.ctx.device).clone()
        buffer = self.ctx.empty((most_rows + 1, *values.shape[1:]), dtype=values.dtype)
        self.kept.append(buffer)
        view = buffer[:values.shape[0]]
        view.copy_(values.to(self.ctx.device))
        return view

    def free(self) -> None:
        self.ctx.barrier()  # no peer still reads them
        while self.kept:
            self.ctx.free(self.kept.pop())


def _dtypes_of(case_index: int) -> tuple[torch.dtype, ...]:
    """Every dtype for the first case; float32 and one other, in turn, for the others (the
    interpreter is slow: each call costs)."""
    if case_index == 0:
        return DTYPES
    return DTYPES[0], DTYPES[1 + case_index % (len(DTYPES) - 1)]


def _check_matrix(ctx, report: RankReport) -> None:
    rank, world = ctx.rank, ctx.world_size
    for index, (case, nones) in enumerate(CASES):
        s = _matrix(case, world)
        sends, receives = s[rank].tolist(), s[:, rank].tolist()
        most = int(max(s.sum(1).max(), s.sum(0).max()))
        row_shape = ROW_SHAPES[index % len(ROW_SHAPES)]
        for d, dtype in enumerate(_dtypes_of(index)):
            name = f"{case}/{str(dtype).removeprefix('torch.')}/rows{'x'.join(map(str, row_shape)) or '1'}"
            tensors = _Tensors(ctx, on_heap=(index + d) % 2 == 0)
            x_values = _data(dtype, (sum(sends), *row_shape), rank, case, str(dtype))
            expected = _gloo(torch.empty((sum(receives), *row_shape), dtype=dtype), x_values, receives, sends)
            x = tensors.make(x_values, most)
            out = tensors.make(torch.full((sum(receives), *row_shape), 3).to(dtype), most)
            ctx.ccl.all_to_all_single(out, x, None if "output" in nones else receives,
                                      None if "input" in nones else sends)
            report.check(f"single/{name}", _same_bits(out.cpu(), expected))
            if not nones:
                bound = most + 1  # the same on every rank
                untouched = torch.full((bound, *row_shape), 7).to(dtype)
                out = tensors.make(untouched, bound)
                counts = torch.full((world,), -5, dtype=torch.int64, device=ctx.device)
                returned = ctx.ccl.all_to_all_vdev(out, x, torch.tensor(sends, device=ctx.device), counts)
                got, out = sum(receives), out.cpu()
                report.check(f"vdev/{name}", _same_bits(out[:got], expected))
                report.check(f"vdev/{name}/counts", returned is counts and counts.tolist() == receives)
                report.check(f"vdev/{name}/rows_after_untouched", _same_bits(out[got:], untouched[got:]))
            tensors.free()
    report.check("single/no_wait_failed", not ctx.failed)


def _check_back_to_back(ctx, report: RankReport) -> None:
    """Calls in a row with changing splits, kinds and row shapes, nothing between them: a table
    slot or receive region overwritten too early would show as a wrong result."""
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    calls = []
    for i in range(BACK_TO_BACK):
        s = _matrix("random", world, "b2b", i)
        sends, receives = s[rank].tolist(), s[:, rank].tolist()
        row_shape = ROW_SHAPES[i % len(ROW_SHAPES)]
        x = _data(torch.float32, (sum(sends), *row_shape), rank, "b2b", i).to(device)
        if i % 2:
            out = torch.empty((int(s.sum(0).max()), *row_shape), device=device)
            counts = torch.zeros(world, dtype=torch.int64, device=device)
            ctx.ccl.all_to_all_vdev(out, x, torch.tensor(sends, device=device), counts)
        else:
            out, counts = torch.empty((sum(receives), *row_shape), device=device), None
            ctx.ccl.all_to_all_single(out, x, receives, sends)
        calls.append((x, out, counts, sends, receives))
    for i, (x, out, counts, sends, receives) in enumerate(calls):
        expected = _gloo(torch.empty((sum(receives), *x.shape[1:])), x.cpu(), receives, sends)
        kind = "vdev" if counts is not None else "single"
        ok = torch.equal(out[:sum(receives)].cpu(), expected) and (counts is None or counts.tolist() == receives)
        report.check(f"back_to_back/{i}/{kind}", ok)


def _check_cuda_graph(ctx, report: RankReport) -> None:
    """Both collectives captured in one CUDA graph after an eager call of each, replayed with new
    data; the device counts of all_to_all_vdev change between replays (the host's split sizes of
    a captured all_to_all_single are fixed)."""
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    s = _matrix("random", world, "graph")
    sends, receives = s[rank].tolist(), s[:, rank].tolist()
    x = torch.zeros(sum(sends), 4, device=device)
    out = torch.zeros(sum(receives), 4, device=device)
    most = 4 * world  # splits are below 5: no rank sends or receives more rows
    xv, outv = torch.zeros(most, 4, device=device), torch.zeros(most + 1, 4, device=device)
    counts_in = torch.tensor(sends, device=device)
    counts_out = torch.zeros(world, dtype=torch.int64, device=device)
    ctx.ccl.all_to_all_single(out, x, receives, sends)
    ctx.ccl.all_to_all_vdev(outv, xv, counts_in, counts_out)
    torch.cuda.synchronize(device)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        ctx.ccl.all_to_all_single(out, x, receives, sends)
        ctx.ccl.all_to_all_vdev(outv, xv, counts_in, counts_out)
    ok = True
    for replay in range(3):
        sv = _matrix("random", world, "graph", replay)
        sends_v, receives_v = sv[rank].tolist(), sv[:, rank].tolist()
        data = _data(torch.float32, (sum(sends), 4), rank, "graph", replay)
        data_v = _data(torch.float32, (sum(sends_v), 4), rank, "graph_v", replay)
        x.copy_(data)
        xv[:sum(sends_v)].copy_(data_v)
        counts_in.copy_(torch.tensor(sends_v))
        ctx.barrier()
        graph.replay()
        torch.cuda.synchronize(device)
        expected = _gloo(torch.empty(sum(receives), 4), data, receives, sends)
        expected_v = _gloo(torch.empty(sum(receives_v), 4), data_v, receives_v, sends_v)
        ok &= torch.equal(out.cpu(), expected) and torch.equal(outv[:sum(receives_v)].cpu(), expected_v)
        ok &= counts_out.tolist() == receives_v
    report.check("cuda_graph/replays_match_torch", ok)


def _raises(call, *fragments) -> bool | str:
    """True when ``call()`` raises an IrisError (or TypeError) whose message holds every fragment."""
    try:
        call()
    except (IrisError, TypeError) as error:
        missing = [f for f in fragments if f not in str(error)]
        return True if not missing else f"message {str(error)!r} lacks {missing}"
    return "did not raise"


def _check_host_errors(ctx, report: RankReport) -> None:
    """Calls the host refuses on every rank, before any exchange (so every rank refuses alike)."""
    world, device = ctx.world_size, ctx.device
    x, out = torch.ones(world, 3, device=device), torch.empty(world, 3, device=device)
    ones = [1] * world
    single = ctx.ccl.all_to_all_single
    cases = {
        "length": (lambda: single(out, x, ones, ones + [0]), "input_split_sizes has", f"one per rank ({world})"),
        "negative": (lambda: single(out, x, ones, [2, -1] + [1] * (world - 2)), "negative entry"),
        "input_sum": (lambda: single(out, x, ones, [2] + [1] * (world - 1)), f"adds up to {world + 1} rows",
                      f"input has {world}"),
        "output_sum": (lambda: single(out, x, [0] * world, ones), "output_split_sizes", "adds up to 0 rows"),
        "not_ints": (lambda: single(out, x, ones, [1.5] * world), "must be a list of ints"),
        "rows": (lambda: single(torch.empty(world, 4, device=device), x, ones, ones), "a row of input",
                 "has 3 elements"),
        "equal_split_of_odd_rows": (lambda: single(torch.empty(world + 1, 3, device=device),
                                                   torch.ones(world + 1, 3, device=device), ones, None),
                                    "not divisible by the world size"),
        "dtype": (lambda: single(out.int(), x, ones, ones), "differs from input dtype"),
        "zero_dims": (lambda: single(torch.empty((), device=device), torch.ones((), device=device), ones, ones),
                      "0-dimensional"),
        "vdev_count_dtype": (lambda: ctx.ccl.all_to_all_vdev(out, x, torch.ones(world, dtype=torch.int32,
                                                                                 device=device),
                                                             torch.zeros(world, dtype=torch.int64, device=device)),
                             "input_splits has dtype torch.int32"),
        "vdev_count_shape": (lambda: ctx.ccl.all_to_all_vdev(out, x, torch.ones(world, dtype=torch.int64,
                                                                                 device=device),
                                                             torch.zeros(world + 1, dtype=torch.int64,
                                                                         device=device)),
                             "output_splits has shape"),
        "vdev_counts_overlap": (lambda: (lambda c: ctx.ccl.all_to_all_vdev(out, x, c, c))(
            torch.ones(world, dtype=torch.int64, device=device)), "overlap in memory"),
    }
    for name, (call, *fragments) in cases.items():
        report.check(f"host_errors/{name}", _raises(call, *fragments))
    report.check("host_errors/context_still_usable", not ctx.failed)


def _fails_on_device(ctx, call, output, counts, *fragments) -> bool | str:
    """``call()`` fails the context at the call (CPU ranks) with a message holding ``fragments``,
    ``output`` all NaN and ``counts`` (if any) all -1."""
    outcome = _raises(call, *fragments)
    if outcome is not True:
        return outcome
    if not bool(torch.isnan(output).all()):
        return f"output not poisoned: {output.flatten()[:8].tolist()}"
    if counts is not None and counts.tolist() != [-1] * ctx.world_size:
        return f"counts not poisoned: {counts.tolist()}"
    return ctx.failed or "the context did not fail"


def _check_device_errors(report: RankReport, rank: int) -> None:
    """Calls whose splits only the device can judge: each fails on every rank alike, without
    waiting for a timeout (every rank reads the same table), on a fresh context each."""

    def fresh():
        return iris.create("triton", heap_size="8MiB", device="cpu", timeout=30)

    ctx = fresh()
    world = ctx.world_size
    s = _matrix("random", world, "device_errors")
    s[:, 0] += 10  # rank 0 receives the most rows, by far
    sends = s[rank].tolist()
    x = torch.randn(sum(sends), 2)
    bound = int(s.sum(0).max()) - 1  # too small for rank 0 only, the same on every rank
    out, counts = torch.zeros(bound, 2), torch.zeros(world, dtype=torch.int64)
    report.check("device_errors/bound_exceeded", _fails_on_device(
        ctx, lambda: ctx.ccl.all_to_all_vdev(out, x, torch.tensor(sends), counts), out, counts,
        "all_to_all_vdev", "more rows than their output holds", "[0]"))
    ctx.destroy()

    ctx = fresh()
    big = int(s.sum(0).max()) + world
    ctx.ccl.all_to_all_vdev(torch.zeros(big, 2), x, torch.tensor(sends), counts)  # grows the workspace for all
    out = torch.zeros(big - rank, 2)
    report.check("device_errors/different_bounds", _fails_on_device(
        ctx, lambda: ctx.ccl.all_to_all_vdev(out, x, torch.tensor(sends), counts), out, counts,
        "another number of rows than this rank's"))
    ctx.destroy()

    ctx = fresh()
    beyond = list(sends)
    if rank == 0:
        beyond[0] += 1  # one row more than rank 0's input has
    elif rank == 1:
        beyond[0], beyond[1] = -1, beyond[1] + beyond[0] + 1
    out = torch.zeros(big, 2)
    report.check("device_errors/counts_beyond_the_input", _fails_on_device(
        ctx, lambda: ctx.ccl.all_to_all_vdev(out, x, torch.tensor(beyond), counts), out, counts,
        "negative or add up to more rows than their input has", "[0, 1]"))
    ctx.destroy()

    ctx = fresh()
    receives = s[:, rank].tolist()
    wrong = list(receives)
    if rank == 0:  # as many rows in all, but one more from rank 0 and one fewer from rank 1
        wrong[0], wrong[1] = wrong[0] + 1, wrong[1] - 1
    out = torch.zeros(sum(receives), 2)
    report.check("device_errors/unmatched_output_split_sizes", _fails_on_device(
        ctx, lambda: ctx.ccl.all_to_all_single(out, x, wrong, sends), out, None,
        "differ from the rows their peers send them", "[0]"))
    ctx.destroy()

    ctx = fresh()
    flat = torch.randn(sum(sends))
    ctx.ccl.all_to_all_single(torch.zeros(sum(receives)), flat, receives, sends)  # sizes the workspace: 1 per row
    workspaces_module.capturing = lambda device_type: True  # as during a CUDA graph capture
    try:
        report.check("device_errors/captured_split_sizes_seen_before", _raises(
            lambda: ctx.ccl.all_to_all_single(torch.zeros(sum(receives) + world), torch.randn(sum(sends) + world),
                                              [r + 1 for r in receives], [t + 1 for t in sends]),
            "were not used by an eager call before this CUDA graph capture"))
        wide = torch.randn(sum(sends), 64)
        out = torch.zeros(sum(receives), 64)
        report.check("device_errors/captured_call_larger_than_its_workspace", _fails_on_device(
            ctx, lambda: ctx.ccl.all_to_all_single(out, wide, receives, sends), out, None,
            "more rows than the receive workspace holds", "before capturing"))
    finally:
        workspaces_module.capturing = lambda device_type: False
    ctx.destroy()


def _worker(rank: int, backend: str = "triton", device: str = "cpu") -> bytes:
    """Every check on one rank; those of device failures on CPU ranks, where the failing call
    itself raises (on GPUs the next iris call does)."""
    report = RankReport(rank)
    ctx = iris.create(backend, heap_size="16MiB", device=device)
    with report.section("matrix"):
        _check_matrix(ctx, report)
    with report.section("back_to_back"):
        _check_back_to_back(ctx, report)
    with report.section("host_errors"):
        _check_host_errors(ctx, report)
    if device == "cuda":
        with report.section("cuda_graph"):
            _check_cuda_graph(ctx, report)
    ctx.barrier()
    ctx.destroy()
    if device == "cpu":
        with report.section("device_errors"):
            _check_device_errors(report, rank)
    return report.packed()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda world: f"world{world}")
def reports(request) -> list[dict]:
    return spawn_reports(_worker, request.param, device=interpreted_device("triton"))


def test_all_to_all_single_matches_torch(reports):
    calls = sum(len(_dtypes_of(i)) for i in range(len(CASES)))
    # Per rank: one check per call, and single/no_wait_failed.
    assert_rank_checks(reports, "single/", (calls + 1) * len(reports))


def test_all_to_all_vdev_matches_torch_and_reports_the_counts(reports):
    calls = sum(len(_dtypes_of(i)) for i, (_, nones) in enumerate(CASES) if not nones)
    # Per call: the rows, the counts, the rows after the received ones untouched.
    assert_rank_checks(reports, "vdev/", 3 * calls * len(reports))


def test_back_to_back_calls_with_changing_splits(reports):
    assert_rank_checks(reports, "back_to_back/", {f"back_to_back/{i}/{'vdev' if i % 2 else 'single'}"
                                                  for i in range(BACK_TO_BACK)} | {"back_to_back/completed"})


def test_bad_split_sizes_are_refused_on_the_host(reports):
    refused = ("length", "negative", "input_sum", "output_sum", "not_ints", "rows", "equal_split_of_odd_rows", "dtype",
               "zero_dims", "vdev_count_dtype", "vdev_count_shape", "vdev_counts_overlap")
    assert_rank_checks(reports, "host_errors/", {f"host_errors/{name}" for name in refused} | {
        "host_errors/context_still_usable", "host_errors/completed"})


def test_splits_that_do_not_fit_fail_the_call_on_the_device(reports):
    assert_rank_checks(reports, "device_errors/", {f"device_errors/{name}" for name in (
        "bound_exceeded", "different_bounds", "counts_beyond_the_input", "unmatched_output_split_sizes",
        "captured_split_sizes_seen_before", "captured_call_larger_than_its_workspace", "completed")})
