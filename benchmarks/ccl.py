"""Collectives: iris vs NCCL (torch.distributed) vs torch SymmetricMemory, in one run.

For each collective and size (bytes of input per rank, bf16), every implementation is checked
against NCCL's result, then timed per call, eager and under CUDA graphs: ``--calls`` calls back
to back between CUDA events (captured as one graph, or launched eagerly), ``--repeats`` times;
each rank's median, and the slowest rank's median is the figure. In-place all_reduce is checked
on a fresh copy of the input but timed on the same buffer call after call (the values grow, which
costs nothing; a copy per call would add a local copy of the input to every figure). Results go to
``benchmarks/runs/ccl-<date>.json`` (or ``--out``) with one PNG per collective.

With ``--cpu`` the ranks are 2 CPU ranks (Triton's interpreter): gloo is the baseline and the
reference instead of NCCL, SymmetricMemory and CUDA graphs are left out, the eager calls are timed
by the host clock, and the defaults are tiny (128 B and 1 KiB, one call, two repeats); the results
go to ``ccl-<backend>-cpu-<date>.json``. The times say nothing of speed: such a run checks the
benchmark, its checks, JSON and plots where there is no GPU.

    python -m benchmarks.ccl [--cpu] [--min 8KiB] [--max 256MiB | --sizes 70MiB,...] [--backend triton] [--out DIR]
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist

import iris
from benchmarks.common import (
    add_sampling_options,
    calls_per_sample,
    in_place,
    per_call_us,
    ranks_label,
    resolve,
    run_command_line,
    size_ladder,
    synchronize,
    write_results,
)
from iris.config import parse_size
from iris_triton.collectives import low_latency
from iris_triton.collectives import sentinel

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
#: The torch.distributed backend every implementation is checked against, per device type.
BASELINE = {"cuda": "nccl", "cpu": "gloo"}
#: How calls are timed, per device type.
MODES = {"cuda": ("graph", "eager"), "cpu": ("eager",)}
#: Defaults per device type: CPU ranks interpret every kernel, a call takes a large fraction of a second.
DEFAULTS = {"cuda": {"min": "8KiB", "max": "256MiB", "calls": 20, "repeats": 15},
            "cpu": {"min": "128", "max": "1KiB", "calls": 1, "repeats": 2}}


def _implementations(ctx, collective: str, n: int, world: int):
    """``{name: (timed call, checked call, output tensor)}`` for one collective at ``n`` bf16
    elements of input; the checked call starts from the input, the timed call may not. The
    torch.distributed baseline is named after its backend (:data:`BASELINE`)."""
    device, bf16 = ctx.device, torch.bfloat16
    baseline = BASELINE[device.type]
    g = torch.Generator(device).manual_seed(ctx.rank)
    x = ctx.randn(n, dtype=bf16, generator=g)  # heap input, as an iris user would allocate it
    impls = {}
    if collective == "all_reduce":
        limits = {"low_latency": low_latency.MAX_BYTES, "sentinel": sentinel.MAX_BYTES}
        for algorithm in ("low_latency", "sentinel", "one_shot", "two_shot"):
            if algorithm in limits and n * 2 > limits[algorithm]:
                continue
            buf = ctx.empty(n, dtype=bf16)
            impls[f"iris_{algorithm}"] = in_place(buf, x,
                                                  lambda b=buf, a=algorithm: ctx.ccl.all_reduce(b, algorithm=a))
        ref = torch.empty(n, dtype=bf16, device=device)
        impls[baseline] = in_place(ref, x, lambda: dist.all_reduce(ref))
        if device.type == "cuda":  # SymmetricMemory needs GPUs
            impls.update(_symmetric_memory(x))
    elif collective == "all_gather":
        out, ref = ctx.empty(world * n, dtype=bf16), torch.empty(world * n, dtype=bf16, device=device)
        impls["iris"] = _same(lambda: ctx.ccl.all_gather(out, x), out)
        impls[baseline] = _same(lambda: dist.all_gather_into_tensor(ref, x), ref)
    elif collective == "reduce_scatter":
        out, ref = ctx.empty(n // world, dtype=bf16), torch.empty(n // world, dtype=bf16, device=device)
        impls["iris"] = _same(lambda: ctx.ccl.reduce_scatter(out, x), out)
        impls[baseline] = _same(lambda: dist.reduce_scatter_tensor(ref, x), ref)
    else:
        out, ref = ctx.empty(n, dtype=bf16), torch.empty(n, dtype=bf16, device=device)
        impls["iris"] = _same(lambda: ctx.ccl.all_to_all(out, x), out)
        impls[baseline] = _same(lambda: dist.all_to_all_single(ref, x), ref)
    return impls


def _same(call, out):
    """An implementation whose timed and checked calls are the same."""
    return call, call, out


def _symmetric_memory(x: torch.Tensor) -> dict:
    """torch SymmetricMemory's one-shot (out of place) and two-shot (in place) all_reduce."""
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    buf = symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device)
    symm_mem.rendezvous(buf, group)
    one_shot_out = torch.empty_like(x)

    def one_shot():
        torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", group, one_shot_out)

    def two_shot():
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group)

    return {"symm_mem_one_shot": (one_shot, lambda: (buf.copy_(x), one_shot()), one_shot_out),
            "symm_mem_two_shot": in_place(buf, x, two_shot)}


def _run(rank: int, backend: str, sizes: list[int], calls: int, repeats: int) -> list[dict]:
    # torch.distributed's all_gather_into_tensor and reduce_scatter_tensor: deprecated names, not news here.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    ctx = iris.create(backend, heap_size=24 * max(sizes) + (256 << 20))
    world, baseline, modes = ctx.world_size, BASELINE[ctx.device.type], MODES[ctx.device.type]
    rows = []
    for collective in COLLECTIVES:
        for size in sizes:
            n = size // 2 // world * world  # bf16 elements, divisible by the world size
            impls = _implementations(ctx, collective, n, world)
            results = {}
            for name, (_, checked, out) in impls.items():
                checked()
                synchronize(ctx.device)
                results[name] = out.float().cpu()
            row = {"collective": collective, "bytes": size,
                   "correct": {name: bool(torch.allclose(r, results[baseline], rtol=1e-2, atol=1e-2))
                               for name, r in results.items()}}
            for mode in modes:
                row[mode] = {}
                for name, (fn, _, _) in impls.items():
                    mine = per_call_us(ctx, fn, calls_per_sample(calls, size), repeats, mode == "graph")
                    row[mode][name] = max(ctx.comm.all_gather_object(mine))  # the slowest rank
            rows.append(row)
            ctx.barrier()
    ctx.destroy()
    return rows


def plot(rows: list[dict], path_stem, where: str = "2 x H200") -> list:
    """One PNG per collective, ``<path_stem>-<collective>.png``: every implementation's time
    against the size, per timing mode of the rows; ``where`` names the ranks in the titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for collective in COLLECTIVES:
        mine = [r for r in rows if r["collective"] == collective]
        fig, ax = plt.subplots(figsize=(8, 5))
        for mode, style in (("graph", "-"), ("eager", ":")):
            names = dict.fromkeys(name for r in mine for name in r.get(mode, ()))  # some run only at some sizes
            for name in names:
                measured = [r for r in mine if name in r[mode]]
                ax.plot([r["bytes"] for r in measured], [r[mode][name] for r in measured], style, marker="o",
                        label=f"{name} ({mode})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes of input per rank (bf16)")
        ax.set_ylabel("us per call (slowest rank, median)")
        ax.set_title(f"{collective}, {where}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = f"{path_stem}-{collective}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ccl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min", default=None, help="smallest size per rank (default 8KiB; 128 B with --cpu)")
    parser.add_argument("--max", default=None, help="largest size per rank (default 256MiB; 1 KiB with --cpu)")
    parser.add_argument("--sizes", default=None, help="sizes per rank instead of --min to --max in steps of 8x, "
                                                      "e.g. 70MiB,96MiB")
    parser.add_argument("--backend", default="triton")
    add_sampling_options(parser, DEFAULTS)
    return resolve(parser.parse_args(argv), DEFAULTS)


def jobs(args: argparse.Namespace) -> list[tuple]:
    """What every rank runs: ``[(function, its arguments after the rank)]``."""
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else size_ladder(args.min, args.max)
    return [(_run, (args.backend, sizes, args.calls, args.repeats))]


def report(args: argparse.Namespace, results: list) -> bool:
    """Print rank 0's rows, write the JSON and the plots; whether every implementation matched
    the baseline's result."""
    rows = results[0]
    for row in rows:
        print(f"{row['collective']:>15} {row['bytes']:>10} "
              + " | ".join(f"{mode}: " + ", ".join(f"{k} {v:.1f}" for k, v in row[mode].items())
                           for mode in MODES[args.device])
              + ("" if all(row["correct"].values()) else f"  INCORRECT: {row['correct']}"))
    name = f"ccl-{args.backend}" + ("-cpu" if args.device == "cpu" else "")
    timing = ("CUDA events around the calls, graph: captured as one CUDA graph" if args.device == "cuda"
              else "host clock (time.perf_counter) around eager calls")
    path = write_results(name, {"backend": args.backend, "unit": "us per call", "reference": BASELINE[args.device],
                                "timing": timing, "calls": args.calls, "repeats": args.repeats, "rows": rows},
                         args.out, args.device)
    plot(rows, str(path.with_suffix("")), ranks_label(args.device))
    print(f"wrote {path} and its plots")
    return all(all(row["correct"].values()) for row in rows)


def main(argv: list[str] | None = None) -> None:
    run_command_line(argv, parse_args, jobs, report, "some results differ from the baseline's (INCORRECT above)")


if __name__ == "__main__":
    main()
