"""Per-call cost of iris's collectives and of a fused operation on one GPU, as a world of one
rank: what a call costs the GPU (under CUDA graphs) and the host (eager), peers aside, beside a
bare launch of the same compiled kernel through Triton's launcher (the call's repeat,
:mod:`iris.calls.repeats`, launched alone: no checks, no guard, no lookup), so that eager minus
bare is iris's own host work; and NCCL's eager all_reduce of the same size in the same run.
That host work is also taken by the host clock alone, call and bare launch sampled in turn
(:func:`benchmarks.common.host_work_us`): the events' figures include the device, and a host whose
speed drifts between two separately timed figures moves their difference.
Run against an earlier revision with scripts/ab_bench.sh to see what a change to the kernels'
fixed work or to the host path costs.

    python -m benchmarks.call_overhead [--calls 200] [--repeats 15] [--out DIR]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import iris
from benchmarks.common import host_work_us, per_call_us, write_results

#: bf16 all_reduce sizes (bytes), each by every algorithm that takes it.
SIZES = (8 << 10, 64 << 10)
ALGORITHMS = ("low_latency", "sentinel", "one_shot", "two_shot")
#: (tokens, hidden) of the fused all_reduce + RMSNorm, bf16, by each of its methods.
RMSNORM = (8, 4096)
RMSNORM_METHODS = ("one_shot", "two_shot")


def _timed(ctx, call, bare, calls: int, repeats: int) -> dict:
    """``call`` under a graph and eagerly, and ``bare`` (its repeat) eagerly, in microseconds; and
    both by the host clock in turn (:func:`host_work_us`)."""
    if bare is None:
        raise RuntimeError("the call kept no repeat to launch bare")
    graph = per_call_us(ctx, call, calls, repeats, graph=True)
    eager = per_call_us(ctx, call, calls, repeats, graph=False)
    return {"graph_us": graph, "eager_us": eager, "bare_us": per_call_us(ctx, bare, calls, repeats, graph=False),
            **host_work_us(ctx, call, bare, calls, repeats)}


def _all_reduce_rows(ctx, calls: int, repeats: int) -> list[dict]:
    rows = []
    for nbytes in SIZES:
        x = ctx.randn(nbytes // 2, dtype=torch.bfloat16)
        expected = x.clone()
        reference = x.clone()
        nccl = per_call_us(ctx, lambda reference=reference: dist.all_reduce(reference), calls, repeats, graph=False)
        for algorithm in ctx.ccl.algorithms("all_reduce", applying_to=x, op="sum"):
            if algorithm not in ALGORITHMS:
                continue
            ctx.ccl.all_reduce(x, algorithm=algorithm)
            torch.cuda.synchronize()
            assert torch.equal(x, expected), f"{algorithm}: a world of one must leave the tensor as it was"

            def call(x=x, algorithm=algorithm):
                ctx.ccl.all_reduce(x, algorithm=algorithm)

            bare = ctx.ccl._repeats.kept("all_reduce", x, algorithm=algorithm)
            row = {"call": "all_reduce", "algorithm": algorithm, "bytes": nbytes,
                   **_timed(ctx, call, bare, calls, repeats), "nccl_eager_us": nccl}
            rows.append(row)
            _print(row)
    return rows


def _rmsnorm_rows(ctx, calls: int, repeats: int) -> list[dict]:
    tokens, hidden = RMSNORM
    x, residual = ctx.randn(tokens, hidden, dtype=torch.bfloat16), torch.randn(tokens, hidden, dtype=torch.bfloat16,
                                                                              device=ctx.device)
    weight, out = torch.rand(hidden, dtype=torch.bfloat16, device=ctx.device), torch.empty_like(residual)
    expected = torch.nn.functional.rms_norm((x.float() + residual.float()), (hidden,), weight.float(), 1e-6)
    rows = []
    for method in RMSNORM_METHODS:
        ctx.ops.all_reduce_rmsnorm(out, x, residual, weight, method=method)
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)

        def call(method=method):
            ctx.ops.all_reduce_rmsnorm(out, x, residual, weight, method=method)

        bare = ctx.ops._repeats.kept("all_reduce_rmsnorm", out, x, residual, weight, method=method)
        row = {"call": "all_reduce_rmsnorm", "algorithm": method, "bytes": x.numel() * 2,
               **_timed(ctx, call, bare, calls, repeats)}
        rows.append(row)
        _print(row)
    return rows


def _print(row: dict) -> None:
    nccl = f", NCCL eager {row['nccl_eager_us']:6.2f} us" if "nccl_eager_us" in row else ""
    print(f"{row['call']} {row['algorithm']:12s} {row['bytes'] >> 10:3d} KiB: graph {row['graph_us']:6.2f} us, "
          f"eager {row['eager_us']:6.2f} us, bare launch {row['bare_us']:6.2f} us (iris's host work "
          f"{row['eager_us'] - row['bare_us']:5.2f} us; by the host clock {row['host_work_us']:5.2f} us of "
          f"{row['host_call_us']:6.2f}){nccl}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per timed sample")
    parser.add_argument("--repeats", type=int, default=15, help="samples; the median is reported")
    parser.add_argument("--out", default=None, help="directory for the JSON result")
    args = parser.parse_args()
    ctx = iris.create(heap_size="256MiB")
    rows = _all_reduce_rows(ctx, args.calls, args.repeats) + _rmsnorm_rows(ctx, args.calls, args.repeats)
    path = write_results("call_overhead", {"calls": args.calls, "repeats": args.repeats, "rows": rows}, args.out)
    print(f"wrote {path}")
    ctx.destroy()


if __name__ == "__main__":
    main()
