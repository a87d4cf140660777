"""iris against torch's own collectives where their calls differ most: uneven all-to-all with the
split sizes on the host and on the device, and collectives on a sub-group of the ranks, in one run.

For each size (bytes of input per rank, bf16), in one process and on the same data:

- ``all_to_all_single``: ``ctx.ccl.all_to_all_single(out, x, output_split_sizes,
  input_split_sizes)`` against ``torch.distributed.all_to_all_single`` (NCCL) with the same host
  lists. The splits are uneven and the same matrix on every rank (:func:`uneven_splits`): rank s
  sends rank d a share of its input proportional to ``1 + s + 2d`` (with 2 ranks, rank 0 sends
  1/4 of its input to itself and 3/4 to rank 1, rank 1 sends 1/3 and 2/3), in whole grains of
  :data:`GRAIN` elements, so the ranks send and receive different amounts.
- ``all_to_all_vdev``: ``ctx.ccl.all_to_all_vdev(out, x, input_splits, output_splits)`` (the same
  splits, on the device; ``out`` holds the most rows any rank receives) against torch
  SymmetricMemory's ``torch.ops.symm_mem.all_to_all_vdev`` (NVSHMEM backend; its input, output
  and counts in symmetric memory). Where torch has no NVSHMEM (or on CPU ranks) the row gives the
  reason instead of that figure.
- all_reduce, all_gather, reduce_scatter and all_to_all on a sub-group: iris's collectives with
  ``group=`` a group of ``ctx.new_subgroups`` against NCCL on ``dist.new_subgroups`` of the same
  ranks. The world is split in halves where it has an even number of 4 or more ranks, else the
  group is the whole world (:func:`group_size`); with 2 ranks that is both, so the figures are
  those of a call with ``group=`` over the same ranks as the world's.

Every implementation's result is checked against NCCL's (the same data moved exactly; the
reductions within bf16 rounding) before anything is timed; a result that differs is marked
INCORRECT in the rows and the JSON, and the process exits non-zero at the end. Then each is
timed per call, eagerly (as a user calls it: iris's eager ``all_to_all_single`` makes a small
host exchange per call, and that is timed too) and under CUDA graphs: ``--calls`` calls back to
back between CUDA events (launched eagerly, or captured as one graph and the graphs of a row
replayed in turn), ``--repeats`` times; each rank's median, and the slowest rank's median is the
figure. An implementation that cannot be captured (torch's, where its launch refuses a capture)
has the reason in its row instead of a graph figure. In-place all_reduce is checked from a copy
of the input and timed on the same buffer call after call, as ``benchmarks.ccl`` does. Results go
to ``benchmarks/runs/torch_collectives-<date>.json`` (or ``--out``).

With ``--cpu`` the ranks are 2 CPU ranks (Triton's interpreter): gloo is the reference and the
baseline instead of NCCL, SymmetricMemory and CUDA graphs are left out (the JSON says why), the
eager calls are timed by the host clock, and the defaults are tiny (128 B and 1 KiB, one call,
two repeats); the results go to ``torch_collectives-cpu-<date>.json``. The times say nothing of
speed: such a run checks the benchmark, its checks and its JSON where there is no GPU.

    python -m benchmarks.torch_collectives [--cpu] [--min 8KiB] [--max 256MiB | --sizes 70MiB,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

import iris
from benchmarks.ccl import BASELINE, COLLECTIVES, DEFAULTS, MODES
from benchmarks.common import (
    add_sampling_options,
    calls_per_sample,
    captured,
    per_call_us,
    replayed_per_call_us,
    resolve,
    size_ladder,
    spawn_jobs,
    synchronize,
    write_checked_rows,
)
from iris.config import parse_size

#: Elements of the uneven splits' unit: every split is a whole number of them (the sizes are
#: multiples of its bytes). 32 bytes of bf16, so that a split's bytes divide evenly among the up
#: to 32 blocks per peer of torch's all_to_all_vdev kernel (:func:`_symm_mem_all_to_all_vdev`).
GRAIN = 16
#: The torch.distributed call of each group collective.
TORCH_CALLS = {"all_reduce": dist.all_reduce, "all_gather": dist.all_gather_into_tensor,
               "reduce_scatter": dist.reduce_scatter_tensor, "all_to_all": dist.all_to_all_single}
#: Collectives whose results are compared within bf16 rounding rather than bit for bit.
REDUCTIONS = {"all_reduce", "reduce_scatter"}

#: An implementation: ``(timed call, checked call)``; the checked call starts from the input
#: and returns the tensors its result is read from.
Implementation = tuple[Callable[[], object], Callable[[], tuple[torch.Tensor, ...]]]


def uneven_splits(n: int, world: int) -> list[list[int]]:
    """``[source][destination]`` elements of every rank's all-to-all of ``n`` elements each, the
    same on every rank: rank s sends rank d a share proportional to ``1 + s + 2d``, rounded down
    to a multiple of :data:`GRAIN` elements, and its last destination the rest."""
    units = n // GRAIN
    matrix = []
    for source in range(world):
        weights = [1 + source + 2 * destination for destination in range(world)]
        shares = [units * weight // sum(weights) * GRAIN for weight in weights[:-1]]
        matrix.append([*shares, n - sum(shares)])
    return matrix


def group_size(world: int) -> int:
    """The ranks of each sub-group: half the world where it has an even number of 4 or more
    ranks, else the whole world."""
    return world // 2 if world >= 4 and world % 2 == 0 else world


def _out_of_place(call: Callable[[], object], *results: torch.Tensor) -> Implementation:
    """An implementation whose timed call is its checked call, its result in ``results``."""

    def checked():
        call()
        return results

    return call, checked


def _in_place(buffer: torch.Tensor, x: torch.Tensor, call: Callable[[], object]) -> Implementation:
    """An in-place implementation on ``buffer``: checked from a copy of ``x``, timed on
    ``buffer`` as it is."""

    def checked():
        buffer.copy_(x)
        call()
        return (buffer,)

    return call, checked


def _results(ctx, checked: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """What ``checked()`` leaves in its result tensors, copied to the host."""
    tensors = checked()
    synchronize(ctx.device)
    return tuple(t.cpu() for t in tensors)


def _agrees(result: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], exact: bool) -> bool:
    """``result`` equals ``expected`` tensor for tensor: bit for bit, or within bf16 rounding."""
    if exact:
        return all(torch.equal(r, e) for r, e in zip(result, expected, strict=True))
    return all(r.shape == e.shape and torch.allclose(r.float(), e.float(), rtol=1e-2, atol=1e-2)
               for r, e in zip(result, expected, strict=True))


def _on_every_rank(ctx, fn: Callable[[], object]) -> tuple[object, str | None]:
    """``(fn(), None)`` where it returned on every rank, else ``(None, why)``: the type and first
    line of what torch raised on the first rank it failed on. The ranks give up together, since a
    rank alone in a collective call would wait for the others forever."""
    try:
        value, reason = fn(), None
    except RuntimeError as error:
        value, reason = None, f"{type(error).__name__}: " + (str(error).strip().splitlines() or [""])[0]
    reason = next((r for r in ctx.comm.all_gather_object(reason) if r), None)
    return (value, None) if reason is None else (None, reason)


def _symm_mem_unavailable(ctx) -> str | None:
    """Why torch SymmetricMemory's all_to_all_vdev cannot run on these ranks, or None once its
    NVSHMEM backend is set (before any symmetric tensor is allocated, as torch asks)."""
    if ctx.device.type != "cuda":
        return "torch SymmetricMemory's all_to_all_vdev runs on GPUs (NVSHMEM); these are CPU ranks"
    import torch.distributed._symmetric_memory as symm_mem

    if not symm_mem.is_nvshmem_available():
        return "this torch has no NVSHMEM (torch.distributed._symmetric_memory.is_nvshmem_available() is False)"
    return _on_every_rank(ctx, lambda: symm_mem.set_backend("NVSHMEM"))[1]


def _symm_mem_all_to_all_vdev(x: torch.Tensor, sends: list[int], received: int, bound: int) -> Implementation:
    """torch SymmetricMemory's all_to_all_vdev of a symmetric copy of ``x``: ``sends`` are its
    input splits, ``bound`` elements its output, of which it fills the first ``received``.

    The copy's buffer holds a power of two elements (``x``'s own number at the default sizes):
    torch's kernel launches a number of blocks that follows the input buffer's bytes, gives each
    peer an equal share of them and each block an equal share of that peer's bytes, which a
    split of whole grains (:data:`GRAIN`) divides only where the blocks per peer are a power of
    two."""
    import torch.distributed._symmetric_memory as symm_mem

    group, world, device = dist.group.WORLD.group_name, len(sends), x.device
    source = symm_mem.empty(1 << (x.numel() - 1).bit_length(), dtype=x.dtype, device=device)
    source[:x.numel()].copy_(x)
    out = symm_mem.empty(bound, dtype=x.dtype, device=device)
    input_splits = symm_mem.empty(world, dtype=torch.int64, device=device).copy_(torch.tensor(sends))
    output_splits_offsets = symm_mem.empty((2, world), dtype=torch.int64, device=device)  # counts, then offsets
    for tensor in (source, out, input_splits, output_splits_offsets):
        symm_mem.rendezvous(tensor, group)

    def call():
        torch.ops.symm_mem.all_to_all_vdev(source, out, input_splits, output_splits_offsets, group)

    return _out_of_place(call, out[:received], output_splits_offsets[0])


class Measurer:
    """Checks and times the implementations of one row after another on ``ctx``'s ranks:
    ``calls`` calls per timed sample (:func:`benchmarks.common.calls_per_sample`), ``repeats`` samples."""

    def __init__(self, ctx, calls: int, repeats: int):
        self.ctx, self.calls, self.repeats = ctx, calls, repeats

    def row(self, collective: str, size: int, ranks: list[int], impls: dict[str, Implementation],
            expected: tuple[torch.Tensor, ...], exact: bool, unavailable: dict[str, str]) -> dict:
        """One row: every implementation checked against ``expected``, then timed in each mode;
        ``unavailable`` (``{what: why}``) gains what could not be timed."""
        correct = {name: _agrees(_results(self.ctx, checked), expected, exact) for name, (_, checked) in impls.items()}
        row = {"collective": collective, "bytes": size, "ranks": ranks, "correct": correct}
        calls = calls_per_sample(self.calls, size)
        for mode in MODES[self.ctx.device.type]:
            mine = self._graph_us(impls, calls, unavailable) if mode == "graph" else self._eager_us(impls, calls)
            everyone = self.ctx.comm.all_gather_object(mine)
            row[mode] = {name: max(figures[name] for figures in everyone) for name in mine}  # the slowest rank
        if unavailable:
            row["unavailable"] = unavailable
        return row

    def _eager_us(self, impls: dict[str, Implementation], calls: int) -> dict[str, float]:
        return {name: per_call_us(self.ctx, timed, calls, self.repeats, graph=False)
                for name, (timed, _) in impls.items()}

    def _graph_us(self, impls: dict[str, Implementation], calls: int, unavailable: dict[str, str]) -> dict[str, float]:
        """Each implementation's ``calls`` calls captured as one graph (those every rank could
        capture), the graphs replayed in turn."""
        stream = torch.cuda.Stream(self.ctx.device)
        graphs = {}
        for name, (timed, _) in impls.items():
            graph, reason = _on_every_rank(self.ctx, lambda timed=timed: captured(timed, calls, stream))
            if reason is None:
                graphs[name] = graph
            else:
                unavailable[f"{name} (graph)"] = f"not captured in a CUDA graph: {reason}"
        return replayed_per_call_us(self.ctx, graphs, calls, self.repeats)


def _uneven_rows(measurer: Measurer, size: int, symm_mem_reason: str | None) -> list[dict]:
    """The all_to_all_single and all_to_all_vdev rows of ``size`` bytes per rank, on the same
    input and splits; ``symm_mem_reason``: why torch's all_to_all_vdev cannot run, if it cannot."""
    ctx = measurer.ctx
    matrix = uneven_splits(size // 2, ctx.world_size)
    x = ctx.randn(size // 2, dtype=torch.bfloat16, generator=torch.Generator(ctx.device).manual_seed(ctx.rank))
    single, expected = _single_row(measurer, size, matrix, x)
    rows = [single, _vdev_row(measurer, size, matrix, x, expected, symm_mem_reason)]
    for row in rows:
        row["splits"] = matrix
    return rows


def _single_row(measurer: Measurer, size: int, matrix: list[list[int]], x: torch.Tensor) -> tuple[dict, tuple]:
    """The all_to_all_single row, and the reference's result (its output) for the vdev row."""
    ctx = measurer.ctx
    sends, receives = _sends_and_receives(matrix, ctx.rank)
    # An output on the heap is the same size on every rank (a rank's elements are a view of it).
    out = ctx.empty(_most_received(matrix), dtype=x.dtype)[:sum(receives)]
    reference = torch.empty(sum(receives), dtype=x.dtype, device=x.device)
    baseline = BASELINE[ctx.device.type]
    impls = {"iris": _out_of_place(lambda: ctx.ccl.all_to_all_single(out, x, receives, sends), out),
             baseline: _out_of_place(lambda: dist.all_to_all_single(reference, x, receives, sends), reference)}
    expected = _results(ctx, impls[baseline][1])
    return measurer.row("all_to_all_single", size, list(range(ctx.world_size)), impls, expected, True, {}), expected


def _vdev_row(measurer: Measurer, size: int, matrix: list[list[int]], x: torch.Tensor, expected: tuple,
              symm_mem_reason: str | None) -> dict:
    """The all_to_all_vdev row: its output checked against ``expected`` (all_to_all_single's
    reference output), its counts against the splits."""
    ctx = measurer.ctx
    sends, receives = _sends_and_receives(matrix, ctx.rank)
    bound = _most_received(matrix)
    out = ctx.empty(bound, dtype=x.dtype)
    input_splits = torch.tensor(sends, device=ctx.device)
    output_splits = torch.empty(ctx.world_size, dtype=torch.int64, device=ctx.device)
    impls = {"iris": _out_of_place(lambda: ctx.ccl.all_to_all_vdev(out, x, input_splits, output_splits),
                                   out[:sum(receives)], output_splits)}
    symm_mem, reason = (None, symm_mem_reason) if symm_mem_reason else _on_every_rank(
        ctx, lambda: _symm_mem_all_to_all_vdev(x, sends, sum(receives), bound))
    if reason is None:
        impls["symm_mem"] = symm_mem
    unavailable = {} if reason is None else {"symm_mem": reason}
    return measurer.row("all_to_all_vdev", size, list(range(ctx.world_size)), impls,
                        (*expected, torch.tensor(receives)), True, unavailable)


def _sends_and_receives(matrix: list[list[int]], rank: int) -> tuple[list[int], list[int]]:
    """``rank``'s input split sizes (its row of the matrix) and output split sizes (its column)."""
    return matrix[rank], [row[rank] for row in matrix]


def _most_received(matrix: list[list[int]]) -> int:
    """The most elements a rank receives: the bound of the vdev outputs, the same on every rank."""
    return max(sum(column) for column in zip(*matrix))


def _group_implementations(ctx, group, process_group, collective: str, x: torch.Tensor) -> dict[str, Implementation]:
    """iris's ``collective`` of ``x`` with ``group=group`` and torch.distributed's on
    ``process_group`` (the same ranks)."""
    n, members = x.numel(), group.size
    baseline = BASELINE[ctx.device.type]
    torch_call = TORCH_CALLS[collective]
    if collective == "all_reduce":
        buffer, reference = ctx.empty(n, dtype=x.dtype), torch.empty_like(x)
        return {"iris": _in_place(buffer, x, lambda: ctx.ccl.all_reduce(buffer, group=group)),
                baseline: _in_place(reference, x, lambda: torch_call(reference, group=process_group))}
    out_numel = {"all_gather": members * n, "reduce_scatter": n // members, "all_to_all": n}[collective]
    out = ctx.empty(out_numel, dtype=x.dtype)
    reference = torch.empty(out_numel, dtype=x.dtype, device=x.device)
    iris_call = getattr(ctx.ccl, collective)
    return {"iris": _out_of_place(lambda: iris_call(out, x, group=group), out),
            baseline: _out_of_place(lambda: torch_call(reference, x, group=process_group), reference)}


def _group_row(measurer: Measurer, group, process_group, collective: str, size: int) -> dict:
    """The row of ``collective`` on the sub-group, ``size`` bytes per rank (rounded down to a
    multiple of the group's size in elements)."""
    ctx = measurer.ctx
    n = size // 2 // group.size * group.size
    x = ctx.randn(n, dtype=torch.bfloat16, generator=torch.Generator(ctx.device).manual_seed(ctx.rank + 1))
    impls = _group_implementations(ctx, group, process_group, collective, x)
    expected = _results(ctx, impls[BASELINE[ctx.device.type]][1])
    return measurer.row(collective, size, list(group.ranks), impls, expected, collective not in REDUCTIONS, {})


def heap_bytes(sizes: list[int], members: int, arena: int) -> int:
    """The heap for every row's inputs and outputs (kept to the end of the run: up to 12 + members
    times its size), the workspaces of the world's calls (those outgrown after a CUDA graph
    capture are kept too), the groups' arena of ``arena`` bytes, and the small workspaces."""
    return (16 + 3 * members) * sum(sizes) + arena + (256 << 20)


def _run(rank: int, sizes: list[int], calls: int, repeats: int) -> list[dict]:
    # torch.distributed's all_gather_into_tensor and reduce_scatter_tensor: deprecated names, not news here.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    members = group_size(int(os.environ["WORLD_SIZE"]))
    # The group's workspaces: two slots of all_gather's members x input, and room to grow into.
    arena = (2 * members + 4) * max(sizes) + (64 << 20)
    ctx = iris.create(heap_size=heap_bytes(sizes, members, arena))
    group, _ = ctx.new_subgroups(members, workspace_size=arena)
    process_group, _ = dist.new_subgroups(members)
    symm_mem_reason = _symm_mem_unavailable(ctx)
    measurer = Measurer(ctx, calls, repeats)
    rows = []
    for size in sizes:
        rows += _uneven_rows(measurer, size, symm_mem_reason)
        rows += [_group_row(measurer, group, process_group, collective, size) for collective in COLLECTIVES]
        ctx.barrier()
    ctx.destroy()
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torch_collectives", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min", default=None, help="smallest size per rank (default 8KiB; 128 B with --cpu)")
    parser.add_argument("--max", default=None, help="largest size per rank (default 256MiB; 1 KiB with --cpu)")
    parser.add_argument("--sizes", default=None, help="sizes per rank instead of --min to --max in steps of 8x, "
                                                      "e.g. 70MiB,96MiB")
    add_sampling_options(parser, DEFAULTS)
    args = resolve(parser.parse_args(argv), DEFAULTS)
    try:
        args.size_list = sizes_of(args)
    except ValueError as error:
        parser.error(str(error))
    for option in ("calls", "repeats"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1, got {getattr(args, option)}")
    return args


def sizes_of(args: argparse.Namespace) -> list[int]:
    """The sizes per rank: ``--sizes``, else ``--min`` to ``--max`` in steps of 8x; each a
    multiple of a grain's bytes (a ValueError says which is not)."""
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    else:
        sizes = size_ladder(args.min, args.max)
    if not sizes:
        raise ValueError(f"--min {args.min} is larger than --max {args.max}: no size to measure")
    grain_bytes = GRAIN * torch.bfloat16.itemsize
    for size in sizes:
        if size % grain_bytes:
            raise ValueError(f"size {size} B is not a multiple of {grain_bytes} B ({GRAIN} bf16 elements, the unit of "
                             f"the uneven splits)")
    return sizes


def jobs(args: argparse.Namespace) -> list[tuple]:
    """What every rank runs: ``[(function, its arguments after the rank)]``."""
    return [(_run, (args.size_list, args.calls, args.repeats))]


def _describe(row: dict, modes: tuple[str, ...]) -> str:
    """One printed line of a row: its figures per mode, what was left out and why, and INCORRECT
    where a result differed from the reference's."""
    line = f"{row['collective']:>17} {len(row['ranks'])} ranks {row['bytes']:>10} " + " | ".join(
        f"{mode}: " + ", ".join(f"{name} {us:.1f}" for name, us in row[mode].items()) for mode in modes)
    for what, why in row.get("unavailable", {}).items():
        line += f"  [{what}: {why}]"
    if not all(row["correct"].values()):
        line += f"  INCORRECT: {row['correct']}"
    return line


def report(args: argparse.Namespace, results: list) -> bool:
    """Print rank 0's rows and write the JSON; whether every implementation matched the
    reference's result."""
    rows = results[0]
    for row in rows:
        print(_describe(row, MODES[args.device]))
    return write_checked_rows("torch_collectives", args, {
        "unit": "us per call (slowest rank, median)", "reference": BASELINE[args.device], "calls": args.calls,
        "repeats": args.repeats, "grain": GRAIN, "rows": rows})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not report(args, spawn_jobs(args, jobs(args))):
        raise SystemExit("some results differ from the reference's (INCORRECT above)")


if __name__ == "__main__":
    main()
