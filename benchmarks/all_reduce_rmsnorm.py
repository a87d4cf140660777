"""All-reduce + residual add + RMSNorm: ``ctx.ops.all_reduce_rmsnorm`` (one kernel) against the
same computation as an all_reduce followed by torch's add and ``rms_norm``, with NCCL's all_reduce
(torch.distributed) and with iris's (``ctx.ccl.all_reduce``).

For each number of tokens per rank (default 1 to 4096 in powers of 2, hidden 8192, bf16), every
implementation runs once from the same input and is checked against the NCCL one (bf16 rounding:
the unfused ones round the sum to bf16 before normalising), then timed per call under CUDA graphs
(:func:`benchmarks.common.interleaved_per_call_us`: ``--calls`` calls captured as one graph,
``--repeats`` replays in turn, each rank's median, the slowest rank's as the figure). The fused
operation is timed by its automatic choice and by each method forced, which shows where the
threshold of :data:`iris_triton.tuning.ALL_REDUCE_RMSNORM_ONE_SHOT_UP_TO` should be. The unfused
all_reduces run in place on one buffer call after call (the values grow, which costs nothing; a
copy per call would add a local copy to their figures).

Launch it on one GPU (world size 1: nothing crosses a link, the figures are the kernels' costs),
under ``torchrun --nproc-per-node 2`` (2 GPUs), or with ``--cpu`` on 2 CPU ranks (Triton's
interpreter, gloo instead of NCCL, eager calls timed by the host clock, tiny defaults: the checks
and the JSON, not a measure of speed). Results go to ``benchmarks/runs/all_reduce_rmsnorm-<date>.json``
(or ``--out``).

    python -m benchmarks.all_reduce_rmsnorm [--cpu] [--tokens 1,16,256,4096] [--hidden 8192]
    torchrun --nproc-per-node 2 -m benchmarks.all_reduce_rmsnorm
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import iris
from benchmarks.common import interleaved_per_call_us, resolve, run_as_this_rank, synchronize, write_results
from iris_triton.operations.rmsnorm import choose_method

EPS = 1e-6
#: The torch.distributed backend of the baseline, per device type.
BASELINE = {"cuda": "nccl", "cpu": "gloo"}
#: Defaults per device type: CPU ranks interpret every kernel.
DEFAULTS = {"cuda": {"tokens": ",".join(str(1 << i) for i in range(13)), "hidden": 8192, "calls": 20,
                     "repeats": 15},
            "cpu": {"tokens": "1,5", "hidden": 96, "calls": 1, "repeats": 2}}


def heap_bytes(world: int, tokens: int, hidden: int) -> int:
    """Heap for the largest size: the fused operation's workspace (two slots of every rank's
    rows, three parts of them for two-shot), the collectives' (the same order), the unfused
    buffers, and the smaller workspaces that graphs captured before they grew keep alive until
    the size's graphs are gone (:meth:`iris.collectives.workspaces.Workspaces.release_graph_buffers`)."""
    row_bytes = tokens * hidden * 2
    return 32 * max(world, 2) * row_bytes + (512 << 20)


def implementations(ctx, tokens: int, hidden: int) -> dict:
    """``{name: (call, out, residual_out)}`` for one size; every call starts from the same x,
    residual and weight (seeded per rank), and ``call()`` may be repeated (the unfused ones
    reduce their buffer in place: check them on their first call)."""
    device, bf16 = ctx.device, torch.bfloat16
    g = torch.Generator(device).manual_seed(1 + ctx.rank)
    x = torch.randn(tokens, hidden, dtype=bf16, device=device, generator=g)
    residual = torch.randn(tokens, hidden, dtype=bf16, device=device, generator=torch.Generator(device).manual_seed(0))
    weight = 1 + torch.randn(hidden, dtype=bf16, device=device, generator=torch.Generator(device).manual_seed(1)) / 4
    impls = {}
    for method in (None, "one_shot", "two_shot"):
        out, residual_out = torch.empty_like(x), torch.empty_like(x)
        impls[f"fused_{method or 'auto'}"] = (
            lambda o=out, r=residual_out, m=method: ctx.ops.all_reduce_rmsnorm(o, x, residual, weight, EPS, r,
                                                                               method=m), out, residual_out)
    for name, all_reduce in ((BASELINE[device.type], dist.all_reduce), ("iris", ctx.ccl.all_reduce)):
        buf = ctx.empty(tokens, hidden, dtype=bf16)
        buf.copy_(x)
        out, residual_out = torch.empty_like(x), torch.empty_like(x)

        def unfused(b=buf, o=out, r=residual_out, reduce=all_reduce):
            reduce(b)
            torch.add(b, residual, out=r)
            o.copy_(torch.nn.functional.rms_norm(r, (hidden,), weight, EPS))

        impls[f"{name}+torch"] = (unfused, out, residual_out)
    return impls


def _measure(ctx, tokens: int, hidden: int, calls: int, repeats: int) -> dict:
    baseline = f"{BASELINE[ctx.device.type]}+torch"
    impls = implementations(ctx, tokens, hidden)
    results = {}
    for name, (call, out, residual_out) in impls.items():
        call()
        synchronize(ctx.device)
        results[name] = (out.float().cpu(), residual_out.float().cpu())
    ref_out, ref_sum = results[baseline]
    correct = {name: bool(torch.allclose(o, ref_out, rtol=2e-2, atol=2e-2) and
                          torch.allclose(r, ref_sum, rtol=2e-2, atol=2e-2)) for name, (o, r) in results.items()}
    mine = interleaved_per_call_us(ctx, {name: call for name, (call, _, _) in impls.items()}, calls, repeats)
    figures = {name: max(ctx.comm.all_gather_object(us)) for name, us in mine.items()}  # the slowest rank
    return {"tokens": tokens, "hidden": hidden, "world": ctx.world_size, "bytes": tokens * hidden * 2,
            "automatic_method": choose_method(ctx.world_size, tokens * hidden * 2),
            "mode": "graph" if ctx.device.type == "cuda" else "eager", "us": figures, "correct": correct}


def _run(rank: int, backend: str, token_counts: list[int], hidden: int, calls: int, repeats: int) -> list[dict]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ctx = iris.create(backend, heap_size=heap_bytes(world, max(token_counts), hidden))
    rows = []
    for tokens in token_counts:
        rows.append(_measure(ctx, tokens, hidden, calls, repeats))
        ctx.workspaces.release_graph_buffers()  # the size's graphs are gone: what they kept goes too
    ctx.destroy()
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.all_reduce_rmsnorm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=None, help="tokens per rank, comma-separated (default 1,2,4,...,4096)")
    parser.add_argument("--hidden", type=int, default=None, help="elements per token (default 8192)")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--calls", type=int, default=None, help="calls per timed sample (default 20)")
    parser.add_argument("--repeats", type=int, default=None, help="samples per figure (default 15)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--cpu", action="store_true",
                        help="2 CPU ranks (Triton's interpreter) with tiny defaults: checks the benchmark and its "
                             "JSON; the times are not a measure of speed")
    return resolve(parser.parse_args(argv), DEFAULTS)


def job(args: argparse.Namespace) -> tuple:
    """What every rank runs: ``(function, its arguments after the rank)``."""
    return _run, (args.backend, [int(t) for t in args.tokens.split(",")], args.hidden, args.calls, args.repeats)


def report(args: argparse.Namespace, rows: list[dict]) -> bool:
    """Print the rows, write the JSON; whether every implementation matched the baseline."""
    for row in rows:
        print(f"tokens {row['tokens']:>5} world {row['world']} ({row['automatic_method']}): "
              + ", ".join(f"{name} {us:.1f} us" for name, us in row["us"].items())
              + ("" if all(row["correct"].values()) else f"  INCORRECT: {row['correct']}"))
    timing = ("CUDA events around calls captured as one CUDA graph, replayed in turn" if args.device == "cuda"
              else "host clock (time.perf_counter) around eager calls")
    path = write_results("all_reduce_rmsnorm" + ("-cpu" if args.device == "cpu" else ""),
                         {"backend": args.backend, "unit": "us per call (slowest rank, median)",
                          "reference": f"{BASELINE[args.device]} all_reduce + torch add + rms_norm", "timing": timing,
                          "eps": EPS, "calls": args.calls, "repeats": args.repeats, "rows": rows},
                         args.out, args.device)
    print(f"wrote {path}")
    return all(all(row["correct"].values()) for row in rows)


def main(argv: list[str] | None = None) -> None:
    run_as_this_rank(parse_args(argv), job, report, "some results differ from the baseline's (INCORRECT above)")

if __name__ == "__main__":
    main()
