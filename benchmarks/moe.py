"""MoE token routing: ``ctx.ops.moe_dispatch`` and ``ctx.ops.moe_combine`` against a torch
reference on ``all_to_all_single`` (NCCL on GPUs, gloo on CPU ranks), dispatch and combine timed
separately.

For each number of tokens per rank (default 128 to 8192, hidden 7168, bf16, top-8 of 64 experts, a
random routing drawn on the device), both implementations run once and are checked against each
other (every expert's tokens exactly, in (source rank, token) order; combine's output, the identity
expert, within bf16 rounding), then timed per call: ``--calls`` calls back to back, ``--repeats``
times, each rank's median and the slowest rank's as the figure. The reference exchanges its split
sizes on the host (a synchronisation per call), so it is timed eagerly; iris is timed eagerly and,
on GPUs, captured in a CUDA graph, and each of its kernels' GPU time per dispatch + combine is taken
with torch.profiler, and each eager call's launches are counted and timed bare (the host time of its
compiled kernels' launches alone), beside the host's own time per eager call (the same bursts by the
host clock: what the events' figure would be were the host all that limits it). Each row also gives
the bytes of token data that cross the link (rows sent to other ranks, the most any rank sends) and
the fraction of ``--link-gbps`` (478 GB/s per direction between 2 x H200) that the time makes of
them, and the HBM bound of the token data a rank's memory must move (dispatch: read its tokens,
write the rows it receives; combine: read the rows it holds, write its tokens) at the local copy
rate measured in the same run (``copy_`` of a large buffer, read + write), with each time as a
multiple of it: at world 1 nothing crosses a link, and that bound is the floor.

Launch it on one GPU (world size 1: nothing crosses a link, the figures are the costs of the
kernels against the HBM bound), under ``torchrun --nproc-per-node 2`` (2 GPUs), or with
``--cpu`` on 2 CPU ranks (Triton's interpreter, tiny defaults: the checks and the JSON, not a
measure of speed). Results go to ``benchmarks/runs/moe-<date>.json`` (or ``--out``).

    python -m benchmarks.moe [--cpu] [--tokens 128,1024,8192] [--hidden 7168] [--experts 64] [--topk 8]
    torchrun --nproc-per-node 2 -m benchmarks.moe
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import iris
from iris.calls.repeats import invalidate as invalidate_repeats
from iris_triton.operations.moe_kernels import slot_bytes
from benchmarks.common import host_per_call_us, per_call_us, resolve, run_as_this_rank, synchronize, write_results

#: The link between 2 x H200, per direction (GB/s).
LINK_GBPS = 478.0
#: Defaults per device type: CPU ranks interpret every kernel.
DEFAULTS = {"cuda": {"tokens": "128,256,512,1024,2048,4096,8192", "hidden": 7168, "experts": 64, "topk": 8,
                     "calls": 10, "repeats": 10},
            "cpu": {"tokens": "4,8", "hidden": 32, "experts": 8, "topk": 2, "calls": 1, "repeats": 2}}


def routing(tokens: int, experts: int, topk: int, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random top-k routing (distinct experts per token) and softmax weights, on ``device``."""
    g = torch.Generator(device).manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g, device=device)
    weights, ids = scores.topk(topk, dim=1)
    return ids, torch.softmax(weights, dim=1)


class TorchReference:
    """Dispatch and combine with torch ops and ``all_to_all_single``: pairs sorted by (expert,
    token), the per-expert counts exchanged on the device, the split sizes read on the host,
    the rows exchanged, then regrouped by local expert (stable: (source rank, token) order)."""

    def __init__(self, world: int, experts: int):
        self.world, self.experts, self.local = world, experts, experts // world

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """``(rows grouped by local expert, counts per local expert, state for combine)``."""
        T, k = ids.shape
        flat = ids.reshape(-1)
        token = torch.arange(T * k, device=x.device) // k
        order = torch.argsort(flat * T + token)
        counts = torch.bincount(flat, minlength=self.experts)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts)
        sends = counts.view(self.world, self.local).sum(1).tolist()
        receives = received.view(self.world, self.local).sum(1).tolist()
        rows = torch.empty(sum(receives), x.shape[1], dtype=x.dtype, device=x.device)
        dist.all_to_all_single(rows, x[token[order]], receives, sends)
        expert = torch.repeat_interleave(torch.arange(self.local, device=x.device).repeat(self.world),
                                         received, output_size=rows.shape[0])
        regroup = torch.argsort(expert, stable=True)
        per_expert = received.view(self.world, self.local).sum(0)
        return rows[regroup], per_expert, (order, token, regroup, sends, receives)

    def combine(self, expert_rows: torch.Tensor, weights: torch.Tensor, state: tuple) -> torch.Tensor:
        """``sum_j w[t, j] * expert_rows[row of (t, j)]`` back on the token's rank (float32 sums)."""
        order, token, regroup, sends, receives = state
        back = torch.empty_like(expert_rows)
        back[regroup] = expert_rows
        returned = torch.empty(sum(sends), expert_rows.shape[1], dtype=expert_rows.dtype, device=back.device)
        dist.all_to_all_single(returned, back, sends, receives)
        T = weights.shape[0]
        total = torch.zeros(T, expert_rows.shape[1], dtype=torch.float32, device=back.device)
        total.index_add_(0, token[order], returned.float() * weights.reshape(-1)[order, None])
        return total.to(expert_rows.dtype)


def _matches(result, grouped: torch.Tensor, counts: torch.Tensor) -> bool:
    """iris's received tokens equal the reference's, expert by expert."""
    if not torch.equal(result.counts.long().cpu(), counts.cpu()):
        return False
    start = 0
    for e, n in enumerate(counts.tolist()):
        if not torch.equal(result.tokens[e, :n], grouped[start:start + n]):
            return False
        start += n
    return True


def heap_bytes(world: int, token_counts: list[int], hidden: int, experts: int) -> int:
    """A heap for every call's receive buffers (two slots at the default capacity, ``world *
    tokens`` rows per expert; a workspace that grows after a CUDA graph capture keeps its old
    bytes for the graphs), and room for combine's return buffers and the small workspaces."""
    return sum(2 * slot_bytes(world, experts, world * T, hidden, 2) for T in token_counts) + (4 << 30)


def local_copy_gbps(ctx, calls: int, repeats: int) -> float:
    """This rank's local copy rate, read + write bytes per second / 1e9: ``copy_`` of a buffer of
    1 GiB on GPUs (8 MiB on CPU ranks), timed as the benchmark's calls are."""
    nbytes = (1 << 30) if ctx.device.type == "cuda" else (8 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    us = per_call_us(ctx, lambda: dst.copy_(src), calls, repeats, ctx.device.type == "cuda")
    return 2 * nbytes / (us * 1e-6) / 1e9


def kernel_us(ctx, step, calls: int) -> dict[str, float]:
    """GPU time per ``step()`` of each kernel it launches (torch.profiler), by kernel name: which
    of a call's kernels holds its time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(calls):
            step()
        synchronize(ctx.device)
    return {event.key: event.device_time_total / calls for event in profiler.key_averages()
            if event.device_time_total > 0}


def bare_launches(ctx, fn, calls: int, before=lambda: None) -> tuple[float, float]:
    """``(launches, us)`` per call of ``fn``: how many kernels it launches, and the host time of
    those launches alone (each compiled kernel called through Triton's launcher, as the MoE
    kernels' :class:`iris_triton.device.frontend.LaunchCache` and plans call them once compiled).
    ``before()`` makes what ``fn`` needs (the dispatch a combine takes) once the plans are remade
    with the timed launches, and is not counted."""
    from iris_triton.device.frontend import current_stream
    from iris_triton.operations import moe_kernels

    caches = (moe_kernels._ROUTE, moe_kernels._PUSH, moe_kernels._RETURN, moe_kernels._REDUCE)
    spent, count = [0.0], [0]
    saved = [dict(cache._compiled) for cache in caches]

    def timed(runner):
        def run(values, stream):  # the stream looked up within the time, as Triton's launcher does
            start = time.perf_counter()
            runner(values, current_stream())
            spent[0] += time.perf_counter() - start
            count[0] += 1
        return run

    for cache in caches:
        cache._compiled.update({key: timed(runner) for key, runner in cache._compiled.items()})
    invalidate_repeats()  # the plans take the timed runners (iris_triton.operations.moe_plans)
    try:
        before()
        fn()  # the first call of the shape makes its plan
        spent[0], count[0] = 0.0, 0
        for _ in range(calls):
            fn()
        synchronize(ctx.device)
    finally:
        for cache, entries in zip(caches, saved):
            cache._compiled.clear()
            cache._compiled.update(entries)
        invalidate_repeats()
    return count[0] / calls, spent[0] / calls * 1e6


def _measure(ctx, reference: TorchReference, T: int, hidden: int, experts: int, topk: int, calls: int,
             repeats: int, link_gbps: float, copy_gbps: float) -> dict:
    """One row: both implementations checked against each other, then timed."""
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    ids, weights = routing(T, experts, topk, device, seed=T * world + rank)
    x = torch.randn(T, hidden, generator=torch.Generator(device).manual_seed(rank), device=device).to(torch.bfloat16)
    result = ctx.ops.moe_dispatch(x, ids, weights, experts)
    grouped, counts, state = reference.dispatch(x, ids)
    combined = ctx.ops.moe_combine(result.tokens, result)
    expected = reference.combine(grouped, weights, state)
    synchronize(device)
    correct = {"dispatch": _matches(result, grouped, counts),
               "combine": bool(torch.allclose(combined.float(), expected.float(), rtol=2e-2, atol=2e-2))}
    sent = sum(n for d, n in enumerate(state[3]) if d != rank) * hidden * x.element_size()
    # Both directions move the same token data through this rank's memory: its tokens and the rows it receives.
    moved = (T + sum(state[4])) * hidden * x.element_size()
    bound_us = max(ctx.comm.all_gather_object(moved / (copy_gbps * 1e9) * 1e6))
    latest = {"dispatch": result}
    fns = {"iris/dispatch": lambda: ctx.ops.moe_dispatch(x, ids, weights, experts),
           "iris/combine": lambda: ctx.ops.moe_combine(latest["dispatch"].tokens, latest["dispatch"]),
           "torch/dispatch": lambda: reference.dispatch(x, ids),
           "torch/combine": lambda: reference.combine(grouped, weights, state)}
    row = {"tokens": T, "hidden": hidden, "experts": experts, "topk": topk, "world": world,
           "link_bytes": max(ctx.comm.all_gather_object(sent)), "hbm_bound_us": bound_us, "correct": correct}
    for mode in ("graph", "eager") if device.type == "cuda" else ("eager",):
        row[mode] = {}
        for name, fn in fns.items():
            if mode == "graph" and name.startswith("torch"):
                continue  # host split sizes: not capturable
            if name == "iris/combine":
                # A dispatch's results live until the dispatch after next: combine the latest one.
                latest["dispatch"] = ctx.ops.moe_dispatch(x, ids, weights, experts)
            us = max(ctx.comm.all_gather_object(per_call_us(ctx, fn, calls, repeats, mode == "graph")))
            row[mode][name] = {"us": us, "link_fraction": row["link_bytes"] / (us * 1e-6) / (link_gbps * 1e9)
                               if row["link_bytes"] else None, "hbm_bound_multiple": us / bound_us}
            if mode == "eager" and name.startswith("iris") and device.type == "cuda":
                host_us = max(ctx.comm.all_gather_object(host_per_call_us(ctx, fn, calls, repeats)))
                launches, bare_us = bare_launches(ctx, fn, calls * repeats, before=lambda: latest.update(
                    dispatch=ctx.ops.moe_dispatch(x, ids, weights, experts)))
                row[mode][name].update(launches=launches, bare_launch_us=max(ctx.comm.all_gather_object(bare_us)),
                                       host_us=host_us)
    if device.type == "cuda":
        def dispatch_and_combine():
            routed = ctx.ops.moe_dispatch(x, ids, weights, experts)
            ctx.ops.moe_combine(routed.tokens, routed)

        row["kernel_us"] = kernel_us(ctx, dispatch_and_combine, calls)
    return row


def _run(rank: int, token_counts: list[int], hidden: int, experts: int, topk: int, calls: int, repeats: int,
         link_gbps: float) -> list[dict]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ctx = iris.create(heap_size=heap_bytes(world, token_counts, hidden, experts))
    reference = TorchReference(ctx.world_size, experts)
    copy_gbps = min(ctx.comm.all_gather_object(local_copy_gbps(ctx, calls, repeats)))
    rows = []
    for T in token_counts:
        row = _measure(ctx, reference, T, hidden, experts, topk, calls, repeats, link_gbps, copy_gbps)
        rows.append({**row, "copy_gbps": copy_gbps})
        ctx.barrier()
    ctx.destroy()
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=None, help="tokens per rank, comma-separated (default 128,...,8192)")
    parser.add_argument("--hidden", type=int, default=None, help="elements per token (default 7168)")
    parser.add_argument("--experts", type=int, default=None, help="experts in all (default 64)")
    parser.add_argument("--topk", type=int, default=None, help="experts per token (default 8)")
    parser.add_argument("--calls", type=int, default=None, help="calls per timed sample (default 10)")
    parser.add_argument("--repeats", type=int, default=None, help="samples per figure (default 10)")
    parser.add_argument("--link-gbps", type=float, default=LINK_GBPS, help="link bandwidth per direction, GB/s")
    parser.add_argument("--out", default=None)
    parser.add_argument("--cpu", action="store_true",
                        help="2 CPU ranks (Triton's interpreter) with tiny defaults: checks the benchmark and its "
                             "JSON; the times are not a measure of speed")
    return resolve(parser.parse_args(argv), DEFAULTS)


def job(args: argparse.Namespace) -> tuple:
    """What every rank runs: ``(function, its arguments after the rank)``."""
    return _run, ([int(t) for t in args.tokens.split(",")], args.hidden, args.experts, args.topk, args.calls,
                  args.repeats, args.link_gbps)


def report(args: argparse.Namespace, rows: list[dict]) -> bool:
    """Print the rows, write the JSON; whether iris matched the reference everywhere."""
    for row in rows:
        cells = []
        for mode in ("graph", "eager"):
            for name, figure in row.get(mode, {}).items():
                share = f", {figure['link_fraction']:.0%} of link" if figure["link_fraction"] is not None else ""
                launched = (f", {figure['launches']:g} launches taking {figure['bare_launch_us']:.1f} us bare, the "
                            f"host's time per call {figure['host_us']:.1f} us" if "launches" in figure else "")
                cells.append(f"{name} {mode} {figure['us']:.1f} us ({figure['hbm_bound_multiple']:.1f}x HBM{share}"
                             f"{launched})")
        print(f"tokens {row['tokens']:>5} world {row['world']} link {row['link_bytes'] / 1e6:.1f} MB, HBM bound "
              f"{row['hbm_bound_us']:.1f} us at {row['copy_gbps']:.0f} GB/s: "
              + ", ".join(cells) + ("" if all(row["correct"].values()) else f"  INCORRECT: {row['correct']}"))
        if "kernel_us" in row:
            print("    GPU time per dispatch + combine: " + ", ".join(
                f"{name[:40]} {us:.1f} us" for name, us in sorted(row["kernel_us"].items(), key=lambda kv: -kv[1])))
    path = write_results("moe" + ("-cpu" if args.device == "cpu" else ""),
                         {"unit": "us per call (slowest rank, median)", "reference": "torch all_to_all_single",
                          "link_gbps": args.link_gbps, "calls": args.calls, "repeats": args.repeats, "rows": rows},
                         args.out, args.device)
    print(f"wrote {path}")
    return all(all(row["correct"].values()) for row in rows)


def main(argv: list[str] | None = None) -> None:
    run_as_this_rank(parse_args(argv), job, report, "iris's results differ from the reference's (INCORRECT above)")

if __name__ == "__main__":
    main()
