"""The dedicated MoE dispatch kernels (iris_triton.operations.moe_kernels) against ctx.ops.moe_dispatch
on CPU ranks: the same received tokens, counts and sources, expert by expert."""

from __future__ import annotations

import pytest
import torch

import iris
from iris.testing import RankReport, assert_rank_checks, reports_on_available_ranks, seeded_generator

#: (topk, experts per rank, tokens, hidden, fp8)
CASES = ((2, 2, 6, 8, False), (1, 1, 5, 4, False), (3, 3, 7, 8, False), (2, 2, 6, 8, True))
CALLS = 3


def _worker(rank: int) -> bytes:
    from iris_triton.operations.moe_kernels import combine, dispatch

    report = RankReport(rank)
    ctx = iris.create(heap_size="64MiB")
    world = ctx.world_size
    with report.section("direct"):
        for topk, per_rank, tokens, hidden, fp8 in CASES:
            experts = per_rank * world
            for call in range(CALLS):
                g = seeded_generator("direct", rank, world, topk, call)
                ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
                ids[0, -1] = -1
                if topk > 1:
                    ids[1, 1] = ids[1, 0]  # a repeat: sent once, both weights count
                x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
                w = torch.rand(tokens, topk, generator=g)
                expected = ctx.ops.moe_dispatch(x, ids, w, experts, fp8=fp8)
                (data, scales, counts, source_rank, source_index, _), handle = dispatch(ctx.ops, x, ids, w, experts,
                                                                                        fp8=fp8)
                name = f"direct/{topk}-{per_rank}-{tokens}{'-fp8' if fp8 else ''}/{call}"
                same = torch.equal(counts, expected.counts)
                for e, n in enumerate(expected.counts.tolist()):
                    same &= torch.equal(data[e, :n].view(torch.uint8), expected.tokens[e, :n].view(torch.uint8))
                    if fp8:
                        same &= torch.equal(scales[e, :n], expected.scales[e, :n])
                same &= torch.equal(source_rank, expected.source_rank)
                same &= torch.equal(source_index, expected.source_index)
                report.check(name, bool(same) or f"counts {counts.tolist()} vs {expected.counts.tolist()}")
                # Expert e's output: its tokens times e + 1.
                scale = (torch.arange(per_rank) + rank * per_rank + 1.0).view(-1, 1, 1)
                def dequantized(tokens, scales):
                    return tokens.float() * (scales[..., None] if fp8 else 1.0)

                reference = ctx.ops.moe_combine((dequantized(expected.tokens, expected.scales) * scale).to(x.dtype),
                                                expected)
                got = combine((dequantized(data, scales) * scale).to(x.dtype), handle)
                report.check(f"{name}/combine", torch.allclose(got.float(), reference.float(), rtol=1e-2, atol=1e-2)
                             or f"largest difference {(got.float() - reference.float()).abs().max().item()}")
    ctx.destroy()
    return report.packed()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_direct_dispatch_matches_moe_dispatch(world):
    reports = reports_on_available_ranks(_worker, world, timeout=120)
    assert_rank_checks(reports, "direct/", world * (2 * len(CASES) * CALLS + 1))


def _faults_worker(rank: int) -> bytes:
    from iris.errors import IrisTimeoutError
    from iris_triton.operations.moe_kernels import dispatch

    report = RankReport(rank)
    world = 2
    with report.section("faults"):
        # Every token of every rank to expert 0, capacity 1: over capacity on rank 0, found alike everywhere.
        ctx = iris.create(heap_size="64MiB", timeout=2)
        ids = torch.zeros(3, 1, dtype=torch.int64)
        x = torch.randn(3, 8).to(torch.bfloat16)
        w = torch.ones(3, 1)
        try:
            dispatch(ctx.ops, x, ids, w, 2 * world, capacity=1)
            report.check("faults/over_capacity", False)
        except IrisTimeoutError as error:
            report.check("faults/over_capacity", "world rank(s) [0]" in str(error) and "capacity" in str(error)
                         or str(error))
        ctx.destroy()
    return report.packed()


def test_direct_dispatch_fails_stop_over_capacity():
    reports = reports_on_available_ranks(_faults_worker, 2, timeout=120)
    assert_rank_checks(reports, "faults/", {"faults/over_capacity", "faults/completed"})
