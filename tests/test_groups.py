"""Sub-groups (``ctx.new_group``, ``ctx.new_subgroups``, ``group=``, ``iris.create(group=pg)``) on CPU
ranks, against torch.distributed on gloo over the same ranks with the same random data.

4 ranks as tensor-parallel x data-parallel (2 x 2): contiguous groups ``[[0, 1], [2, 3]]`` and strided
``[[0, 2], [1, 3]]`` made on one context, calls on both interleaved with world calls; the fused
operations, the rooted collectives, the uneven all-to-all and send/recv on a group; a context of
its own over a process group. 3 ranks with one group of 2
(``[0, 2]``): the non-member's calls are refused, and a member whose peer does not come gives up
naming the peer's world rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import iris
from iris.collectives.groups import GroupView
from iris.errors import IrisError, IrisTimeoutError
from iris.testing import RankReport, assert_rank_checks, reports_on_available_ranks, seeded_generator

#: Elements per rank of a collective call (divisible by the group sizes; several blocks).
N = 96
#: (rows per rank, K, N) of the fused operations.
SHAPE = (4, 16, 24)
#: Rounds of calls on the world, the TP and the DP groups, interleaved.
ROUNDS = 3


def _random(*shape, seed, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=seeded_generator(*seed)).to(dtype)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _check_collectives(ctx, group, name: str, round_: int, report: RankReport) -> None:
    """Every collective on ``group`` against torch.distributed on its process group."""
    pg, size = group.process_group, group.size
    x = _random(N, seed=(name, round_, ctx.rank))
    for op, reduce_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
        expected = x.clone()
        dist.all_reduce(expected, op=reduce_op, group=pg)
        got = ctx.ccl.all_reduce(x.to(ctx.device), op=op, group=group)
        report.check(f"groups/{name}/all_reduce/{op}/{round_}", _close(got.cpu(), expected))
    gathered = [torch.empty(N) for _ in range(size)]
    dist.all_gather(gathered, x, group=pg)
    out = torch.full((size, N), 7.0, device=ctx.device)
    report.check(f"groups/{name}/all_gather/{round_}",
                 torch.equal(ctx.ccl.all_gather(out, x.to(ctx.device), group=group).cpu(), torch.stack(gathered)))
    share = N // size  # gloo has no reduce_scatter: the reference reduces the gathered inputs
    expected = torch.stack(gathered).sum(0)[group.rank * share:(group.rank + 1) * share]
    out = torch.empty(share, device=ctx.device)
    report.check(f"groups/{name}/reduce_scatter/{round_}",
                 _close(ctx.ccl.reduce_scatter(out, x.to(ctx.device), group=group).cpu(), expected))
    expected = torch.empty(N)
    dist.all_to_all_single(expected, x, group=pg)
    out = torch.empty(N, device=ctx.device)
    report.check(f"groups/{name}/all_to_all/{round_}",
                 torch.equal(ctx.ccl.all_to_all(out, x.to(ctx.device), group=group).cpu(), expected))
    src = size - 1  # a group rank
    expected = x.clone()
    dist.broadcast(expected, group=pg, group_src=src)
    report.check(f"groups/{name}/broadcast/{round_}",
                 torch.equal(ctx.ccl.broadcast(x.to(ctx.device), src=src, group=group).cpu(), expected))


def _check_more_collectives(ctx, group, name: str, report: RankReport) -> None:
    """reduce, gather, scatter, uneven all_to_all_single and send/recv on ``group`` (roots and
    peers are group ranks) against torch.distributed on its process group."""
    pg, size, me = group.process_group, group.size, group.rank
    x = _random(N, seed=("more", name, ctx.rank))
    dev = ctx.device
    expected = x.clone()
    dist.reduce(expected, group=pg, group_dst=size - 1)
    got = ctx.ccl.reduce(x.to(dev), dst=size - 1, group=group).cpu()
    report.check(f"groups/{name}/reduce", _close(got, expected) if me == size - 1 else torch.equal(got, x))
    gathered = [torch.empty(N) for _ in range(size)] if me == 0 else None
    dist.gather(x, gathered, group=pg, group_dst=0)
    out = torch.empty(size, N, device=dev) if me == 0 else None
    ctx.ccl.gather(out, x.to(dev), dst=0, group=group)
    if me == 0:
        report.check(f"groups/{name}/gather", torch.equal(out.cpu(), torch.stack(gathered)))
    chunk = N // size
    expected = torch.empty(chunk)
    dist.scatter(expected, list(x.chunk(size)) if me == 0 else None, group=pg, group_src=0)
    out = torch.empty(chunk, device=dev)
    ctx.ccl.scatter(out, x.to(dev) if me == 0 else None, src=0, group=group)
    report.check(f"groups/{name}/scatter", torch.equal(out.cpu(), expected))
    splits = [[(3 * s + d) % 4 + 1 for d in range(size)] for s in range(size)]  # rows from s to d
    rows = _random(sum(splits[me]), 3, seed=("uneven", name, ctx.rank))
    expected = torch.empty(sum(splits[s][me] for s in range(size)), 3)
    received = [splits[s][me] for s in range(size)]
    dist.all_to_all_single(expected, rows, received, splits[me], group=pg)
    out = torch.empty_like(expected, device=dev)
    ctx.ccl.all_to_all_single(out, rows.to(dev), received, splits[me], group=group)
    report.check(f"groups/{name}/all_to_all_single", torch.equal(out.cpu(), expected))
    peer = 1 - me  # groups of 2: group ranks 0 and 1 exchange
    got = torch.empty(N, device=dev)
    if me == 0:
        ctx.ccl.send(x.to(dev), peer, group=group)
        ctx.ccl.recv(got, peer, group=group)
    else:
        ctx.ccl.recv(got, peer, group=group)
        ctx.ccl.send(x.to(dev), peer, group=group)
    everyone = [torch.empty(N) for _ in range(size)]
    dist.all_gather(everyone, x, group=pg)
    report.check(f"groups/{name}/send_recv", torch.equal(got.cpu(), everyone[peer]))


def _check_fused(ctx, group, name: str, report: RankReport) -> None:
    """all_gather_matmul and matmul_reduce_scatter on ``group`` against torch products of the
    group's gathered inputs."""
    m, k, n = SHAPE
    size, pg = group.size, group.process_group
    a = _random(m, k, seed=("a", name, ctx.rank), dtype=torch.bfloat16)
    b = _random(k, n, seed=("b", name, group.ranks), dtype=torch.bfloat16)  # the same on the group's ranks
    shards = [torch.empty_like(a) for _ in range(size)]
    dist.all_gather(shards, a, group=pg)
    expected = (torch.cat(shards).float() @ b.float())
    out = torch.empty(size * m, n, dtype=torch.bfloat16, device=ctx.device)
    ctx.ops.all_gather_matmul(out, a.to(ctx.device), b.to(ctx.device), group=group)
    report.check(f"groups/{name}/all_gather_matmul", _close(out.cpu(), expected, 3e-2))
    a_full = _random(size * m, k, seed=("full", name, ctx.rank), dtype=torch.bfloat16)
    partials = [torch.empty(size * m, n) for _ in range(size)]
    dist.all_gather(partials, (a_full.float() @ b.float()), group=pg)
    expected = torch.stack(partials).sum(0)[group.rank * m:(group.rank + 1) * m]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=ctx.device)
    ctx.ops.matmul_reduce_scatter(out, a_full.to(ctx.device), b.to(ctx.device), group=group)
    report.check(f"groups/{name}/matmul_reduce_scatter", _close(out.cpu(), expected, 5e-2))


def _tp_dp_worker(rank: int) -> bytes:
    report = RankReport(rank)
    ctx = iris.create()
    with report.section("layouts"):
        tp, tp_groups = ctx.new_subgroups(2)
        dp, dp_groups = ctx.new_subgroups(ranks_per_subgroup=[[0, 2], [1, 3]])
        report.check("groups/layout/tp", tp.ranks == (rank // 2 * 2, rank // 2 * 2 + 1) and tp.rank == rank % 2)
        report.check("groups/layout/dp", dp.ranks == (rank % 2, rank % 2 + 2) and dp.rank == rank // 2)
        report.check("groups/layout/all", [g.ranks for g in tp_groups] == [(0, 1), (2, 3)]
                     and [g.ranks for g in dp_groups] == [(0, 2), (1, 3)])
        for round_ in range(ROUNDS):  # the world's, the TP and the DP groups' calls interleaved
            _check_collectives(ctx, tp, "tp", round_, report)
            world = _random(N, seed=("world", round_, rank))
            expected = world.clone()
            dist.all_reduce(expected)
            report.check(f"groups/world/all_reduce/{round_}",
                         _close(ctx.ccl.all_reduce(world.to(ctx.device)).cpu(), expected))
            _check_collectives(ctx, dp, "dp", round_, report)
        _check_fused(ctx, tp, "tp", report)
        _check_fused(ctx, dp, "dp", report)
        _check_more_collectives(ctx, tp, "tp", report)
        _check_more_collectives(ctx, dp, "dp", report)
    with report.section("from_process_group"):
        pg = dist.new_group([1, 2, 3])
        made = ctx.new_group(pg)  # every world rank takes part, members or not
        if rank:
            x = _random(N, seed=("pg", rank))
            expected = x.clone()
            dist.all_reduce(expected, group=pg)
            report.check("groups/process_group/all_reduce",
                         _close(ctx.ccl.all_reduce(x.to(ctx.device), group=pg).cpu(), expected))
            report.check("groups/process_group/same_group", made.rank == rank - 1)
        else:
            report.check("groups/process_group/non_member", made.rank is None and made.ranks == (1, 2, 3))
    with report.section("own_context"):
        pgs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = pgs[rank // 2]
        sub = iris.create(group=mine, heap_size="32MiB")
        report.check("groups/own_context/identity", (sub.rank, sub.world_size) == (rank % 2, 2))
        x = _random(N, seed=("own", rank))
        expected = x.clone()
        dist.all_reduce(expected, group=mine)
        report.check("groups/own_context/all_reduce", _close(sub.ccl.all_reduce(x.to(sub.device)).cpu(), expected))
        out = torch.empty(2, N, device=sub.device)
        sub.ccl.all_gather(out, x.to(sub.device))
        report.check("groups/own_context/all_gather", torch.equal(out[rank % 2].cpu(), x))
        sub.destroy()
    with report.section("errors"):
        try:
            ctx.new_subgroups(3)
            report.check("groups/errors/indivisible", False)
        except IrisError as error:
            report.check("groups/errors/indivisible", "positive divisor of the world size 4" in str(error))
        try:
            ctx.ccl.broadcast(torch.zeros(4, device=ctx.device), src=2, group=tp)
            report.check("groups/errors/src_is_a_group_rank", False)
        except IrisError as error:
            report.check("groups/errors/src_is_a_group_rank",
                         "(group ranks 0..1; src/dst arguments are group ranks)" in str(error))
        other = dist.new_group([0, 1, 2, 3])
        try:
            ctx.ccl.all_reduce(torch.zeros(4, device=ctx.device), group=other)
            report.check("groups/errors/unknown_process_group", False)
        except IrisError as error:
            report.check("groups/errors/unknown_process_group", "ctx.new_group(process_group)" in str(error))
        ctx.barrier()
        report.check("groups/no_failure", not ctx.failed)
    ctx.destroy()
    return report.packed()


def _partial_worker(rank: int) -> bytes:
    """3 ranks, group [0, 2]: rank 1 is refused; rank 2 skips one call, so rank 0 gives up."""
    report = RankReport(rank)
    ctx = iris.create(timeout=3)
    with report.section("partial"):
        group = ctx.new_group([0, 2])
        report.check("partial/membership", group.rank == {0: 0, 1: None, 2: 1}[rank])
        x = _random(N, seed=("partial", rank)).to(ctx.device)
        if rank == 1:
            try:
                ctx.ccl.all_reduce(x, group=group)
                report.check("partial/non_member_refused", False)
            except IrisError as error:
                report.check("partial/non_member_refused", "world rank 1 is not a member" in str(error))
        else:
            _check_collectives(ctx, group, "pair", 0, report)
            _check_more_collectives(ctx, group, "pair", report)
            pg = group.process_group
            expected = x.cpu().clone()
            dist.all_reduce(expected, group=pg)
            report.check("partial/all_reduce", _close(ctx.ccl.all_reduce(x.clone(), group=group).cpu(), expected))
            if rank == 0:  # rank 2 does not make this call
                t = x.clone()
                try:
                    ctx.ccl.all_reduce(t, group=group)
                    ctx.check()  # on GPUs the failure is raised by the next call
                    report.check("partial/gave_up", False)
                except IrisTimeoutError as error:
                    report.check("partial/gave_up", "world rank(s) [2]" in str(error))
                    report.check("partial/poisoned", bool(torch.isnan(t).all().item()))
                # The group's view keeps no copy of the context's state: it refers to the context's
                # facts and reads its fail-stop state, here the failure the group's call recorded.
                view = group.view
                report.check("view/shares_the_facts",
                             all(getattr(view, name) is getattr(ctx, name) for name in GroupView.SHARED))
                report.check("view/reads_the_failure", view._failure is ctx._failure is not None and view.failed)
                ctx.tuning = ctx.tuning.merged({})  # as tuning puts its table in force
                report.check("view/reads_the_tuned_choices", view.tuning is ctx.tuning)
                try:
                    view.ccl.tune(["all_reduce"], [torch.float32], [1 << 10], save=False)
                    report.check("view/tuning_refused", False)
                except IrisError as error:
                    report.check("view/tuning_refused", "tune on the world context" in str(error))
                report.check("view/own_identity", (view.rank, view.world_size, view.group_ranks) == (0, 2, (0, 2))
                             and view.heap is not ctx.heap and view.comm is not ctx.comm)
        dist.barrier()  # rank 2 waits (on torch's group) until rank 0 gave up
    return report.packed()


def _group_names(name: str, group_rank: int, rounds: int) -> set[str]:
    """The checks :func:`_check_collectives` (``rounds`` rounds) and :func:`_check_more_collectives`
    make on a group rank of group ``name`` (group rank 0, the root of the gather, also checks it)."""
    names = {f"groups/{name}/{check}/{round_}" for round_ in range(rounds) for check in (
        "all_reduce/sum", "all_reduce/max", "all_gather", "reduce_scatter", "all_to_all", "broadcast")}
    names |= {f"groups/{name}/{check}" for check in ("reduce", "scatter", "all_to_all_single", "send_recv")}
    return names | ({f"groups/{name}/gather"} if group_rank == 0 else set())


def _tp_dp_names(rank: int) -> set[str]:
    """The checks of :func:`_tp_dp_worker` on ``rank`` (rank 0 is not in the process group [1, 2, 3])."""
    names = _group_names("tp", rank % 2, ROUNDS) | _group_names("dp", rank // 2, ROUNDS)
    names |= {f"groups/{name}/{fused}" for name in ("tp", "dp") for fused in ("all_gather_matmul",
                                                                             "matmul_reduce_scatter")}
    names |= {f"groups/world/all_reduce/{round_}" for round_ in range(ROUNDS)}
    names |= {"groups/process_group/non_member"} if rank == 0 else {"groups/process_group/all_reduce",
                                                                   "groups/process_group/same_group"}
    names |= {f"groups/own_context/{check}" for check in ("identity", "all_reduce", "all_gather")}
    names |= {f"groups/errors/{check}" for check in ("indivisible", "src_is_a_group_rank", "unknown_process_group")}
    return names | {"groups/layout/tp", "groups/layout/dp", "groups/layout/all", "groups/no_failure"}


def test_tensor_and_data_parallel_groups_on_four_ranks():
    reports = reports_on_available_ranks(_tp_dp_worker, 4, timeout=120)
    assert_rank_checks(reports, "groups/", _tp_dp_names)


def test_a_group_of_two_in_three_ranks():
    reports = reports_on_available_ranks(_partial_worker, 3, timeout=60)
    # Rank 0 makes the call rank 2 skips; rank 1 is not a member.
    own = {0: {"partial/all_reduce", "partial/gave_up", "partial/poisoned"}, 1: {"partial/non_member_refused"},
           2: {"partial/all_reduce"}}
    assert_rank_checks(reports, "partial/", lambda rank: own[rank] | {"partial/membership", "partial/completed"})
    view = {"view/shares_the_facts", "view/reads_the_failure", "view/reads_the_tuned_choices", "view/tuning_refused",
            "view/own_identity"}
    assert_rank_checks(reports, "view/", lambda rank: view if rank == 0 else set())
    group_rank = {0: 0, 2: 1}
    assert_rank_checks(reports, "groups/pair/",
                       lambda rank: _group_names("pair", group_rank[rank], 1) if rank in group_rank else set())
