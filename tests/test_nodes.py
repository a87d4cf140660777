"""A world that spans nodes, simulated on one machine: ``iris.create(node_size=2)`` on 4 CPU ranks
(and ``IRIS_LOCAL_WORLD_SIZE=2``) is 2 nodes of 2 ranks; 6 ranks are 3 nodes of 2.

Each rank checks: its heap is shared with its node only (the other node's heap bases are 0), the
world collectives of ``ctx.ccl`` (all_reduce with every reduction, all_gather, reduce_scatter,
broadcast, all_to_all) against torch.distributed's on gloo, with random data; collectives and
fused operations on ``ctx.node_group``; and that whatever would reach another node's heap from the
world's context is refused with an error that names the node group (a named algorithm, the
rooted collectives, ``ctx.ops``, the device barrier, a group across nodes), and that a host view of
another node's heap (``ctx.heap.peer_view``) is an IrisError naming the nodes. A training step of a
row-parallel layer (the fused ``matmul_all_reduce`` over each node's ranks), its gradients averaged
across nodes over ``ctx.cross_group``, matches a single-process torch reference. A world of one
rank is one node of one: its own heap mapped, and a hierarchy over it runs every step (replayed
from a CUDA graph on a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import iris
from iris.errors import IrisError
from iris.collectives.hierarchical import Hierarchy, NodeLayout
from iris.testing import RankReport, assert_rank_checks, reports_on_available_ranks, seeded_generator

NODE_SIZE = 2
N = 24
#: Replays of the captured hierarchical all_reduce (GPUs).
GRAPH_REPLAYS = 3
#: The checks of every context's layout section, and of its world section (:func:`_world_collectives`).
LAYOUT_CHECKS = {f"layout/{check}" for check in ("nodes", "only the node's heaps are mapped", "groups", "completed")}
WORLD_CHECKS = {f"world/{check}" for check in (
    "all_reduce sum", "all_reduce max", "all_reduce avg", "all_gather", "reduce_scatter", "broadcast from rank 3",
    "broadcast from the last rank", "all_to_all", "all_reduce matches torch.distributed's", "completed")}


def _close(a, b) -> bool:
    return torch.allclose(a.float().cpu(), b.float().cpu(), rtol=1e-4, atol=1e-4)


def _world_collectives(ctx, report: RankReport) -> None:
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    parts = [torch.randn(N, generator=seeded_generator("nodes", q)) for q in range(world)]
    mine = parts[rank].to(device)
    for op, expected in (("sum", torch.stack(parts).sum(0)), ("max", torch.stack(parts).max(0).values),
                         ("avg", torch.stack(parts).mean(0))):
        report.check(f"world/all_reduce {op}", _close(ctx.ccl.all_reduce(mine.clone(), op), expected))
    report.check("world/all_gather", _close(ctx.ccl.all_gather(torch.empty(world * N, device=device), mine),
                                            torch.cat(parts)))
    share = N // world
    report.check("world/reduce_scatter", _close(ctx.ccl.reduce_scatter(torch.empty(share, device=device), mine),
                                                torch.stack(parts).sum(0)[rank * share:(rank + 1) * share]))
    report.check("world/broadcast from rank 3", _close(ctx.ccl.broadcast(mine.clone(), src=3), parts[3]))
    report.check("world/broadcast from the last rank", _close(ctx.ccl.broadcast(mine.clone(), src=world - 1),
                                                              parts[world - 1]))
    expected = torch.stack(parts).view(world, world, share)[:, rank].reshape(-1)
    report.check("world/all_to_all", _close(ctx.ccl.all_to_all(torch.empty(N, device=device), mine), expected))
    reference = mine.clone()
    dist.all_reduce(reference)
    report.check("world/all_reduce matches torch.distributed's", _close(ctx.ccl.all_reduce(mine.clone()), reference))


def _node_calls(ctx, report: RankReport) -> None:
    layout, node = ctx.node_layout, ctx.node_layout.node_of(ctx.rank)
    members = layout.node_ranks(node)
    parts = [torch.randn(N, generator=seeded_generator("node", q)) for q in range(ctx.world_size)]
    result = ctx.ccl.all_reduce(parts[ctx.rank].to(ctx.device, copy=True), group=ctx.node_group)
    report.check("node/all_reduce over the node", _close(result, sum(parts[q] for q in members)))
    a = [torch.randn(4 * NODE_SIZE, 16, generator=seeded_generator("a", q)).bfloat16() for q in range(ctx.world_size)]
    b = torch.randn(16, 16, generator=seeded_generator("b", node)).bfloat16()
    out = torch.empty(4, 16, dtype=torch.bfloat16, device=ctx.device)
    ctx.ops.matmul_reduce_scatter(out, a[ctx.rank].to(ctx.device), b.to(ctx.device), group=ctx.node_group)
    local = members.index(ctx.rank)
    expected = sum(a[q].float() @ b.float() for q in members)[4 * local:4 * (local + 1)]
    report.check("node/fused matmul_reduce_scatter over the node",
                 torch.allclose(out.float().cpu(), expected, rtol=3e-2, atol=5e-2))


def _refusals(ctx, report: RankReport) -> None:
    x = ctx.zeros(N)
    attempts = {
        "named algorithm": lambda: ctx.ccl.all_reduce(x, algorithm="one_shot"),
        "reduce": lambda: ctx.ccl.reduce(x, dst=0),
        "ops": lambda: ctx.ops.matmul_all_reduce(torch.empty(4, 4), torch.ones(4, 4), torch.ones(4, 4)),
        "device_barrier": ctx.device_barrier,
        "group across nodes": lambda: ctx.new_group([0, 2]),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            report.check(f"refused/{name}", False)
        except IrisError as error:
            report.check(f"refused/{name}", "spans" in str(error) and ("node" in str(error)))


def _peer_views(ctx, report: RankReport) -> None:
    """Host views of a heap tensor on every rank: the same node's ranks' heaps are mapped here
    (their views hold what those ranks wrote), another node's are not, and asking for one is an
    IrisError naming both nodes rather than torch's storage-size error."""
    layout, x = ctx.node_layout, ctx.full((N,), float(ctx.rank))
    ctx.barrier()
    for rank in range(ctx.world_size):
        node = layout.node_of(rank)
        if node == layout.node_of(ctx.rank):
            report.check(f"peer_view/rank {rank} on this node", torch.equal(ctx.heap.peer_view(x, rank).cpu(),
                                                                            torch.full((N,), float(rank))))
            continue
        try:
            ctx.heap.peer_view(x, rank)
            report.check(f"peer_view/rank {rank} on node {node} refused", False)
        except IrisError as error:
            report.check(f"peer_view/rank {rank} on node {node} refused",
                         f"rank {rank} runs on node {node}, and this rank ({ctx.rank}) on node "
                         f"{layout.node_of(ctx.rank)}" in str(error) and "world collective" in str(error))
    ctx.barrier()


def _training_step(ctx, report: RankReport) -> None:
    """One step of y = x @ W with W split by rows over the node's ranks (a row-parallel layer: each
    rank multiplies its columns of x by its rows of W, and the fused matmul_all_reduce over the
    node sums them), loss = sum(y^2) / rows; each node trains on its own batch and the gradients
    are averaged across nodes over ctx.cross_group (data parallel). The loss and the updated
    weights against one process doing the same on every batch in float32."""
    layout = ctx.node_layout
    node, local = layout.node_of(ctx.rank), layout.local_rank(ctx.rank)
    rows, k, n, lr = 4 * NODE_SIZE, 8 * NODE_SIZE, 16, 0.05
    weight = torch.randn(k, n, generator=seeded_generator("w")).bfloat16().float()
    batches = [torch.randn(rows, k, generator=seeded_generator("batch", q)).bfloat16().float()
               for q in range(layout.nodes)]
    mine = slice(local * k // NODE_SIZE, (local + 1) * k // NODE_SIZE)
    x, w = batches[node][:, mine], weight[mine]
    y = torch.empty(rows, n, dtype=torch.bfloat16, device=ctx.device)
    ctx.ops.matmul_all_reduce(y, x.bfloat16().to(ctx.device), w.bfloat16().to(ctx.device), method="fused",
                              group=ctx.node_group)
    y = y.float().cpu()
    loss = float((y ** 2).sum() / rows)
    grad = (x.t() @ (2 * y / rows)).to(ctx.device)  # d loss / d (this rank's rows of W)
    dist.all_reduce(grad, group=ctx.cross_group)
    updated = w - lr * grad.cpu() / layout.nodes
    reference = weight.clone().requires_grad_()
    losses = [((batch @ reference) ** 2).sum() / rows for batch in batches]
    (sum(losses) / layout.nodes).backward()
    expected = (weight - lr * reference.grad)[mine]
    report.check("train/the node's fused layer", torch.allclose(y, batches[node] @ weight, rtol=2e-2, atol=5e-2))
    report.check("train/loss", abs(loss - float(losses[node])) <= 2e-2 * float(losses[node]))
    report.check("train/updated weights", torch.allclose(updated, expected, rtol=2e-2, atol=2e-2))


def _worker(rank: int, *hows: str) -> bytes:
    """A context of nodes of 2 for each of ``hows`` in turn (the node size as the ``node_size``
    argument, or from ``IRIS_LOCAL_WORLD_SIZE``); its checks are named ``<how>/...``."""
    report = RankReport(rank)
    for how in hows:
        part = RankReport(rank)
        _check_nodes(rank, how, part)
        report.update({f"{how}/{key}": value for key, value in part.items()})
    return report.packed()


def _part(reports: list[dict], how: str) -> list[dict]:
    """Every rank's checks of the context made ``how``, without the prefix."""
    return [{key.removeprefix(f"{how}/"): value for key, value in rep.items() if key.startswith(f"{how}/")}
            for rep in reports]


def _check_nodes(rank: int, how: str, report: RankReport) -> None:
    if how == "environment":
        os.environ["IRIS_LOCAL_WORLD_SIZE"] = str(NODE_SIZE)
    ctx = iris.create(heap_size="16MiB", node_size=NODE_SIZE if how == "argument" else None)
    with report.section("layout"):
        layout = ctx.node_layout
        report.check("layout/nodes", (layout.nodes, layout.node_size) == (ctx.world_size // NODE_SIZE, NODE_SIZE))
        bases = ctx.get_heap_bases().tolist()
        same = [r for r in range(ctx.world_size) if layout.node_of(r) == layout.node_of(rank)]
        report.check("layout/only the node's heaps are mapped",
                     all((bases[r] != 0) == (r in same) for r in range(ctx.world_size)))
        report.check("layout/groups", ctx.node_group is not None and ctx.cross_group is not None)
    with report.section("world"):
        _world_collectives(ctx, report)
    if how == "argument":
        with report.section("node"):
            _node_calls(ctx, report)
        with report.section("refused"):
            _refusals(ctx, report)
        with report.section("peer_view"):
            _peer_views(ctx, report)
        with report.section("train"):
            _training_step(ctx, report)
    ctx.barrier()
    ctx.destroy()
    os.environ.pop("IRIS_LOCAL_WORLD_SIZE", None)


def _hierarchy_of_one(h: Hierarchy, report: RankReport) -> None:
    """Every collective of a Hierarchy over a world of one rank (one node of one: each step of it
    runs, the node step on iris's kernels, the cross step on torch.distributed) against its input."""
    device = h.context.device
    x = torch.randn(N, generator=seeded_generator("one", "x")).to(device)
    report.check("one/hierarchy/all_reduce sum", _close(h.all_reduce(x.clone()), x))
    report.check("one/hierarchy/all_reduce avg", _close(h.all_reduce(x.clone(), "avg"), x))
    report.check("one/hierarchy/all_gather", _close(h.all_gather(torch.empty(N, device=device), x), x))
    report.check("one/hierarchy/reduce_scatter", _close(h.reduce_scatter(torch.empty(N, device=device), x), x))
    report.check("one/hierarchy/broadcast", _close(h.broadcast(x.clone(), src=0), x))
    report.check("one/hierarchy/all_to_all", _close(h.all_to_all(torch.empty(N, device=device), x), x))


def _captured_all_reduce(h: Hierarchy, report: RankReport) -> None:
    """The hierarchical all_reduce captured in a CUDA graph (NCCL's steps are capturable) and
    replayed on new data: every replay leaves the reduction of what the tensor held before it."""
    tensor = torch.empty(4 * N + 1, device=h.context.device)
    h.all_reduce(tensor.normal_())  # warm-up outside the capture: NCCL's communicator, iris's kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h.all_reduce(tensor, "avg")
    for replay in range(GRAPH_REPLAYS):
        values = torch.randn(tensor.numel(), generator=seeded_generator("graph", replay)).to(tensor.device)
        tensor.copy_(values)
        graph.replay()
        torch.cuda.synchronize()
        report.check(f"one/graph/replay {replay}", _close(tensor, values))


def _one_rank_worker(rank: int) -> bytes:
    """A world of one rank bootstrapped as one node of one (node_size=1): its own heap mapped,
    no hierarchy (one node), and a Hierarchy over that node running every step."""
    report = RankReport(rank)
    ctx = iris.create(heap_size="16MiB", node_size=1)
    with report.section("one"):
        report.check("one/layout", (ctx.node_layout.nodes, ctx.node_layout.node_size) == (1, 1))
        report.check("one/one node: no hierarchy", ctx.hierarchy is None and ctx.node_group is None
                     and ctx.cross_group is None)
        report.check("one/own heap mapped", ctx.get_heap_bases().tolist()[0] != 0)
        x = torch.randn(N, generator=seeded_generator("one", "ccl")).to(ctx.device)
        report.check("one/world all_reduce", _close(ctx.ccl.all_reduce(x.clone()), x))
        h = Hierarchy.of(ctx, NodeLayout(1, 1))
        _hierarchy_of_one(h, report)
        if ctx.device.type == "cuda":
            _captured_all_reduce(h, report)
    ctx.barrier()
    ctx.destroy()
    return report.packed()


def test_one_rank_is_a_node_of_one():
    reports = reports_on_available_ranks(_one_rank_worker, 1, timeout=120)
    on_gpu = torch.cuda.is_available()  # where the rank ran: the graph is captured there
    hierarchy = {f"one/hierarchy/{call}" for call in ("all_reduce sum", "all_reduce avg", "all_gather",
                                                      "reduce_scatter", "broadcast", "all_to_all")}
    graph = {f"one/graph/replay {replay}" for replay in range(GRAPH_REPLAYS)} if on_gpu else set()
    assert_rank_checks(reports, "one/", hierarchy | graph | {
        "one/layout", "one/one node: no hierarchy", "one/own heap mapped", "one/world all_reduce", "one/completed"})


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    """One start of 4 ranks for both ways of giving the node size: a context made with the
    argument, destroyed, then one made from the environment variable."""
    return reports_on_available_ranks(_worker, 4, "argument", "environment", timeout=120)


def _peer_view_names(rank: int, world: int) -> set[str]:
    """The checks of :func:`_peer_views` on ``rank``: the views of its node's ranks, and the refusals
    of the others' (nodes of NODE_SIZE consecutive ranks)."""
    node = rank // NODE_SIZE
    return {f"peer_view/rank {peer} on this node" if peer // NODE_SIZE == node else
            f"peer_view/rank {peer} on node {peer // NODE_SIZE} refused" for peer in range(world)} | {
        "peer_view/completed"}


def test_four_ranks_as_two_nodes_of_two(four_ranks):
    reports = _part(four_ranks, "argument")
    assert_rank_checks(reports, "layout/", LAYOUT_CHECKS)
    assert_rank_checks(reports, "world/", WORLD_CHECKS)
    assert_rank_checks(reports, "node/", {"node/all_reduce over the node",
                                          "node/fused matmul_reduce_scatter over the node", "node/completed"})
    assert_rank_checks(reports, "refused/", {f"refused/{call}" for call in (
        "named algorithm", "reduce", "ops", "device_barrier", "group across nodes", "completed")})
    assert_rank_checks(reports, "peer_view/", lambda rank: _peer_view_names(rank, len(reports)))
    assert_rank_checks(reports, "train/", {"train/the node's fused layer", "train/loss", "train/updated weights",
                                           "train/completed"})


def test_the_node_size_from_the_environment(four_ranks):
    reports = _part(four_ranks, "environment")
    assert_rank_checks(reports, "layout/", LAYOUT_CHECKS)
    assert_rank_checks(reports, "world/", WORLD_CHECKS)


def test_six_ranks_as_three_nodes_of_two():
    reports = _part(reports_on_available_ranks(_worker, 6, "environment", timeout=120), "environment")
    assert_rank_checks(reports, "layout/", LAYOUT_CHECKS)
    assert_rank_checks(reports, "world/", WORLD_CHECKS)
