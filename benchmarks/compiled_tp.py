"""A tensor-parallel MLP layer with iris, eager and under ``torch.compile``, against torch + NCCL, on 2 GPUs.

The layer (as in ``examples/tp_mlp.py`` and ``docs/torch.md``): column-parallel up projection,
``all_gather_matmul`` of this rank's ``M / world`` rows of the activations with its columns of
``W1`` (``hidden x ffn / world``), ReLU, then row-parallel down projection,
``matmul_reduce_scatter`` with its rows of ``W2`` (``ffn / world x hidden``), which leaves each rank
its ``M / world`` rows of the output. Llama-like shapes by default: hidden 8192, ffn 28672 split
over the ranks, M (tokens, all ranks together) 2048 and 8192, bf16. It runs as:

- ``torch+nccl`` (the reference, for scale): NCCL ``all_gather_into_tensor``, cuBLAS products,
  NCCL ``reduce_scatter_tensor``, into buffers allocated once;
- ``iris_methods``: ``ctx.ops.all_gather_matmul(out, ...)`` and ``ctx.ops.matmul_reduce_scatter(out, ...)``
  into tensors the layer allocates, as eager code spells them;
- ``iris_functional``: ``iris.functional``'s ``all_gather_matmul`` and ``matmul_reduce_scatter``;
- ``iris_methods_compiled`` and ``iris_functional_compiled``: each of the two compiled with
  ``torch.compile(fullgraph=True, dynamic=False)`` (mode "default"; a graph break is an error),
  once per shape.

iris's operations take their automatic method. Every implementation runs once and its output is
checked against the reference's (bf16 rounding), then each is timed per call, under CUDA graphs
(each implementation's ``--calls`` calls captured as one graph, the graphs replayed in turn; the
compiled functions are captured as compiled) and eagerly (``--calls`` calls back to back), between
CUDA events, ``--repeats`` times: each rank's median, and the slowest rank's median is the figure.
Each row also gives every implementation's speed-up over the reference. Results go to
``benchmarks/runs/compiled_tp-<date>.json`` (or ``--out``).

With ``--cpu`` the ranks are 2 CPU ranks (Triton's interpreter): gloo instead of NCCL, a tiny
layer (hidden 40, ffn 48, 32 tokens: ragged against the interpreter's 16 x 16 x 16 tiles), CUDA
graphs left out (they need GPUs), the calls timed by the host clock; the compiled functions use
the ``aot_eager`` backend (Dynamo and AOTAutograd as on GPUs, without inductor's C++ compilation
of every graph). The results go to ``compiled_tp-cpu-<date>.json``. The times say nothing of speed:
such a run checks that every spelling compiles into one graph and matches the reference, and the
JSON, where there is no GPU.

    python -m benchmarks.compiled_tp [--cpu] [--tokens 2048,8192] [--hidden 8192] [--ffn 28672] [--out DIR]
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
import torch.distributed as dist

import iris
import iris.functional as F
from benchmarks.ccl import MODES
from benchmarks.common import (
    add_sampling_options,
    resolve,
    run_command_line,
    slowest_per_call_us,
    synchronize,
    write_checked_rows,
)
from benchmarks.fused import BASELINE, HEAP_SIZE

#: Defaults per device type: CPU ranks interpret every tile of the products.
DEFAULTS = {"cuda": {"tokens": "2048,8192", "hidden": 8192, "ffn": 28672, "calls": 5, "repeats": 9},
            "cpu": {"tokens": "32", "hidden": 40, "ffn": 48, "calls": 1, "repeats": 1}}
#: torch.compile's backend per device type: inductor on GPUs; on CPU ranks aot_eager, which traces
#: as inductor does but runs the graph without compiling C++ for it.
COMPILE_BACKEND = {"cuda": "inductor", "cpu": "aot_eager"}
#: The ranks the layer is split over (benchmarks.common.spawn_jobs starts 2).
RANKS = 2


def methods_layer(ctx):
    """The layer spelt with ``ctx.ops``'s in-place methods: ``(x_shard, w1, w2) -> y_shard``."""

    def layer(x_shard: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        rows = x_shard.shape[0]
        h = torch.empty(ctx.world_size * rows, w1.shape[1], dtype=x_shard.dtype, device=x_shard.device)
        ctx.ops.all_gather_matmul(h, x_shard, w1)
        y = torch.empty(rows, w2.shape[1], dtype=x_shard.dtype, device=x_shard.device)
        ctx.ops.matmul_reduce_scatter(y, torch.relu(h), w2)
        return y

    return layer


def functional_layer(ctx):
    """The layer spelt with ``iris.functional``: ``(x_shard, w1, w2) -> y_shard``."""

    def layer(x_shard: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return F.matmul_reduce_scatter(torch.relu(F.all_gather_matmul(x_shard, w1, ctx)), w2, ctx)

    return layer


def torch_layer(x_shard: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, world: int):
    """The reference: ``() -> y_shard``, the torch.distributed collectives and ``torch.matmul``
    into buffers allocated here, once."""
    rows = x_shard.shape[0]
    gathered = x_shard.new_empty(world * rows, x_shard.shape[1])
    h = x_shard.new_empty(world * rows, w1.shape[1])
    partial = x_shard.new_empty(world * rows, w2.shape[1])
    y = x_shard.new_empty(rows, w2.shape[1])

    def layer() -> torch.Tensor:
        dist.all_gather_into_tensor(gathered, x_shard)
        torch.relu_(torch.matmul(gathered, w1, out=h))
        dist.reduce_scatter_tensor(y, torch.matmul(h, w2, out=partial))
        return y

    return layer


def shards(ctx, tokens: int, hidden: int, ffn: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's rows of the activations and its shards of ``W1`` and ``W2`` (bf16, seeded per
    rank; the weights scaled to keep the outputs near 1)."""
    world, device = ctx.world_size, ctx.device
    g = torch.Generator(device).manual_seed(ctx.rank)
    x = torch.randn(tokens // world, hidden, generator=g, device=device)
    w1 = torch.randn(hidden, ffn // world, generator=g, device=device) / math.sqrt(hidden)
    w2 = torch.randn(ffn // world, hidden, generator=g, device=device) / math.sqrt(ffn)
    return x.bfloat16(), w1.bfloat16(), w2.bfloat16()


def _implementations(ctx, compiled: dict, tokens: int, hidden: int, ffn: int) -> dict:
    """``{name: () -> y_shard}`` at ``tokens``: the reference first, named after its backend
    (:data:`benchmarks.fused.BASELINE`), then iris's spellings, eager and compiled."""
    x, w1, w2 = shards(ctx, tokens, hidden, ffn)
    impls = {BASELINE[ctx.device.type]: torch_layer(x, w1, w2, ctx.world_size)}
    for name, layer in {"iris_methods": methods_layer(ctx), "iris_functional": functional_layer(ctx),
                        **compiled}.items():
        impls[name] = lambda f=layer: f(x, w1, w2)
    return impls


def _correct(impls: dict, baseline: str, device: torch.device) -> dict[str, bool]:
    """Run every implementation once; whether each output matches the baseline's (bf16 rounding)."""
    outputs = {}
    for name, fn in impls.items():
        outputs[name] = fn()
        synchronize(device)
    reference = outputs[baseline].float()
    return {name: bool(torch.allclose(out.float(), reference, rtol=2e-2, atol=2e-2)) for name, out in outputs.items()}


def _measure(ctx, compiled: dict, tokens: int, hidden: int, ffn: int, calls: int, repeats: int) -> dict:
    """One row: every implementation at ``tokens``, checked, then timed in each mode."""
    baseline = BASELINE[ctx.device.type]
    impls = _implementations(ctx, compiled, tokens, hidden, ffn)
    row = {"tokens": tokens, "hidden": hidden, "ffn_per_rank": ffn // ctx.world_size, "world": ctx.world_size,
           "correct": _correct(impls, baseline, ctx.device), "speedup": {}}
    for mode in MODES[ctx.device.type]:
        row[mode] = slowest_per_call_us(ctx, impls, mode, calls, repeats)
        row["speedup"][mode] = {name: row[mode][baseline] / us for name, us in row[mode].items() if name != baseline}
    return row


def _run(rank: int, token_counts: list[int], hidden: int, ffn: int, calls: int, repeats: int,
         heap_size: str) -> list[dict]:
    """Every rank's work: the compiled layers made once (compiled again for each shape), then one
    row per number of tokens."""
    # torch.distributed's all_gather_into_tensor and reduce_scatter_tensor: deprecated names, not news here.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    ctx = iris.create("triton", heap_size=heap_size)
    backend = COMPILE_BACKEND[ctx.device.type]
    compiled = {f"{name}_compiled": torch.compile(layer(ctx), fullgraph=True, dynamic=False, backend=backend)
                for name, layer in (("iris_methods", methods_layer), ("iris_functional", functional_layer))}
    rows = []
    for tokens in token_counts:
        rows.append(_measure(ctx, compiled, tokens, hidden, ffn, calls, repeats))
        ctx.workspaces.release_graph_buffers()  # the shape's graphs are gone: what they kept goes too
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    ctx.destroy()
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compiled_tp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=None,
                        help="M, rows of the activations on all ranks together, comma-separated (default 2048,8192)")
    parser.add_argument("--hidden", type=int, default=None, help="the model's width (default 8192)")
    parser.add_argument("--ffn", type=int, default=None, help="the MLP's width, split over the ranks (default 28672)")
    add_sampling_options(parser, DEFAULTS)
    args = resolve(parser.parse_args(argv), DEFAULTS)
    if any(int(t) % RANKS for t in args.tokens.split(",")) or args.ffn % RANKS:
        parser.error(f"--tokens and --ffn are split over {RANKS} ranks: pass multiples of {RANKS}")
    return args


def jobs(args: argparse.Namespace) -> list[tuple]:
    """What every rank runs: ``[(function, its arguments after the rank)]``."""
    # benchmarks.fused's heap: its layers include these products, at up to 16384 tokens.
    return [(_run, ([int(t) for t in args.tokens.split(",")], args.hidden, args.ffn, args.calls, args.repeats,
                   HEAP_SIZE[args.device]))]


def report(args: argparse.Namespace, results: list) -> bool:
    """Print rank 0's rows, write the JSON; whether every implementation matched the reference."""
    rows, baseline = results[0], BASELINE[args.device]
    for row in rows:
        print(f"M={row['tokens']:<6} " + " | ".join(
            f"{mode}: {baseline} {row[mode][baseline]:.1f} us, "
            + ", ".join(f"{name.removeprefix('iris_')} {row[mode][name]:.1f} ({x:.2f}x)"
                        for name, x in row["speedup"][mode].items())
            for mode in MODES[args.device])
              + ("" if all(row["correct"].values()) else f"  INCORRECT: {row['correct']}"))
    payload = {"unit": "us per call (slowest rank, median)", "reference": f"torch.matmul + {baseline.split('+')[1]}",
               "compile": {"backend": COMPILE_BACKEND[args.device], "mode": "default", "fullgraph": True,
                           "dynamic": False},
               "calls": args.calls, "repeats": args.repeats, "rows": rows}
    return write_checked_rows("compiled_tp", args, payload)


def main(argv: list[str] | None = None) -> None:
    run_command_line(argv, parse_args, jobs, report, "some results differ from the reference's (INCORRECT above)")


if __name__ == "__main__":
    main()
