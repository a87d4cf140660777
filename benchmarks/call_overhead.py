"""Per-call cost of iris's collectives on one GPU, as a world of one rank: what a call costs the
GPU (under CUDA graphs) and the host (eager), peers aside, beside a bare launch of the same
compiled kernel through Triton's launcher (the call's repeat: no checks, no guard, no lookup), so
that eager minus bare is iris's own host work. Run against an earlier revision with
scripts/ab_bench.sh to see what a change to the kernels' fixed work or to the host path costs.

    python -m benchmarks.call_overhead [--calls 200] [--repeats 15] [--out DIR]
"""

from __future__ import annotations

import argparse

import torch

import iris
from benchmarks.common import per_call_us, write_results

#: (algorithm, elements) of bf16 all_reduce calls: 8 KiB for each algorithm that takes it.
CASES = (("low_latency", 4096), ("sentinel", 4096), ("one_shot", 4096), ("two_shot", 4096))


def _bare_launch(ctx):
    """The compiled kernel of the last eager call, launched again through Triton's launcher with
    the same arguments: the repeat the collectives keep for the call (the only one they hold
    after clearing them and making one call)."""
    repeats = ctx._torch_ccl._repeats
    if len(repeats) != 1:
        raise RuntimeError(f"expected the repeat of one call, found {len(repeats)}")
    return next(iter(repeats.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per timed sample")
    parser.add_argument("--repeats", type=int, default=15, help="samples; the median is reported")
    parser.add_argument("--out", default=None, help="directory for the JSON result")
    args = parser.parse_args()
    ctx = iris.create(heap_size="256MiB")
    rows = []
    for algorithm, n in CASES:
        x = ctx.randn(n, dtype=torch.bfloat16)
        expected = x.clone()
        ctx.ccl.all_reduce(x, algorithm=algorithm)
        torch.cuda.synchronize()
        assert torch.equal(x, expected), f"{algorithm}: a world of one must leave the tensor as it was"

        def call(x=x, algorithm=algorithm):
            ctx.ccl.all_reduce(x, algorithm=algorithm)

        ctx._torch_ccl._repeats.clear()
        call()  # the call's repeat: the only one kept

        graph = per_call_us(ctx, call, args.calls, args.repeats, graph=True)
        eager = per_call_us(ctx, call, args.calls, args.repeats, graph=False)
        bare = per_call_us(ctx, _bare_launch(ctx), args.calls, args.repeats, graph=False)
        rows.append({"algorithm": algorithm, "bytes": n * 2, "graph_us": graph, "eager_us": eager, "bare_us": bare})
        print(f"all_reduce {algorithm:12s} {n * 2 >> 10} KiB: graph {graph:6.2f} us, eager {eager:6.2f} us, "
              f"bare launch {bare:6.2f} us (iris's host work {eager - bare:5.2f} us)")
    path = write_results("call_overhead", {"calls": args.calls, "repeats": args.repeats, "rows": rows}, args.out)
    print(f"wrote {path}")
    ctx.destroy()


if __name__ == "__main__":
    main()
