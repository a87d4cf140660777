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

    python -m benchmarks.fused [--tokens 2048,4096,8192,16384] [--out DIR]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import iris
from benchmarks.common import interleaved_per_call_us
from iris_triton.ops import METHODS

#: layer -> (operation, K, N): the per-rank product's inner and output dimensions.
LAYERS = {
    "QKV": ("all_gather_matmul", 8192, 5120),
    "O proj": ("matmul_reduce_scatter", 4096, 8192),
    "MLP up": ("all_gather_matmul", 8192, 28672),
    "MLP down": ("matmul_reduce_scatter", 14336, 8192),
}


def _implementations(ctx, operation: str, M: int, K: int, N: int) -> dict:
    """``{name: (call, output)}`` for one layer at ``M`` tokens."""
    world, device, bf16 = ctx.world_size, ctx.device, torch.bfloat16
    g = torch.Generator(device).manual_seed(ctx.rank)
    b = torch.randn(K, N, device=device, dtype=bf16, generator=g) / K**0.5
    impls = {}
    if operation == "all_gather_matmul":
        a_shard = torch.randn(M // world, K, device=device, dtype=bf16, generator=g)
        gathered = torch.empty(M, K, device=device, dtype=bf16)
        ref = torch.empty(M, N, device=device, dtype=bf16)
        impls["torch+nccl"] = (lambda: torch.matmul(dist.all_gather_into_tensor(gathered, a_shard) or gathered, b,
                                                    out=ref), ref)
        for method in (*METHODS, None):
            out = torch.empty(M, N, device=device, dtype=bf16)
            impls[f"iris_{method or 'auto'}"] = (
                lambda o=out, f=method: ctx.ops.all_gather_matmul(o, a_shard, b, method=f), out)
    else:
        a = torch.randn(M, K, device=device, dtype=bf16, generator=g)
        partial = torch.empty(M, N, device=device, dtype=bf16)
        ref = torch.empty(M // world, N, device=device, dtype=bf16)
        impls["torch+nccl"] = (lambda: dist.reduce_scatter_tensor(ref, torch.matmul(a, b, out=partial)), ref)
        for method in (*METHODS, None):
            out = torch.empty(M // world, N, device=device, dtype=bf16)
            impls[f"iris_{method or 'auto'}"] = (
                lambda o=out, f=method: ctx.ops.matmul_reduce_scatter(o, a, b, method=f), out)
    return impls


def _run(rank: int, tokens: list[int], calls: int, repeats: int) -> list[dict]:
    ctx = iris.create("triton", heap_size="6GiB")
    rows = []
    for layer, (operation, K, N) in LAYERS.items():
        for M in tokens:
            impls = _implementations(ctx, operation, M, K, N)
            row = {"layer": layer, "operation": operation, "M": M, "K": K, "N": N, "correct": {}, "ms": {}}
            for name, (fn, out) in impls.items():
                fn()
                torch.cuda.synchronize()
                reference = impls["torch+nccl"][1].float()
                row["correct"][name] = bool(torch.allclose(out.float(), reference, rtol=2e-2, atol=2e-2))
            mine = interleaved_per_call_us(ctx, {name: fn for name, (fn, _) in impls.items()}, calls, repeats)
            everyone = ctx.comm.all_gather_object(mine)
            row["ms"] = {name: max(rank_ms[name] for rank_ms in everyone) / 1e3 for name in impls}
            row["speedup"] = {name: row["ms"]["torch+nccl"] / ms for name, ms in row["ms"].items()
                              if name != "torch+nccl"}
            rows.append(row)
            del impls
            torch.cuda.empty_cache()
    ctx.destroy()
    return rows


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for layer in LAYERS:
        mine = [r for r in rows if r["layer"] == layer]
        for name, style in (("iris_auto", "-"), ("iris_fused", ":")):
            ax.plot([r["M"] for r in mine], [r["speedup"][name] for r in mine], style, marker="o",
                    label=f"{layer} {name.removeprefix('iris_')}")
    ax.axhline(1.0, color="grey", linestyle="--")
    ax.axhline(1.2, color="green", linestyle=":", label="1.2x target (QKV, O proj)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("speed-up over torch.matmul + NCCL")
    ax.set_title("iris matmul + communication, Llama-3-70B TP=2, bf16, 2 x H200")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="2048,4096,8192,16384")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("benchmarks.fused needs 2 GPUs")
    from benchmarks.common import write_results

    tokens = [int(t) for t in args.tokens.split(",")]
    rows = iris.spawn(_run, 2, tokens, args.calls, args.repeats, device="cuda")[0]
    for r in rows:
        print(f"{r['layer']:>9} M={r['M']:<6} torch+nccl {r['ms']['torch+nccl']:.3f} ms | "
              + ", ".join(f"{name.removeprefix('iris_')} {r['ms'][name]:.3f} ({x:.2f}x)"
                          for name, x in r["speedup"].items())
              + ("" if all(r["correct"].values()) else f"  INCORRECT {r['correct']}"))
    path = write_results("fused", {"unit": "ms per call, CUDA graph, slowest rank", "rows": rows}, args.out)
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
