"""iris inside PyTorch programs: ``torch.compile`` without graph breaks, the functional forms,
the custom operators' fake implementations, asynchronous handles, and CUDA graphs.

One spawn of two CPU ranks runs a small tensor-parallel MLP (column-parallel first layer by
``ctx.ops.all_gather_matmul``, row-parallel second by ``ctx.ops.matmul_reduce_scatter``, an
``all_reduce`` of its statistics) compiled with ``fullgraph=True``, against an eager float32
reference computed from every rank's seeded weights, and every other check. On a GPU, the
operators compile with inductor and replay inside a ``torch.cuda.CUDAGraph``, in one process
(world size 1) and with two ranks sharing the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

import iris
import iris.functional as F
from iris.testing import RankReport, assert_rank_checks, interpreted_device, run_sharing_one_gpu, seeded_generator, \
    spawn_reports
from iris.calls.work import CompletedWork

#: Rows of activations per rank, model width, hidden width (divisible by 2 ranks).
M, D, H = 4, 24, 32
DTYPE = torch.float16


def _close(got: torch.Tensor, expected: torch.Tensor, tolerance: float = 3e-2) -> bool:
    got, expected = got.detach().float().cpu(), expected.detach().float().cpu()
    return got.shape == expected.shape and torch.allclose(got, expected, rtol=tolerance, atol=tolerance)


def _model(world: int, seed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole input ``X`` ((world * M) x D) and weights ``W1`` (D x H), ``W2`` (H x D), fp16."""
    g = seeded_generator("tp_mlp", world, seed)
    x = torch.randn(world * M, D, generator=g)
    w1 = torch.randn(D, H, generator=g) / math.sqrt(D)
    w2 = torch.randn(H, D, generator=g) / math.sqrt(H)
    return x.to(DTYPE), w1.to(DTYPE), w2.to(DTYPE)


def _shards(world: int, rank: int, seed, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's rows of X, columns of W1 and rows of W2."""
    x, w1, w2 = _model(world, seed)
    h = H // world
    return (x[rank * M:(rank + 1) * M].to(device), w1[:, rank * h:(rank + 1) * h].contiguous().to(device),
            w2[rank * h:(rank + 1) * h].contiguous().to(device))


def _reference(world: int, rank: int, seed) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of ``relu(X @ W1) @ W2`` and the column sums of its squares over all rows."""
    x, w1, w2 = (t.float() for t in _model(world, seed))
    y = torch.relu(x @ w1) @ w2
    return y[rank * M:(rank + 1) * M], (y ** 2).sum(0)


def tp_mlp(ctx, x_shard, w1_shard, w2_shard):
    """The MLP, written with the in-place methods as an eager program would be."""
    world = ctx.world_size
    h = torch.empty(world * x_shard.shape[0], w1_shard.shape[1], dtype=x_shard.dtype, device=x_shard.device)
    ctx.ops.all_gather_matmul(h, x_shard, w1_shard)
    h = torch.relu(h)
    y = torch.empty(x_shard.shape[0], w2_shard.shape[1], dtype=x_shard.dtype, device=x_shard.device)
    ctx.ops.matmul_reduce_scatter(y, h, w2_shard)
    stats = (y.float() ** 2).sum(0)
    ctx.ccl.all_reduce(stats)
    return y, stats


def _compile_counting(fn, backend: str):
    """``torch.compile(fn, fullgraph=True)`` and the counter of the frames it compiled."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend(backend)
    return torch.compile(fn, fullgraph=True, backend=counter), counter


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


# -- two CPU ranks ------------------------------------------------------------------------------------------


#: Calls of the compiled MLP, each with new data.
MLP_CALLS = 2


def _check_compiled_mlp(ctx, report: RankReport) -> None:
    world, rank = ctx.world_size, ctx.rank
    compiled, counter = _compile_counting(lambda *a: tp_mlp(ctx, *a), "aot_eager")
    breaks_before = _graph_breaks()
    for seed in range(MLP_CALLS):  # a second call with new data reuses the graph
        y, stats = compiled(*_shards(world, rank, seed, ctx.device))
        y_ref, stats_ref = _reference(world, rank, seed)
        report.check(f"mlp/compiled/output/{seed}", _close(y, y_ref))
        report.check(f"mlp/compiled/all_reduced_stats/{seed}", _close(stats, stats_ref, 5e-2))
    report.check("mlp/compiled/one_graph", counter.frame_count == 1)
    report.check("mlp/compiled/no_graph_break", _graph_breaks() == breaks_before)
    graph = counter.graphs[0].code if counter.graphs else ""
    report.check("mlp/compiled/graph_calls_the_operators",
                 all(f"iris.{name}" in graph for name in ("all_gather_matmul", "matmul_reduce_scatter",
                                                           "all_reduce")))
    y, stats = tp_mlp(ctx, *_shards(world, rank, 5, ctx.device))  # eager, through the same methods
    y_ref, stats_ref = _reference(world, rank, 5)
    report.check("mlp/eager/output", _close(y, y_ref) and _close(stats, stats_ref, 5e-2))


def _per_rank(world: int, shape, *seed) -> list[torch.Tensor]:
    g = seeded_generator(*seed)
    return [torch.randn(shape, generator=g) for _ in range(world)]


#: The results of the compiled functional forms, in order, as their checks name them.
FUNCTIONAL_RESULTS = ("all_reduce", "all_reduce_max", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                      "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "matmul_all_gather",
                      "all_reduce_of_ccl", "all_reduce_rmsnorm", "all_reduce_rmsnorm_two_shot",
                      "all_reduce_rmsnorm_residual")
#: The results of the compiled in-place methods, in order.
METHODS_COMPILED = ("all_gather", "reduce_scatter", "all_to_all", "broadcast", "matmul_all_reduce", "matmul_all_gather")


def _check_functional_and_methods(ctx, report: RankReport) -> None:
    """Every functional form, and the remaining in-place methods, compiled in one graph each."""
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    xs = _per_rank(world, (2 * world, 3), "functional")
    a_s = [t.to(DTYPE) for t in _per_rank(world, (2 * world, 8), "a")]
    bs = [t.to(DTYPE) for t in _per_rank(world, (8, 5), "b")]
    total = sum(xs)
    products = [a.float() @ b.float() for a, b in zip(a_s, bs)]
    rows = _per_rank(world, (3, 32), "rmsnorm rows")
    residual, weight = _per_rank(1, (3, 32), "rmsnorm residual")[0], _per_rank(1, (32,), "rmsnorm weight")[0]
    summed = sum(rows) + residual

    def functional(x, a, b, r):
        return (F.all_reduce(x, ctx), F.all_reduce(x, ctx, op="max"), F.all_gather(x, ctx), F.reduce_scatter(x, ctx),
                F.all_to_all(x, ctx), F.broadcast(x, ctx, src=world - 1), F.all_gather_matmul(a[:2], b, ctx),
                F.matmul_reduce_scatter(a, b, ctx), F.matmul_all_reduce(a, b, ctx),
                F.matmul_all_gather(a[:2], b, ctx), F.all_reduce(x, ctx.ccl),
                F.all_reduce_rmsnorm(r, residual.to(device), weight.to(device), ctx, 1e-5)[0],
                *F.all_reduce_rmsnorm(r, residual.to(device), weight.to(device), ctx.ops, keep_residual_out=True,
                                      method="two_shot"))

    compiled, counter = _compile_counting(functional, "aot_eager")
    x, a, b, r = xs[rank].to(device), a_s[rank].to(device), bs[rank].to(device), rows[rank].to(device)
    inputs_before = [t.clone() for t in (x, a, b, r)]
    got = compiled(x, a, b, r)
    segment = lambda t, q: t.reshape(world, -1)[q].reshape(-1)  # noqa: E731
    expected = (total, torch.stack(xs).amax(0), torch.cat(xs), total[rank * 2:(rank + 1) * 2],
                torch.cat([segment(xs[q], rank) for q in range(world)]).reshape(x.shape), xs[world - 1],
                torch.cat([t[:2].float() for t in a_s]) @ bs[rank].float(),
                sum(products)[rank * 2:(rank + 1) * 2], sum(products),
                torch.cat([(t[:2].float() @ u.float()) for t, u in zip(a_s, bs)]), total,
                torch.nn.functional.rms_norm(summed, (32,), weight, 1e-5),
                torch.nn.functional.rms_norm(summed, (32,), weight, 1e-6), summed)
    report.check("functional/results", len(got) == len(FUNCTIONAL_RESULTS))
    for name, value, reference in zip(FUNCTIONAL_RESULTS, got, expected):
        report.check(f"functional/{name}", _close(value, reference))
    report.check("functional/inputs_unchanged", all(torch.equal(t, u) for t, u in zip((x, a, b, r), inputs_before)))
    report.check("functional/one_graph", counter.frame_count == 1)

    def in_place(x, a, b):
        gathered = torch.empty(world * x.shape[0], x.shape[1], device=x.device)
        ctx.ccl.all_gather(gathered, x)
        share = torch.empty(x.shape[0] // world, x.shape[1], device=x.device)
        ctx.ccl.reduce_scatter(share, x, op="sum")
        exchanged = torch.empty_like(x)
        ctx.ccl.all_to_all(exchanged, x)
        copy = x.clone()
        ctx.ccl.broadcast(copy, src=world - 1)
        reduced = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
        ctx.ops.matmul_all_reduce(reduced, a, b)
        stacked = torch.empty(world * 2, b.shape[1], dtype=a.dtype, device=a.device)
        ctx.ops.matmul_all_gather(stacked, a[:2], b)
        return gathered, share, exchanged, copy, reduced, stacked

    compiled, counter = _compile_counting(in_place, "aot_eager")
    got = compiled(x, a, b)
    for name, value, reference in zip(METHODS_COMPILED, got, (expected[2], *expected[3:6], *expected[8:10])):
        report.check(f"methods_compiled/{name}", _close(value, reference))
    report.check("methods_compiled/one_graph", counter.frame_count == 1)


def _splits(world: int, source: int) -> list[int]:
    """Rows rank ``source`` sends to each rank in the uneven all-to-alls (all different)."""
    return [source + target + 1 for target in range(world)]


def _check_rooted_point_to_point_and_uneven(ctx, report: RankReport, backend: str = "aot_eager") -> None:
    """reduce, gather, scatter, send/recv, all_to_all_single, all_to_all_vdev and the prod / avg
    reductions, compiled in one graph, against references from every rank's input."""
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    root = world - 1
    xs = _per_rank(world, (world * 3,), "rooted")
    rows = [torch.randn(sum(_splits(world, q)), 3, generator=seeded_generator("uneven", q)) for q in range(world)]
    bound = max(sum(_splits(world, q)[r] for q in range(world)) for r in range(world))
    received = [sum(_splits(world, q)[rank] for q in range(world))]

    def program(x, mine):
        reduced = x.clone()
        ctx.ccl.reduce(reduced, dst=root, op="sum")
        gathered = torch.zeros(world, x.numel(), device=x.device) if rank == root else None
        ctx.ccl.gather(gathered, x, dst=root)
        share = torch.empty(3, device=x.device)
        ctx.ccl.scatter(share, x if rank == 0 else None, src=0)
        message = torch.zeros_like(x)
        if rank == 0:
            ctx.ccl.send(x, dst=1)
        elif rank == 1:
            ctx.ccl.recv(message, src=0)
        single = torch.empty(received[0], 3, device=x.device)
        ctx.ccl.all_to_all_single(single, mine, [_splits(world, q)[rank] for q in range(world)], _splits(world, rank))
        vdev = torch.zeros(bound, 3, device=x.device)
        counts = torch.full((world,), -5, dtype=torch.int64, device=x.device)
        ctx.ccl.all_to_all_vdev(vdev, mine, torch.tensor(_splits(world, rank), device=x.device), counts)
        product = x.clone()
        ctx.ccl.all_reduce(product, op=torch.distributed.ReduceOp.PRODUCT)
        return (reduced, gathered, share, message, single, vdev, counts, product, F.all_reduce(x, ctx, op="avg"),
                F.reduce(x, ctx, dst=root), F.all_to_all_single(mine, ctx, [_splits(world, q)[rank] for q in
                                                                            range(world)], _splits(world, rank)))

    compiled, counter = _compile_counting(program, backend)
    got = compiled(xs[rank].clone().to(device), rows[rank].clone().to(device))
    total = sum(xs)
    starts = [[sum(_splits(world, q)[:r]) for r in range(world)] for q in range(world)]
    single = torch.cat([rows[q][starts[q][rank]:starts[q][rank] + _splits(world, q)[rank]] for q in range(world)])
    prod = xs[0].clone()
    for t in xs[1:]:
        prod = prod * t
    checks = {
        "reduce": got[0] if rank == root else None, "gather": got[1], "scatter": got[2],
        "send_recv": got[3] if rank == 1 else None, "all_to_all_single": got[4],
        "all_to_all_vdev": got[5][:len(single)],
        "all_to_all_vdev/splits": got[6], "all_reduce_prod": got[7], "functional/all_reduce_avg": got[8],
        "functional/reduce": got[9] if rank == root else None, "functional/all_to_all_single": got[10],
    }
    expected = {
        "reduce": total, "gather": torch.stack(xs) if rank == root else None, "scatter": xs[0][rank * 3:(rank + 1) * 3],
        "send_recv": xs[0], "all_to_all_single": single, "all_to_all_vdev": single,
        "all_to_all_vdev/splits": torch.tensor([_splits(world, q)[rank] for q in range(world)]),
        "all_reduce_prod": prod, "functional/all_reduce_avg": total / world, "functional/reduce": total,
        "functional/all_to_all_single": single,
    }
    for name, value in checks.items():
        if expected[name] is None:
            report.check(f"rooted/{name}/non_root_none", value is None)
        elif value is not None:
            report.check(f"rooted/{name}", _close(value, expected[name]))
    report.check("rooted/one_graph", counter.frame_count == 1)


def _check_fake_implementations(ctx, report: RankReport) -> None:
    """Every operator under FakeTensorMode (shapes, dtypes, no communication), and opcheck's
    schema and fake-tensor tests on real tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    world, ccl, ops = ctx.world_size, ctx.ccl._iris_handle, ctx.ops._iris_handle
    iris_ops = torch.ops.iris
    with FakeTensorMode():
        x = torch.empty(2 * world, 3)
        a, b = torch.empty(2 * world, 8, dtype=DTYPE), torch.empty(8, 5, dtype=DTYPE)
        functional = {
            "all_reduce": (iris_ops.all_reduce(x, ccl, "sum", None), (2 * world, 3)),
            "all_gather": (iris_ops.all_gather(x, ccl, None), (2 * world * world, 3)),
            "reduce_scatter": (iris_ops.reduce_scatter(x, ccl, "sum", None), (2, 3)),
            "all_to_all": (iris_ops.all_to_all(x, ccl, None), (2 * world, 3)),
            "broadcast": (iris_ops.broadcast(x, ccl, 0, None), (2 * world, 3)),
            "all_gather_matmul": (iris_ops.all_gather_matmul(a, b, ops, None), (2 * world * world, 5)),
            "matmul_reduce_scatter": (iris_ops.matmul_reduce_scatter(a, b, ops, None), (2, 5)),
            "matmul_all_reduce": (iris_ops.matmul_all_reduce(a, b, ops, None), (2 * world, 5)),
            "matmul_all_gather": (iris_ops.matmul_all_gather(a, b, ops, None), (2 * world * world, 5)),
            "reduce": (iris_ops.reduce(x, ccl, 0, "sum", None), (2 * world, 3)),
            "all_to_all_single": (iris_ops.all_to_all_single(x, ccl, [1] * world, [2] * world, None), (world, 3)),
        }
        for name, (value, shape) in functional.items():
            report.check(f"fake/{name}", tuple(value.shape) == shape and value.dtype in (torch.float32, DTYPE))
        in_place = {
            "all_reduce_": lambda: iris_ops.all_reduce_(x, ccl, "sum", None),
            "all_gather_": lambda: iris_ops.all_gather_(torch.empty(world * 2 * world, 3), x, ccl, None),
            "reduce_scatter_": lambda: iris_ops.reduce_scatter_(torch.empty(2, 3), x, ccl, "sum", None),
            "all_to_all_": lambda: iris_ops.all_to_all_(torch.empty_like(x), x, ccl, None),
            "broadcast_": lambda: iris_ops.broadcast_(x, ccl, 0, None),
            "all_gather_matmul_": lambda: iris_ops.all_gather_matmul_(torch.empty(2 * world * world, 5, dtype=DTYPE),
                                                                     a, b, ops, None),
            "matmul_reduce_scatter_": lambda: iris_ops.matmul_reduce_scatter_(torch.empty(2, 5, dtype=DTYPE), a, b,
                                                                             ops, None),
            "matmul_all_reduce_": lambda: iris_ops.matmul_all_reduce_(torch.empty(2 * world, 5, dtype=DTYPE), a, b,
                                                                     ops, None),
            "matmul_all_gather_": lambda: iris_ops.matmul_all_gather_(torch.empty(2 * world * world, 5, dtype=DTYPE),
                                                                     a, b, ops, None),
        }
        splits = torch.empty(world, dtype=torch.int64)
        in_place.update({
            "reduce_": lambda: iris_ops.reduce_(x, ccl, 0, "prod", None),
            "gather_": lambda: iris_ops.gather_(torch.empty(world, 2 * world, 3), x, ccl, 0, None),
            "gather_/no_output": lambda: iris_ops.gather_(None, x, ccl, 0, None),
            "scatter_": lambda: iris_ops.scatter_(torch.empty(2, 3), x, ccl, 0, None),
            "scatter_/no_input": lambda: iris_ops.scatter_(torch.empty(2, 3), None, ccl, 0, None),
            "send": lambda: iris_ops.send(x, ccl, 1, None),
            "recv_": lambda: iris_ops.recv_(x, ccl, 1, None),
            "all_to_all_single_": lambda: iris_ops.all_to_all_single_(torch.empty(world, 3), x, ccl, [1] * world,
                                                                     [2] * world, None),
            "all_to_all_vdev_": lambda: iris_ops.all_to_all_vdev_(torch.empty(4 * world, 3), x, splits,
                                                                 torch.empty_like(splits), ccl, None),
        })
        for name, call in in_place.items():
            report.check(f"fake/{name}", call() is None)
        try:
            iris_ops.reduce_scatter(torch.empty(2 * world + 1, 3), ccl, "sum", None)
            refused = False
        except iris.IrisError as error:
            refused = "not divisible by the world size" in str(error)
        report.check("fake/reduce_scatter_refuses_ragged", refused)
    # opcheck runs each operator on real tensors several times: every rank runs the same calls.
    x = torch.randn(2 * world, 3, generator=seeded_generator("opcheck"))
    a = torch.randn(2 * world, 8, generator=seeded_generator("opcheck a")).to(DTYPE)
    b = torch.randn(8, 5, generator=seeded_generator("opcheck b")).to(DTYPE)
    cases = {
        "all_reduce_": (x.clone(), ccl, "sum", None),
        "all_reduce": (x, ccl, "max", None),
        "all_gather_": (torch.empty(world * 2 * world, 3), x, ccl, None),
        "reduce_scatter": (x, ccl, "sum", None),
        "broadcast_": (x.clone(), ccl, 0, None),
        "all_gather_matmul_": (torch.empty(2 * world * world, 5, dtype=DTYPE), a, b, ops, None),
        "matmul_reduce_scatter": (a, b, ops, None),
    }
    for name, args in cases.items():
        result = torch.library.opcheck(getattr(iris_ops, name).default, args,
                                       test_utils=("test_schema", "test_faketensor"))
        report.check(f"opcheck/{name}", all(v == "SUCCESS" for v in result.values()))


def _check_async(ctx, report: RankReport) -> None:
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    xs = _per_rank(world, (world, 5), "async")
    t = xs[rank].clone().to(device)
    work = ctx.ccl.all_reduce(t, async_op=True)
    report.check("async/all_reduce/handle", isinstance(work, CompletedWork) and work.is_completed())
    report.check("async/all_reduce/wait", work.wait() is True)
    report.check("async/all_reduce/result", _close(t, sum(xs)))
    future = work.get_future()
    report.check("async/all_reduce/future", future.done() and _close(future.wait()[0], sum(xs)))
    out = torch.empty(world * world, 5, device=device)
    work = ctx.ccl.all_gather(out, xs[rank].to(device), async_op=True)
    work.wait()
    report.check("async/all_gather/result", _close(out, torch.cat(xs)))
    a_s = [u.to(DTYPE) for u in _per_rank(world, (2, 8), "async a")]
    b = _per_rank(1, (8, 3), "async b")[0].to(DTYPE)
    out = torch.empty(2 * world, 3, dtype=DTYPE, device=device)
    work = ctx.ops.all_gather_matmul(out, a_s[rank].to(device), b.to(device), async_op=True)
    report.check("async/all_gather_matmul/handle", work.wait() and work.is_completed())
    report.check("async/all_gather_matmul/result", _close(out, torch.cat(a_s).float() @ b.float()))

    def compiled_async(x):
        handle = ctx.ccl.all_reduce(x, async_op=True)
        handle.wait()
        return x * 1

    compiled, counter = _compile_counting(compiled_async, "aot_eager")
    got = compiled(xs[rank].clone().to(device))
    report.check("async/compiled/result", _close(got, sum(xs)) and counter.frame_count == 1)


def _check_group_and_lifetime(ctx, report: RankReport) -> None:
    world, rank = ctx.world_size, ctx.rank
    xs = _per_rank(world, (7,), "group")
    whole = ctx.new_group(list(range(world)))
    alone, _ = ctx.new_subgroups(1)  # every rank in a group of its own: a reduction is the identity
    fresh = ctx.new_group(list(range(world)))  # its first call is a compiled one
    compiled, counter = _compile_counting(lambda x: ctx.ccl.all_reduce(x, group=fresh) * 1, "aot_eager")
    report.check("group/compiled_first", _close(compiled(xs[rank].clone().to(ctx.device)), sum(xs))
                 and counter.frame_count == 1)
    for group, expected in ((whole, sum(xs)), (alone, xs[rank])):
        label = f"group/{len(group.ranks)}_ranks"
        t = xs[rank].clone().to(ctx.device)
        ctx.ccl.all_reduce(t, group=group)
        report.check(f"{label}/eager", _close(t, expected))
        work = ctx.ccl.all_reduce(t := xs[rank].clone().to(ctx.device), group=group, async_op=True)
        report.check(f"{label}/async", work.wait() and _close(t, expected))
        compiled, counter = _compile_counting(lambda x, g=group: ctx.ccl.all_reduce(x, group=g) * 1, "aot_eager")
        report.check(f"{label}/compiled", _close(compiled(xs[rank].clone().to(ctx.device)), expected)
                     and counter.frame_count == 1)
        a = torch.ones(2, 8, dtype=DTYPE, device=ctx.device)
        out = F.all_gather_matmul(a, torch.ones(8, 3, dtype=DTYPE, device=ctx.device), ctx, group=group)
        report.check(f"{label}/functional_all_gather_matmul", _close(out, torch.full((2 * len(group.ranks), 3), 8.)))
    other = iris.create(heap_size="4MiB")
    handle = other.ccl._iris_handle
    other.barrier()
    other.destroy()
    try:
        torch.ops.iris.all_reduce_(torch.ones(3), handle, "sum", None)
        refused = False
    except iris.IrisError as error:
        refused = "no live iris context" in str(error)
    report.check("lifetime/destroyed_context_handle_refused", refused)


def _cpu_worker(rank: int) -> bytes:
    report = RankReport(rank)
    ctx = iris.create(heap_size="32MiB")
    for name, check in (("mlp", _check_compiled_mlp), ("functional", _check_functional_and_methods),
                        ("rooted", _check_rooted_point_to_point_and_uneven), ("fake", _check_fake_implementations),
                        ("async", _check_async),
                        ("group", _check_group_and_lifetime)):
        with report.section(name):
            check(ctx, report)
        ctx.barrier()
    ctx.destroy()
    return report.packed()


@pytest.fixture(scope="module")
def cpu_reports():
    return spawn_reports(_cpu_worker, 2, device=interpreted_device(), timeout=120)


def _rooted_names(rank: int, world: int) -> set[str]:
    """The checks of :func:`_check_rooted_point_to_point_and_uneven` on ``rank``: the root (the
    last rank) checks the reductions and the gather, the others that they got no gather output;
    rank 1 receives rank 0's message."""
    names = {f"rooted/{name}" for name in ("scatter", "all_to_all_single", "all_to_all_vdev", "all_to_all_vdev/splits",
                                           "all_reduce_prod", "functional/all_reduce_avg",
                                           "functional/all_to_all_single", "one_graph")}
    names |= {"rooted/reduce", "rooted/gather", "rooted/functional/reduce"} if rank == world - 1 else {
        "rooted/gather/non_root_none"}
    return names | ({"rooted/send_recv"} if rank == 1 else set())


def _cpu_names(world: int) -> dict[str, set[str]]:
    """The checks of :func:`_cpu_worker` on every rank (rooted/: a function of the rank), by section."""
    fake_results = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "all_gather_matmul",
                    "matmul_reduce_scatter", "matmul_all_reduce", "matmul_all_gather", "reduce", "all_to_all_single")
    fake_in_place = ("all_reduce_", "all_gather_", "reduce_scatter_", "all_to_all_", "broadcast_", "all_gather_matmul_",
                     "matmul_reduce_scatter_", "matmul_all_reduce_", "matmul_all_gather_", "reduce_", "gather_",
                     "gather_/no_output", "scatter_", "scatter_/no_input", "send", "recv_", "all_to_all_single_",
                     "all_to_all_vdev_")
    group_labels = (f"{world}_ranks", "1_ranks")  # the whole world, and every rank in a group of its own
    return {
        "mlp/": {f"mlp/compiled/{what}/{seed}" for what in ("output", "all_reduced_stats")
                 for seed in range(MLP_CALLS)} | {
            f"mlp/{check}" for check in ("compiled/one_graph", "compiled/no_graph_break",
                                         "compiled/graph_calls_the_operators", "eager/output", "completed")},
        "functional/": {f"functional/{name}" for name in FUNCTIONAL_RESULTS} | {
            f"functional/{check}" for check in ("results", "inputs_unchanged", "one_graph", "completed")},
        "methods_compiled/": {f"methods_compiled/{name}" for name in (*METHODS_COMPILED, "one_graph")},
        "fake/": {f"fake/{name}" for name in (*fake_results, *fake_in_place, "reduce_scatter_refuses_ragged",
                                              "completed")},
        "opcheck/": {f"opcheck/{name}" for name in ("all_reduce_", "all_reduce", "all_gather_", "reduce_scatter",
                                                    "broadcast_", "all_gather_matmul_", "matmul_reduce_scatter")},
        "async/": {f"async/{check}" for check in (
            "all_reduce/handle", "all_reduce/wait", "all_reduce/result", "all_reduce/future", "all_gather/result",
            "all_gather_matmul/handle", "all_gather_matmul/result", "compiled/result", "completed")},
        "group/": {f"group/{label}/{check}" for label in group_labels
                   for check in ("eager", "async", "compiled", "functional_all_gather_matmul")} | {
            "group/compiled_first", "group/completed"},
        "rooted/": lambda rank: _rooted_names(rank, world) | {"rooted/completed"},
        "lifetime/": {"lifetime/destroyed_context_handle_refused"},
    }


@pytest.mark.parametrize("prefix", ["mlp/", "functional/", "methods_compiled/", "fake/", "opcheck/", "async/", "group/",
                                    "rooted/", "lifetime/"])
def test_on_two_cpu_ranks(cpu_reports, prefix):
    assert_rank_checks(cpu_reports, prefix, _cpu_names(len(cpu_reports))[prefix])


def test_every_public_method_routes_to_an_operator():
    """Each public collective of ctx.ccl and ctx.ops carries the decorator, naming an operator that exists."""
    from iris.mixins.ccl import Collectives
    from iris_triton.operations.fused_ops import FusedOps

    for cls in (Collectives, FusedOps):
        for name, value in vars(cls).items():
            if name.startswith("_") or not callable(value) or name == "algorithms":  # discovery, not a call
                continue
            if name in getattr(cls, "EAGER_ONLY", ()):  # results that are not tensors: documented as eager
                assert getattr(value, "__iris_operator__", None) is None, f"{cls.__name__}.{name} is eager only"
                continue
            assert getattr(value, "__iris_operator__", None) == name, f"{cls.__name__}.{name} is not @declared"
            assert hasattr(torch.ops.iris, name), f"torch.ops.iris.{name} is not registered"


def test_every_declaration_has_its_method_operators_and_functional_form():
    """Each declared call is a @declared method of its namespace, has its operators (the in-place
    one mutating exactly the declared outputs) and its function in iris.functional."""
    import iris.functional as F
    from iris.calls.declarations import DECLARATIONS
    from iris.calls.operators import in_place_name
    from iris.mixins.ccl import Collectives
    from iris_triton.operations.fused_ops import FusedOps

    namespaces = {"ccl": Collectives, "ops": FusedOps}
    for name, declaration in DECLARATIONS.items():
        method = getattr(namespaces[declaration.namespace], name)
        assert method.__iris_operator__ == name
        schema = getattr(torch.ops.iris, in_place_name(declaration)).default._schema
        written = {argument.name for argument in schema.arguments
                   if argument.alias_info is not None and argument.alias_info.is_write}
        assert written == set(declaration.mutated), (name, written)
        assert callable(getattr(F, name)) and name in F.__all__


def test_a_method_that_differs_from_its_declaration_is_refused():
    """The decorator compares the method's parameters with the declaration's when the class is
    made: a changed default (or name, or order) is a TypeError naming both."""
    from iris.calls.routing import declared

    with pytest.raises(TypeError, match=r"not those of its declaration"):
        class Drifted:
            @declared
            def all_reduce(self, tensor, op="max", *, algorithm=None):
                return tensor

    class Matching:
        @declared
        def all_reduce(self, tensor, op="sum", *, algorithm=None):
            return tensor

    assert Matching.all_reduce.__iris_operator__ == "all_reduce"


# -- GPUs ---------------------------------------------------------------------------------------------------


#: The seeds of the data the captured graph replays on.
GRAPH_SEEDS = (1, 2)


def _graphed(ctx, report: RankReport, label: str) -> None:
    """The MLP and the functional all_reduce compiled with inductor, then captured in a CUDA graph
    after a warm-up call (workspaces grow only outside a capture) and replayed on new data."""
    world, rank = ctx.world_size, ctx.rank
    compiled = torch.compile(lambda *a: tp_mlp(ctx, *a), fullgraph=True, backend="inductor")
    static = list(_shards(world, rank, 0, ctx.device))
    for _ in range(2):  # warm-up: compilation, workspaces
        compiled(*static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, stats = compiled(*static)
    for seed in GRAPH_SEEDS:
        for target, value in zip(static, _shards(world, rank, seed, ctx.device)):
            target.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        y_ref, stats_ref = _reference(world, rank, seed)
        report.check(f"{label}/graph_replay/output/{seed}", _close(y, y_ref))
        report.check(f"{label}/graph_replay/stats/{seed}", _close(stats, stats_ref, 5e-2))
    xs = _per_rank(world, (world * 1000,), "graphed functional")
    x = xs[rank].cuda()
    overhead = torch.compile(lambda t: F.all_reduce(t, ctx) * 2, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # reduce-overhead records its graph on a later call
        got = overhead(x)
    torch.cuda.synchronize()
    report.check(f"{label}/reduce_overhead/all_reduce", _close(got, 2 * sum(xs)))
    # Asynchronous: enqueued on the side stream after the current stream's work.
    t = torch.zeros_like(x)
    torch.cuda._sleep(1_000_000)  # the current stream is busy; the side stream waits for it
    t.copy_(x)
    work = ctx.ccl.all_reduce(t, async_op=True)
    work.wait()
    result = t * 1  # on the current stream, after wait()
    torch.cuda.synchronize()
    report.check(f"{label}/async/result", _close(result, sum(xs)) and work.is_completed())
    # An asynchronous call captured in a CUDA graph: the side stream joins the capture.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ctx.ccl.all_reduce(t, async_op=True).wait()
        doubled = t * 2
    t.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    report.check(f"{label}/async/captured", _close(doubled, 2 * sum(xs)))


def _gpu_names(world: int) -> set[str]:
    """The checks of :func:`_gpu_worker` named gpu/ on every rank of ``world``: the replays of
    its graph (:data:`GRAPH_SEEDS`), and, on more than one rank, the completion of gpu/rooted
    (its checks are named rooted/)."""
    names = {f"gpu/graph_replay/{what}/{seed}" for what in ("output", "stats") for seed in GRAPH_SEEDS} | {
        "gpu/reduce_overhead/all_reduce", "gpu/async/result", "gpu/async/captured", "gpu/completed"}
    return names | ({"gpu/rooted/completed"} if world > 1 else set())


def _gpu_worker(rank: int) -> bytes:
    report = RankReport(rank)
    ctx = iris.create(heap_size="256MiB")
    with report.section("gpu"):
        _graphed(ctx, report, "gpu")
    if ctx.world_size > 1:
        with report.section("gpu/rooted"):  # graphs that differ between ranks, compiled by inductor
            _check_rooted_point_to_point_and_uneven(ctx, report, "inductor")
    ctx.barrier()
    ctx.destroy()
    return report.packed()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_world_of_one_compiled_and_graphed_on_a_gpu():
    import pickle
    import zlib

    report = pickle.loads(zlib.decompress(_gpu_worker(0)))
    assert_rank_checks([report], "gpu/", _gpu_names(1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_two_ranks_sharing_one_gpu_compiled_and_graphed():
    import pickle
    import zlib

    results = run_sharing_one_gpu(_gpu_worker)
    failed = [r for r in results if not isinstance(r, bytes)]
    assert not failed, failed
    reports = [pickle.loads(zlib.decompress(r)) for r in results]
    assert_rank_checks(reports, "gpu/", _gpu_names(2))
    assert_rank_checks(reports, "rooted/", lambda rank: _rooted_names(rank, 2))
