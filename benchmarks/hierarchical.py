"""The all_reduce of a world that spans nodes: iris's hierarchical path against NCCL, on 2 GPUs.

Two nodes of one GPU each are simulated on one machine (``iris.create(node_size=1)`` on 2 ranks:
each rank's heap is mapped by itself only), so ``ctx.ccl.all_reduce(t)`` runs hierarchically
(:class:`iris.collectives.hierarchical.Hierarchy`): iris's reduce_scatter inside the node (a node of one: a
copy), NCCL's all_reduce of the shard across the nodes (here the whole tensor), iris's all_gather
inside the node (a copy again). It is compared with plain NCCL (``dist.all_reduce``) on the same
two GPUs, and with iris's ordinary all_reduce over one node of both GPUs (a second context, made
without ``node_size``; its algorithm is the automatic choice). Each row records the ratio of the
hierarchical time to NCCL's, which ``benchmarks/NOTES.md`` predicts.

For each size (bytes of bf16 input per rank), every implementation runs once from the same input
(seeded per rank) and is checked against NCCL's result, then timed per call, under CUDA graphs and
eagerly: ``--calls`` calls back to back between CUDA events (four above 32 MiB), ``--repeats``
times; each rank's median, and the slowest rank's median is the figure. Under graphs each
implementation's calls are captured as one graph and the graphs are replayed in turn
(:func:`benchmarks.common.interleaved_per_call_us`). The all_reduces run in place on one buffer
call after call (the values grow, which costs nothing; a copy per call would add a local copy of
the input to every figure). Results go to ``benchmarks/runs/hierarchical-<date>.json`` (or
``--out``).

With ``--cpu`` the ranks are 2 CPU ranks (Triton's interpreter): gloo is the reference and the
cross-node step instead of NCCL, CUDA graphs are left out (they need GPUs), the eager calls are
timed by the host clock, and the defaults are tiny (128 B and 1 KiB, one call, two repeats); the
results go to ``hierarchical-cpu-<date>.json``. The times say nothing of speed: such a run checks
the benchmark, its checks and JSON where there is no GPU.

    python -m benchmarks.hierarchical [--cpu] [--sizes 8KiB,64KiB,...] [--calls 20] [--repeats 15] [--out DIR]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import iris
from benchmarks.ccl import BASELINE, MODES
from benchmarks.common import (
    LARGE_CALLS,
    add_sampling_options,
    calls_per_sample,
    in_place,
    resolve,
    run_command_line,
    slowest_per_call_us,
    synchronize,
    write_checked_rows,
)
from iris.config import parse_size

#: Defaults per device type: CPU ranks interpret every kernel, a call takes a large fraction of a second.
DEFAULTS = {"cuda": {"sizes": "8KiB,64KiB,512KiB,4MiB,32MiB,256MiB", "calls": 20, "repeats": 15},
            "cpu": {"sizes": "128,1KiB", "calls": 1, "repeats": 2}}
HIERARCHICAL, ONE_NODE = "iris_hierarchical", "iris_one_node"


def heap_bytes(largest: int) -> int:
    """Heap per context for sizes up to ``largest`` bytes: the in-place buffers; the workspace of
    the one-node all_reduce (two slots of two copies of the input, two-shot); and the node group's
    arena (an eighth of the heap), which holds the node steps' workspace (two slots of the input)
    and the smaller ones that graphs captured before it grew keep alive."""
    return 24 * largest + (256 << 20)


def _implementations(nodes, one_node, n: int) -> dict:
    """``{name: (timed call, checked call, output)}`` at ``n`` bf16 elements per rank: the
    hierarchical all_reduce (``nodes``: a context of 2 nodes), the one-node one (``one_node``)
    and the torch.distributed reference, named after its backend (:data:`benchmarks.ccl.BASELINE`);
    every checked call starts from the same input."""
    device = nodes.device
    x = torch.randn(n, generator=torch.Generator(device).manual_seed(nodes.rank), device=device).to(torch.bfloat16)
    hierarchical, one = nodes.empty(n, dtype=torch.bfloat16), one_node.empty(n, dtype=torch.bfloat16)
    reference = torch.empty_like(x)
    return {HIERARCHICAL: in_place(hierarchical, x, lambda: nodes.ccl.all_reduce(hierarchical)),
            ONE_NODE: in_place(one, x, lambda: one_node.ccl.all_reduce(one)),
            BASELINE[device.type]: in_place(reference, x, lambda: dist.all_reduce(reference))}


def _correct(impls: dict, baseline: str, device: torch.device) -> dict[str, bool]:
    """Run every implementation's checked call; whether each result matches the baseline's
    (bf16 rounding: the sums are rounded in different orders)."""
    results = {}
    for name, (_, checked, out) in impls.items():
        checked()
        synchronize(device)
        results[name] = out.float().cpu()
    return {name: bool(torch.allclose(result, results[baseline], rtol=1e-2, atol=1e-2))
            for name, result in results.items()}


def _measure(nodes, one_node, size: int, calls: int, repeats: int) -> dict:
    """One row: every implementation at ``size`` bytes per rank, checked, then timed in each mode."""
    device, world = nodes.device, nodes.world_size
    baseline = BASELINE[device.type]
    impls = _implementations(nodes, one_node, size // 2 // world * world)
    row = {"bytes": size, "correct": _correct(impls, baseline, device), "hierarchical_over_reference": {}}
    timed = {name: fn for name, (fn, _, _) in impls.items()}
    for mode in MODES[device.type]:
        row[mode] = slowest_per_call_us(nodes, timed, mode, calls_per_sample(calls, size), repeats)
        row["hierarchical_over_reference"][mode] = row[mode][HIERARCHICAL] / row[mode][baseline]
    return row


def _run(rank: int, sizes: list[int], calls: int, repeats: int) -> list[dict]:
    """Every rank's work: both contexts (2 nodes of 1 rank, and one node), then one row per size."""
    heap_size = heap_bytes(max(sizes))
    nodes = iris.create(heap_size=heap_size, node_size=1)
    one_node = iris.create(heap_size=heap_size)
    layout = nodes.node_layout
    if (layout.nodes, layout.node_size) != (nodes.world_size, 1) or nodes.hierarchy is None:
        raise RuntimeError(f"node_size=1 gave {layout.nodes} node(s) of {layout.node_size}: no hierarchical path")
    rows = []
    for size in sizes:
        rows.append(_measure(nodes, one_node, size, calls, repeats))
        for ctx in (nodes, one_node):  # the size's graphs are gone: what they kept goes too
            ctx.workspaces.release_graph_buffers()
    nodes.destroy()
    one_node.destroy()
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hierarchical", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=None, help="bytes of input per rank, comma-separated (default "
                                                      "8KiB,64KiB,512KiB,4MiB,32MiB,256MiB; 128,1KiB with --cpu)")
    add_sampling_options(parser, DEFAULTS)
    return resolve(parser.parse_args(argv), DEFAULTS)


def jobs(args: argparse.Namespace) -> list[tuple]:
    """What every rank runs: ``[(function, its arguments after the rank)]``."""
    return [(_run, ([parse_size(s) for s in args.sizes.split(",")], args.calls, args.repeats))]


def report(args: argparse.Namespace, results: list) -> bool:
    """Print rank 0's rows, write the JSON; whether every implementation matched the reference."""
    rows, baseline = results[0], BASELINE[args.device]
    for row in rows:
        print(f"{row['bytes']:>10} B "
              + " | ".join(f"{mode}: " + ", ".join(f"{name} {us:.1f}" for name, us in row[mode].items())
                           + f" (hierarchical / {baseline} {row['hierarchical_over_reference'][mode]:.2f})"
                           for mode in MODES[args.device])
              + ("" if all(row["correct"].values()) else f"  INCORRECT: {row['correct']}"))
    payload = {"unit": "us per call (slowest rank, median)", "reference": baseline,
               "layout": {HIERARCHICAL: "2 nodes of 1 rank (iris.create(node_size=1))",
                          ONE_NODE: "1 node of 2 ranks (iris.create())"},
               "calls": args.calls, "large_calls": LARGE_CALLS, "repeats": args.repeats, "rows": rows}
    return write_checked_rows("hierarchical", args, payload)


def main(argv: list[str] | None = None) -> None:
    run_command_line(argv, parse_args, jobs, report, "some results differ from the reference's (INCORRECT above)")


if __name__ == "__main__":
    main()
