"""Hierarchical collectives (:mod:`iris.collectives.hierarchical`) on CPU ranks, against torch.distributed's
world collectives on gloo with the same random data.

Nodes are simulated on one machine: 4 ranks as 2 nodes of 2 and 6 ranks as 3 nodes of 2 (one
spawn each, every check in it). Sizes both divisible and not divisible by the node size; float32
for every reduction, bfloat16 for the all_reduce sum; every rank as broadcast's source; the
results against torch's world all_reduce, all_gather and broadcast (all_to_all: against the
gathered inputs). The 4-rank spawn also runs the degenerate
layouts (one rank per node, one node), the layout of a context (``layout_for``) and the refusals.
:class:`NodeLayout` and :func:`node_size_from` are tested on their own, without ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import iris
from iris.errors import IrisError
from iris.collectives.hierarchical import Hierarchy, NodeLayout, layout_for, node_size_from
from iris.testing import RankReport, assert_rank_checks, reports_on_available_ranks, seeded_generator

#: torch.distributed's reduction of each op; avg is the world sum divided by the world size.
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
             "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}


# -- NodeLayout and node_size_from ----------------------------------------------------------------


def test_node_layout_numbers_ranks_node_major():
    layout = NodeLayout(6, 2)
    assert layout.nodes == 3
    for rank in range(6):
        node, local = layout.node_of(rank), layout.local_rank(rank)
        assert rank == node * 2 + local
        assert layout.node_ranks(node)[local] == rank
        assert layout.cross_ranks(local)[node] == rank
    assert layout.node_ranks(1) == (2, 3)
    assert layout.cross_ranks(1) == (1, 3, 5)
    assert NodeLayout(4, 4).cross_ranks(3) == (3,) and NodeLayout(4, 1).node_ranks(2) == (2,)


@pytest.mark.parametrize("world_size, node_size, message", [
    (6, 4, "node_size=4 does not divide the world size 6"),
    (0, 1, "world_size must be a positive int, got 0"),
    (4, 0, "node_size must be a positive int, got 0"),
    (4, True, "node_size must be a positive int, got True"),
])
def test_node_layout_refuses_bad_layouts(world_size, node_size, message):
    with pytest.raises(IrisError, match=message):
        NodeLayout(world_size, node_size)


def test_node_layout_refuses_ranks_outside_it():
    layout = NodeLayout(4, 2)
    with pytest.raises(IrisError, match=r"rank 4 is out of range 0\.\.3"):
        layout.node_of(4)
    with pytest.raises(IrisError, match=r"node 2 is out of range 0\.\.1"):
        layout.node_ranks(2)
    with pytest.raises(IrisError, match=r"local rank -1 is out of range 0\.\.1"):
        layout.cross_ranks(-1)


@pytest.mark.parametrize("environ, world_size, hostnames, expected", [
    ({"IRIS_LOCAL_WORLD_SIZE": "2"}, 4, None, 2),
    ({"IRIS_LOCAL_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, 8, ["a"] * 4 + ["b"] * 4, 2),
    ({"IRIS_LOCAL_WORLD_SIZE": "4"}, 4, None, 4),
    ({"LOCAL_WORLD_SIZE": "2"}, 6, None, 2),
    ({"LOCAL_WORLD_SIZE": "4"}, 4, None, 4),
    ({"LOCAL_WORLD_SIZE": "6"}, 6, ["a", "a", "a", "b", "b", "b"], 3),
    ({}, 4, ["a", "a", "b", "b"], 2),
    ({}, 3, ["a", "b", "c"], 1),
    ({}, 6, None, 6),
])
def test_node_size_from_the_environment_and_host_names(environ, world_size, hostnames, expected):
    assert node_size_from(environ, world_size, hostnames) == expected


@pytest.mark.parametrize("environ, world_size, hostnames, message", [
    ({"IRIS_LOCAL_WORLD_SIZE": "3"}, 4, None, "IRIS_LOCAL_WORLD_SIZE=3: .*node_size=3 does not divide"),
    ({"IRIS_LOCAL_WORLD_SIZE": "two"}, 4, None, "IRIS_LOCAL_WORLD_SIZE='two' is not a number of ranks per node"),
    ({"LOCAL_WORLD_SIZE": "3"}, 4, None, "LOCAL_WORLD_SIZE=3: .*does not divide the world size 4"),
    ({}, 4, ["a", "b", "a", "b"], r"the ranks of host 'a' are \[0, 2\], not consecutive"),
    ({}, 4, ["a", "a", "a", "b"], r"different numbers of ranks \(\{'a': 3, 'b': 1\}\)"),
    ({}, 4, ["a", "a"], "2 host names for a world of 4 ranks"),
])
def test_node_size_from_refuses_what_makes_no_layout(environ, world_size, hostnames, message):
    with pytest.raises(IrisError, match=message):
        node_size_from(environ, world_size, hostnames)


# -- the collectives on ranks ----------------------------------------------------------------------


def _random(*shape, seed, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=seeded_generator(*seed)).to(dtype)


def _close(got: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> bool:
    return got.shape == expected.shape and torch.allclose(got.float(), expected.float(), rtol=tol, atol=tol)


def _world_all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """torch.distributed's world all_reduce of a copy of ``tensor`` (avg: the sum over the world size)."""
    expected = tensor.clone()
    dist.all_reduce(expected, op=TORCH_OPS[op])
    return expected / dist.get_world_size() if op == "avg" else expected


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor``, stacked in world rank order (torch.distributed's all_gather)."""
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor)
    return torch.stack(everyone)


def _check_all_reduce(h: Hierarchy, cases, name: str, report: RankReport) -> None:
    for numel, op, dtype in cases:
        x = _random(numel, seed=(name, numel, op, str(dtype), h.rank), dtype=dtype)
        expected = _world_all_reduce(x, op)
        got = h.all_reduce(x.to(h.context.device), op=op).cpu()
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        report.check(f"hier/{name}/all_reduce/{op}/{str(dtype)[6:]}/{numel}", _close(got, expected, tol))


def _check_all_gather(h: Hierarchy, shapes, name: str, report: RankReport) -> None:
    world = h.layout.world_size
    for shape in shapes:
        x = _random(*shape, seed=(name, "gather", shape, h.rank))
        out = torch.full((world, *shape), 7.0, device=h.context.device)
        got = h.all_gather(out, x.to(h.context.device)).cpu()
        report.check(f"hier/{name}/all_gather/{shape}", torch.equal(got, _gathered(x)))


def _check_reduce_scatter(h: Hierarchy, cases, name: str, report: RankReport) -> None:
    world = h.layout.world_size
    for share, op in cases:
        x = _random(world * share, seed=(name, "scatter", share, op, h.rank))
        expected = _world_all_reduce(x, op).view(world, share)[h.rank]
        got = h.reduce_scatter(torch.empty(share, device=h.context.device), x.to(h.context.device), op=op).cpu()
        report.check(f"hier/{name}/reduce_scatter/{op}/{share}", _close(got, expected))


def _check_broadcast(h: Hierarchy, sources, name: str, report: RankReport) -> None:
    for src in sources:
        x = _random(5, 3, seed=(name, "broadcast", src, h.rank))
        expected = x.clone()
        dist.broadcast(expected, src=src)
        got = h.broadcast(x.to(h.context.device), src=src).cpu()
        report.check(f"hier/{name}/broadcast/{src}", torch.equal(got, expected))


def _check_all_to_all(h: Hierarchy, name: str, report: RankReport) -> None:
    world = h.layout.world_size
    x = _random(world, 3, seed=(name, "all_to_all", h.rank))
    expected = _gathered(x)[:, h.rank]  # segment rank of every rank, in world rank order
    got = h.all_to_all(torch.empty(world, 3, device=h.context.device), x.to(h.context.device)).cpu()
    report.check(f"hier/{name}/all_to_all", torch.equal(got, expected))


def _check_structure(h: Hierarchy, name: str, report: RankReport) -> None:
    layout = h.layout
    report.check(f"hier/{name}/node_group", h.node_group.ranks == layout.node_ranks(h.node)
                 and h.node_group.rank == h.local_rank)
    report.check(f"hier/{name}/cross_group",
                 tuple(dist.get_process_group_ranks(h.cross_group)) == layout.cross_ranks(h.local_rank)
                 and dist.get_rank(h.cross_group) == h.node)


def _raises(report: RankReport, name: str, message: str, call) -> None:
    try:
        call()
        report.check(name, False)
    except IrisError as error:
        report[name] = message in str(error) or f"rank {report.rank}: {error}"


def _check_refusals(ctx, h: Hierarchy, report: RankReport) -> None:
    world, dev = ctx.world_size, ctx.device
    _raises(report, "hier/refuses/integer_avg", "op='avg' takes floating-point tensors",
            lambda: h.all_reduce(torch.ones(4, dtype=torch.int32, device=dev), op="avg"))
    _raises(report, "hier/refuses/non_contiguous", "tensor is not contiguous",
            lambda: h.all_reduce(torch.ones(4, 2, device=dev).t()))
    _raises(report, "hier/refuses/gather_size", f"output has 5 elements; it needs world_size x input = {2 * world}",
            lambda: h.all_gather(torch.empty(5, device=dev), torch.ones(2, device=dev)))
    _raises(report, "hier/refuses/scatter_size", f"input has 5 elements; it needs world_size x output = {world}",
            lambda: h.reduce_scatter(torch.empty(1, device=dev), torch.ones(5, device=dev)))
    _raises(report, "hier/refuses/src", f"src={world} is not a world rank",
            lambda: h.broadcast(torch.ones(2, device=dev), world))
    _raises(report, "hier/refuses/layout", f"the layout is of {2 * world} ranks, the context of {world}",
            lambda: Hierarchy.of(ctx, NodeLayout(2 * world, 2)))
    _raises(report, "hier/refuses/different_environments", "the ranks see different node sizes",
            lambda: layout_for(ctx, environ={"IRIS_LOCAL_WORLD_SIZE": str(1 + ctx.rank % 2)}))


#: The calls of the hierarchy of nodes of 2: all_reduce's (elements, op, dtype), all_gather's
#: input shapes, reduce_scatter's (elements per rank, op).
REDUCTIONS = [(numel, op, torch.float32) for numel in (24, 7) for op in TORCH_OPS] + [
    (24, "sum", torch.bfloat16), (7, "sum", torch.bfloat16)]
GATHERS = [(3, 5), (1,)]
SCATTERS = [(5, "sum"), (2, "avg"), (2, "max"), (1, "min"), (1, "prod")]
#: The calls of the degenerate layouts (nodes of one rank, one node of every rank).
DEGENERATE_REDUCTIONS = [(7, "sum", torch.float32)]
DEGENERATE_SCATTERS = [(3, "max")]
#: The refusals :func:`_check_refusals` checks.
REFUSALS = ("integer_avg", "non_contiguous", "gather_size", "scatter_size", "src", "layout", "different_environments")


def _worker(rank: int, extras: bool) -> bytes:
    """Every collective of a hierarchy of nodes of 2; ``extras``: also the degenerate layouts,
    the context's layout and the refusals."""
    report = RankReport(rank)
    ctx = iris.create()
    world = ctx.world_size
    with report.section("two_per_node"):
        h = Hierarchy.of(ctx, NodeLayout(world, 2))
        _check_structure(h, "two_per_node", report)
        _check_all_reduce(h, REDUCTIONS, "two_per_node", report)
        _check_all_gather(h, GATHERS, "two_per_node", report)
        _check_reduce_scatter(h, SCATTERS, "two_per_node", report)
        _check_broadcast(h, range(world), "two_per_node", report)
        _check_all_to_all(h, "two_per_node", report)
    if extras:
        with report.section("degenerate"):
            for node_size in (1, world):
                name = f"{node_size}_per_node"
                other = Hierarchy.of(ctx, NodeLayout(world, node_size))
                _check_structure(other, name, report)
                _check_all_reduce(other, DEGENERATE_REDUCTIONS, name, report)
                _check_reduce_scatter(other, DEGENERATE_SCATTERS, name, report)
        with report.section("layout_for"):
            report.check("hier/layout_for/given", layout_for(ctx, 2) == NodeLayout(world, 2))
            report.check("hier/layout_for/variable",
                         layout_for(ctx, environ={"IRIS_LOCAL_WORLD_SIZE": "2"}) == NodeLayout(world, 2))
            # iris.spawn runs every rank on this host and sets LOCAL_WORLD_SIZE to the world's size
            report.check("hier/layout_for/one_host", layout_for(ctx) == NodeLayout(world, world))
        with report.section("refusals"):
            _check_refusals(ctx, h, report)
    with report.section("after"):
        ctx.barrier()
        report.check("hier/no_failure", not ctx.failed)
    ctx.destroy()
    return report.packed()


def _names(world: int, extras: bool) -> set[str]:
    """The checks of :func:`_worker` on every rank of ``world``."""

    def calls(name: str, reductions, scatters) -> set[str]:
        return {f"hier/{name}/node_group", f"hier/{name}/cross_group"} | {
            f"hier/{name}/all_reduce/{op}/{str(dtype)[6:]}/{numel}" for numel, op, dtype in reductions} | {
            f"hier/{name}/reduce_scatter/{op}/{share}" for share, op in scatters}

    names = calls("two_per_node", REDUCTIONS, SCATTERS) | {f"hier/two_per_node/all_gather/{shape}" for shape in GATHERS}
    names |= {f"hier/two_per_node/broadcast/{src}" for src in range(world)} | {"hier/two_per_node/all_to_all"}
    if extras:
        for node_size in (1, world):
            names |= calls(f"{node_size}_per_node", DEGENERATE_REDUCTIONS, DEGENERATE_SCATTERS)
        names |= {f"hier/layout_for/{check}" for check in ("given", "variable", "one_host")}
        names |= {f"hier/refuses/{refusal}" for refusal in REFUSALS}
    return names | {"hier/no_failure"}


def test_hierarchical_collectives_on_two_nodes_of_two():
    reports = reports_on_available_ranks(_worker, 4, True, timeout=120)
    assert_rank_checks(reports, "hier/", _names(4, extras=True))


def test_world6_hierarchical_collectives_on_three_nodes_of_two():
    reports = reports_on_available_ranks(_worker, 6, False, timeout=180)
    assert_rank_checks(reports, "hier/", _names(6, extras=False))
