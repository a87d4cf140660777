"""Fused matmul + communication (``ctx.ops``) against ``torch.matmul`` (cuBLAS) then NCCL, on 2 GPUs.

The tensor-parallel layers of Llama-3-70B at TP=2, bf16, for M (tokens) in ``--tokens``:

- QKV: ``all_gather_matmul``, A ``[M, 8192]`` gathered from rows of ``M / 2``, B ``[8192, 5120]``;
- O projection: ``matmul_reduce_scatter``, ``[M, 4096] x [4096, 8192]``;
- MLP up: ``all_gather_matmul``, B ``[8192, 28672]``;
- MLP down: ``matmul_reduce_scatter``, ``[M, 14336] x [14336, 8192]``.

Each layer runs as the sequential baseline (NCCL ``all_gather_into_tensor`` then ``torch.matmul``,
or ``torch.matmul`` then NCCL ``reduce_scatter_tensor``), by each of ``ctx.ops``'s methods
(``copy_engine``, ``fused``, ``sequential``), and as ``ctx.ops`` decides by itself
(``method=None``: "auto"). Results are checked against the baseline's, then
timed per call under CUDA graphs (``--calls`` calls per graph, median of ``--repeats``
replays taken in turn across the implementations, the slowest rank). Results go to
``benchmarks/runs/fused-<date>.json`` (or ``--out``) with a plot.

With ``--cpu`` the ranks are 2 CPU ranks (Triton's interpreter): two layers of tiny products
(one of each operation, :data:`CPU_LAYERS`) against ``torch.matmul`` then gloo, called eagerly
and timed by the host clock, 32 tokens, one repeat by default; the results go to
``fused-cpu-<date>.json``. The times say nothing of speed: such a run checks every method against
the baseline, and the JSON and plot, where there is no GPU.

    python -m benchmarks.fused [--cpu] [--tokens 2048,4096,8192,16384] [--out DIR]
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist
from iris_triton.operations.fused_ops import METHODS

import iris
from benchmarks.common import (
    add_sampling_options,
    interleaved_per_call_us,
    ranks_label,
    resolve,
    run_command_line,
    synchronize,
    write_results,
)

#: layer -> (operation, K, N): the per-rank product's inner and output dimensions.
LAYERS = {
    "QKV": ("all_gather_matmul", 8192, 5120),
    "O proj": ("matmul_reduce_scatter", 4096, 8192),
    "MLP up": ("all_gather_matmul", 8192, 28672),
    "MLP down": ("matmul_reduce_scatter", 14336, 8192),
}
#: The layers of a run on CPU ranks, where every tile is interpreted: tiny, ragged against the
#: interpreter's 16 x 16 x 16 tiles, one layer per operation.
CPU_LAYERS = {
    "tiny QKV": ("all_gather_matmul", 40, 24),
    "tiny O proj": ("matmul_reduce_scatter", 24, 40),
}
#: The sequential baseline's name (torch.matmul and the torch.distributed backend), per device type.
BASELINE = {"cuda": "torch+nccl", "cpu": "torch+gloo"}
#: Defaults per device type.
DEFAULTS = {"cuda": {"tokens": "2048,4096,8192,16384", "calls": 5, "repeats": 9},
            "cpu": {"tokens": "32", "calls": 1, "repeats": 1}}
HEAP_SIZE = {"cuda": "6GiB", "cpu": "64MiB"}


def _implementations(ctx, operation: str, M: int, K: int, N: int) -> dict:
    """``{name: (call, output)}`` for one layer at ``M`` tokens; the baseline first."""
    world, device, bf16 = ctx.world_size, ctx.device, torch.bfloat16
    baseline = BASELINE[device.type]
    g = torch.Generator(device).manual_seed(ctx.rank)
    b = torch.randn(K, N, device=device, dtype=bf16, generator=g) / K**0.5
    impls = {}
    if operation == "all_gather_matmul":
        a_shard = torch.randn(M // world, K, device=device, dtype=bf16, generator=g)
        gathered = torch.empty(M, K, device=device, dtype=bf16)
        ref = torch.empty(M, N, device=device, dtype=bf16)
        impls[baseline] = (lambda: torch.matmul(dist.all_gather_into_tensor(gathered, a_shard) or gathered, b,
                                                    out=ref), ref)
        for method in (*METHODS, None):
            out = torch.empty(M, N, device=device, dtype=bf16)
            impls[f"iris_{method or 'auto'}"] = (
                lambda o=out, f=method: ctx.ops.all_gather_matmul(o, a_shard, b, method=f), out)
    else:
        a = torch.randn(M, K, device=device, dtype=bf16, generator=g)
        partial = torch.empty(M, N, device=device, dtype=bf16)
        ref = torch.empty(M // world, N, device=device, dtype=bf16)
        impls[baseline] = (lambda: dist.reduce_scatter_tensor(ref, torch.matmul(a, b, out=partial)), ref)
        for method in (*METHODS, None):
            out = torch.empty(M // world, N, device=device, dtype=bf16)
            impls[f"iris_{method or 'auto'}"] = (
                lambda o=out, f=method: ctx.ops.matmul_reduce_scatter(o, a, b, method=f), out)
    return impls


def _run(rank: int, tokens: list[int], calls: int, repeats: int, heap_size: str = "6GiB") -> list[dict]:
    # torch.distributed's all_gather_into_tensor and reduce_scatter_tensor: deprecated names, not news here.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    ctx = iris.create("triton", heap_size=heap_size)
    baseline = BASELINE[ctx.device.type]
    rows = []
    for layer, (operation, K, N) in (LAYERS if ctx.device.type == "cuda" else CPU_LAYERS).items():
        for M in tokens:
            impls = _implementations(ctx, operation, M, K, N)
            row = {"layer": layer, "operation": operation, "M": M, "K": K, "N": N, "correct": {}, "ms": {}}
            for name, (fn, out) in impls.items():
                fn()
                synchronize(ctx.device)
                reference = impls[baseline][1].float()
                row["correct"][name] = bool(torch.allclose(out.float(), reference, rtol=2e-2, atol=2e-2))
            mine = interleaved_per_call_us(ctx, {name: fn for name, (fn, _) in impls.items()}, calls, repeats)
            everyone = ctx.comm.all_gather_object(mine)
            row["ms"] = {name: max(rank_ms[name] for rank_ms in everyone) / 1e3 for name in impls}
            row["speedup"] = {name: row["ms"][baseline] / ms for name, ms in row["ms"].items() if name != baseline}
            rows.append(row)
            del impls
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
    ctx.destroy()
    return rows


def plot(rows: list[dict], path, device: str = "cuda") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baseline = BASELINE[device]
    fig, ax = plt.subplots(figsize=(8, 5))
    for layer in dict.fromkeys(r["layer"] for r in rows):
        mine = [r for r in rows if r["layer"] == layer]
        for name, style in (("iris_auto", "-"), ("iris_fused", ":")):
            ax.plot([r["M"] for r in mine], [r["speedup"][name] for r in mine], style, marker="o",
                    label=f"{layer} {name.removeprefix('iris_')}")
    ax.axhline(1.0, color="grey", linestyle="--")
    if device == "cuda":
        ax.axhline(1.2, color="green", linestyle=":", label="1.2x target (QKV, O proj)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel(f"speed-up over {baseline.replace('+', ' + ').replace('torch ', 'torch.matmul ')}")
    model = "Llama-3-70B TP=2" if device == "cuda" else "tiny layers"
    ax.set_title(f"iris matmul + communication, {model}, bf16\n{ranks_label(device)}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fused", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=None,
                        help="comma-separated M (default 2048,4096,8192,16384; 32 with --cpu)")
    add_sampling_options(parser, DEFAULTS)
    return resolve(parser.parse_args(argv), DEFAULTS)


def jobs(args: argparse.Namespace) -> list[tuple]:
    """What every rank runs: ``[(function, its arguments after the rank)]``."""
    return [(_run, ([int(t) for t in args.tokens.split(",")], args.calls, args.repeats, HEAP_SIZE[args.device]))]


def report(args: argparse.Namespace, results: list) -> bool:
    """Print rank 0's rows, write the JSON and the plot; whether every method matched the baseline."""
    rows, baseline = results[0], BASELINE[args.device]
    for r in rows:
        print(f"{r['layer']:>11} M={r['M']:<6} {baseline} {r['ms'][baseline]:.3f} ms | "
              + ", ".join(f"{name.removeprefix('iris_')} {r['ms'][name]:.3f} ({x:.2f}x)"
                          for name, x in r["speedup"].items())
              + ("" if all(r["correct"].values()) else f"  INCORRECT {r['correct']}"))
    if args.device == "cuda":
        name, unit = "fused", "ms per call, CUDA graph, slowest rank"
    else:
        name, unit = "fused-cpu", "ms per call, eager, host clock (time.perf_counter), slowest rank"
    path = write_results(name, {"unit": unit, "baseline": baseline, "calls": args.calls, "repeats": args.repeats,
                                "rows": rows}, args.out, args.device)
    plot(rows, path.with_suffix(".png"), args.device)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return all(all(r["correct"].values()) for r in rows)


def main(argv: list[str] | None = None) -> None:
    run_command_line(argv, parse_args, jobs, report, "some results differ from the baseline's (INCORRECT above)")


if __name__ == "__main__":
    main()
