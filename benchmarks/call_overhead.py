"""Per-call cost of iris's collectives on one GPU, as a world of one rank: what a call costs the
GPU (under CUDA graphs) and the host (eager), peers aside. Run against an earlier revision with
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

        graph = per_call_us(ctx, call, args.calls, args.repeats, graph=True)
        eager = per_call_us(ctx, call, args.calls, args.repeats, graph=False)
        rows.append({"algorithm": algorithm, "bytes": n * 2, "graph_us": graph, "eager_us": eager})
        print(f"all_reduce {algorithm:12s} {n * 2 >> 10} KiB: graph {graph:6.2f} us, eager {eager:6.2f} us")
    path = write_results("call_overhead", {"calls": args.calls, "repeats": args.repeats, "rows": rows}, args.out)
    print(f"wrote {path}")
    ctx.destroy()


if __name__ == "__main__":
    main()
