"""The fused kernels' matrix product alone (their tile loop, no communication) against cuBLAS
(``torch.matmul``), in one run.

The fused GEMM + communication kernels (:mod:`iris_triton.operations.fused`) can only approach
the overlap bound if their product runs at cuBLAS's speed. This benchmark isolates that product:
a persistent kernel with one program per multiprocessor walks the output tiles in the fused
kernels' order (:func:`iris_triton.operations.gemm.tile_coordinates`), a last wave that would
leave programs idle cut along K as theirs is (:func:`~iris_triton.operations.gemm.split_parts`),
and computes each with their :func:`~iris_triton.operations.gemm.row_block_tile`, then stores it;
nothing is sent. Each tile the fused kernels can use (``iris_triton.tuning.GEMM_TILES``), by
each of their loops (tensor descriptors with ``B`` row-major and column-major; plain loads, which
they run where descriptors cannot address the operands), and by candidates the fused kernels do
not run: ``whole`` is their loop with no wave cut (what the cut gains), ``flat`` flattens the
tile and K loops into one pipelined loop, tiles stored by descriptor (``ws``: its tile loop
warp-specialized); ``gluon ws`` is a persistent Gluon kernel whose warp specialization is written
out, one warp loading and two warp groups multiplying (:mod:`benchmarks.gemm_gluon`: Hopper GPUs
only, on its 128 x 256 x 64 tile; ``tail``: a last wave of at most half the programs run as half
tiles). Each is checked
against ``torch.matmul``, then cuBLAS and every loop are timed in turn with ``triton.testing.do_bench``
(median), ``--rounds`` times, each figure the median of its rounds: a GPU whose clocks drop as it
warms under the run slows every one alike (timed one after the other, whichever runs first, on a
cool GPU, looks faster). Each row also names cuBLAS's kernel (its tile and cluster). The products
are the per-rank ones of Llama-3-70B at TP=2 (bf16):

- QKV projection ``[M, 8192] x [8192, 5120]``, O projection ``[M, 4096] x [4096, 8192]``,
- MLP up ``[M, 8192] x [8192, 28672]``, MLP down ``[M, 14336] x [14336, 8192]``,

for M = 2048, 8192 and 16384. Each row gives TFLOP/s and the share of cuBLAS's throughput, and
names the fastest of the loops the fused kernels run (:data:`FUSED_LOOPS`) among the tiles timed:
on that shape, the tile ``ctx.ops.tune_matmul`` would choose for them.
``--cpu`` (with ``TRITON_INTERPRET=1``) runs a tiny shape in Triton's interpreter: the check and
the JSON, not speed.

    python -m benchmarks.gemm [--rows 2048,8192,16384] [--loops "tma,tma flat"] [--shapes qkv]
                              [--tiles 64x256x64:4:4[:group],...] [--programs N] [--rounds 3] [--out DIR]
    TRITON_INTERPRET=1 python -m benchmarks.gemm --cpu
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import time

import torch
import triton
import triton.language as tl

from benchmarks.common import write_results
from benchmarks.gemm_gluon import WS_TILE, runs_on, ws_supports, ws_tile_loop

from triton.tools.tensor_descriptor import TensorDescriptor

from iris_triton.operations.gemm import (MOST_PARTS, PLAIN_LOOP, descriptors, loop_unit, loop_units,
                                         row_block_tile, split_launch, split_slots, tile_coordinates,
                                         tile_product_tma, tile_sum)
from iris_triton.tuning import GEMM_TILES

#: (name, K, N) of each per-rank product; M is the number of rows (tokens).
SHAPES = {"cuda": (("qkv", 8192, 5120), ("o_proj", 4096, 8192), ("mlp_up", 8192, 28672),
                   ("mlp_down", 14336, 8192)),
          "cpu": (("tiny", 48, 40),)}
ROWS = {"cuda": "2048,8192,16384", "cpu": "24"}


@triton.jit
def tile_loop_kernel(a, b, c, a_desc, b_desc, partials, arrived, M, N, K, parts, stride_am, stride_ak, stride_bk,
                     stride_bn, stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                     B_COLUMN_MAJOR: tl.constexpr):
    """``c := a @ b`` by the fused kernels' tile loop: their units (:func:`loop_unit`: whole tiles,
    then a last wave cut into ``parts`` along K, whose sums meet in ``partials`` as ``arrived``
    says), each computed by :func:`row_block_tile` (by descriptors with ``TMA``, else by plain
    loads) and summed by :func:`tile_sum`."""
    row_tiles = tl.cdiv(M, BLOCK_M)
    col_tiles = tl.cdiv(N, BLOCK_N)
    tiles = row_tiles * col_tiles
    steps = tl.cdiv(K, BLOCK_K)
    for unit in range(tl.program_id(0), loop_units(tiles, parts), tl.num_programs(0)):
        t, part, first, end = loop_unit(unit, tiles, parts, steps)
        if t < tiles:
            tile_row, tile_col = tile_coordinates(t, row_tiles, col_tiles, GROUP_M)
            acc, offs_m, offs_n = row_block_tile(a, b, a_desc, b_desc, 0, 0, M, N, K, stride_am, stride_ak, stride_bk,
                                                 stride_bn, tile_row, tile_col, first, end, BLOCK_M, BLOCK_N, BLOCK_K,
                                                 EVEN_K, TMA, B_COLUMN_MAJOR)
            acc, _, whole = tile_sum(acc, t, part, tiles, parts, partials, arrived, SPLIT_TIMEOUT_NS, BLOCK_M,
                                     BLOCK_N)
            if whole:  # a sum a wait gave up on is wrong, which the check against torch finds
                tl.store(c + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                         acc.to(c.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def flat_loop_kernel(a_desc, b_desc, c_desc, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, B_COLUMN_MAJOR: tl.constexpr,
                     WARP_SPECIALIZE: tl.constexpr):
    """``c := a @ b`` by descriptors, the tile loop and the K loop flattened into one pipelined loop
    (``tl.range(..., flatten=True)``: the next tile's first blocks are loaded while this one's
    epilogue runs), or with ``WARP_SPECIALIZE`` the tile loop split by the compiler between warps
    that load and warps that multiply (``warp_specialize=True``, not flattened); each tile stored
    through ``c_desc`` in two halves of its columns (less shared memory for the epilogue)."""
    row_tiles = tl.cdiv(M, BLOCK_M)
    col_tiles = tl.cdiv(N, BLOCK_N)
    steps = tl.cdiv(K, BLOCK_K)
    for t in tl.range(tl.program_id(0), row_tiles * col_tiles, tl.num_programs(0), flatten=not WARP_SPECIALIZE,
                      warp_specialize=WARP_SPECIALIZE):
        tile_row, tile_col = tile_coordinates(t, row_tiles, col_tiles, GROUP_M)
        acc, _, _ = tile_product_tma(a_desc, b_desc, 0, 0, 0, steps, tile_row, tile_col, BLOCK_M, BLOCK_N, BLOCK_K,
                                     B_COLUMN_MAJOR)
        halves = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        first_row, first_col = tile_row * BLOCK_M, tile_col * BLOCK_N
        c_desc.store([first_row, first_col], halves[0].to(c_desc.dtype))
        c_desc.store([first_row, first_col + BLOCK_N // 2], halves[1].to(c_desc.dtype))


def tile_loop(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tile: dict, programs: int, tma: bool = False,
              whole_tiles: bool = False, flat: bool = False, warp_specialize: bool = False, gluon: bool = False,
              split_tail: bool = False) -> torch.Tensor:
    """Launch :func:`tile_loop_kernel` with ``tile``'s shape and options on ``programs`` programs,
    by descriptors (``tma``: as the fused kernels take them, :func:`descriptors`) or plain loads,
    its last wave cut along K as the fused kernels cut theirs (:func:`split_launch`;
    ``whole_tiles``: never, the loop as it was before it cut any); with ``flat`` it is
    :func:`flat_loop_kernel` (``warp_specialize``: its warp-specialized form); with ``gluon`` it is
    :func:`~benchmarks.gemm_gluon.ws_tile_loop` (``split_tail``: its last wave in half tiles)."""
    if gluon:
        return ws_tile_loop(a, b, c, tile, programs, tail_split=split_tail)
    M, K = a.shape
    N = b.shape[1]
    tiles = triton.cdiv(M, tile["BLOCK_M"]) * triton.cdiv(N, tile["BLOCK_N"])
    # The fused kernels' descriptors of a and b for a tile (a as their [slots, blocks, rows, K]).
    loop = descriptors(a, (1, 1, M, K), (M * a.stride(0), M * a.stride(0), a.stride(0), a.stride(1)), b, tile) \
        if tma else PLAIN_LOOP
    if tma and not loop["TMA"]:
        raise ValueError("the operands' layouts do not allow tensor descriptors")
    if flat:
        c_desc = TensorDescriptor(c, list(c.shape), list(c.stride()), [tile["BLOCK_M"], tile["BLOCK_N"] // 2])
        flat_loop_kernel[(min(programs, tiles),)](loop["a_desc"], loop["b_desc"], c_desc, M, N, K,
                                                  B_COLUMN_MAJOR=loop["B_COLUMN_MAJOR"],
                                                  WARP_SPECIALIZE=warp_specialize, **tile)
        return c
    parts, grid = (1, min(programs, tiles)) if whole_tiles else \
        split_launch(tiles, programs, triton.cdiv(K, tile["BLOCK_K"]))
    partials, arrived = _split_state(a.device, split_slots(tiles, grid, parts) * tile["BLOCK_M"] * tile["BLOCK_N"],
                                     programs * (MOST_PARTS - 1))
    tile_loop_kernel[(grid,)](
        a, b, c, partials=partials, arrived=arrived, M=M, N=N, K=K, parts=parts, stride_am=a.stride(0),
        stride_ak=a.stride(1), stride_bk=b.stride(0), stride_bn=b.stride(1), stride_cm=c.stride(0),
        stride_cn=c.stride(1), EVEN_K=K % tile["BLOCK_K"] == 0, **loop, **tile)
    return c


#: How long the part that finishes a tile waits for the others' sums (they run beside it).
SPLIT_TIMEOUT_NS: tl.constexpr = tl.constexpr(10 * 10**9)


@functools.cache
def _split_state(device: torch.device, elements: int, words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 partial sums (``elements``) and arrival words (0 between launches: the part
    that adds a sum clears its word) of a last wave cut along K (:func:`tile_loop_kernel`)."""
    return (torch.empty(max(elements, 1), dtype=torch.float32, device=device),
            torch.zeros(words, dtype=torch.int32, device=device))


#: The tile loops compared with cuBLAS, by name: :func:`tile_loop`'s options, and whether B is
#: column-major (a linear layer's weight transposed). Plain loads are what the fused kernels run
#: where descriptors cannot address the operands.
LOOPS = {"": ({}, False), "tma ": (dict(tma=True), False), "tma b_t ": (dict(tma=True), True),
         "tma whole ": (dict(tma=True, whole_tiles=True), False),
         "tma flat ": (dict(tma=True, flat=True), False),
         "tma ws ": (dict(tma=True, flat=True, warp_specialize=True), False),
         "gluon ws ": (dict(gluon=True), False), "gluon ws tail ": (dict(gluon=True, split_tail=True), False)}
#: The loops of :data:`LOOPS` that the fused kernels run (the others are candidates): each row
#: names the fastest of them on its shape, the tile ``ctx.ops.tune_matmul`` would choose there.
FUSED_LOOPS = ("", "tma ", "tma b_t ")


def _combinations(tiles: dict, loops: dict, device: torch.device) -> list[tuple[str, dict, bool, dict]]:
    """``(name, options, B column-major, tile)`` of each timed loop: each of ``loops`` with each
    of ``tiles``, but warp specialization only with two warp groups (8 warps: Triton 3.6 refuses to
    specialize a 4-warp kernel for Hopper), and the Gluon loops only where they run
    (:func:`~benchmarks.gemm_gluon.runs_on`), on their own tile and those of ``tiles`` they take
    (:func:`_gluon_tiles`)."""
    return [(loop + tile_name, options, column_major, tile)
            for loop, (options, column_major) in loops.items()
            if not options.get("gluon") or runs_on(device)
            for tile_name, tile in (_gluon_tiles(tiles) if options.get("gluon") else tiles).items()
            if not options.get("warp_specialize") or tile.get("num_warps", 4) >= 8]


def _gluon_tiles(tiles: dict) -> dict:
    """The tiles :func:`~benchmarks.gemm_gluon.ws_tile_loop` runs: its own
    (:data:`~benchmarks.gemm_gluon.WS_TILE`) and those of ``tiles`` it takes, each named with its
    warps and stages (``128x256x64:8:4``), since only the stages may differ."""
    taken = [WS_TILE, *(tile for tile in tiles.values() if ws_supports(tile))]
    return {"{BLOCK_M}x{BLOCK_N}x{BLOCK_K}:{num_warps}:{num_stages}".format(**tile): tile for tile in taken}


def _loops(tiles: dict, loops: dict, device: torch.device) -> list[str]:
    """The names of the timed loops (:func:`_combinations`)."""
    return [name for name, *_ in _combinations(tiles, loops, device)]


def _named_tiles(text: str) -> dict:
    """Tiles named ``MxNxK:warps:stages[:group]`` (comma-separated), e.g. ``64x256x64:4:4``:
    candidates timed beside the fused kernels' own; ``group``: the rows of tiles walked together
    (``GROUP_M``, default 8)."""
    tiles = {}
    for spec in text.split(","):
        match = re.fullmatch(r"(\d+)x(\d+)x(\d+):(\d+):(\d+)(?::(\d+))?", spec.strip())
        if match is None:
            raise SystemExit(f"--tiles: {spec.strip()!r} is not MxNxK:warps:stages[:group] (e.g. 64x256x64:4:4)")
        m, n, k, warps, stages = map(int, match.groups()[:5])
        group = int(match[6] or 8)
        if any(size & (size - 1) for size in (m, n, k)):
            raise SystemExit(f"--tiles: {spec.strip()!r} has a block size that is not a power of two, which Triton's "
                             f"blocks must be (e.g. 128x256x64:8:3)")
        name = f"{m}x{n}x{k}w{warps}s{stages}" + (f"g{group}" if group != 8 else "")
        tiles[name] = dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=group, num_warps=warps, num_stages=stages)
    return tiles


def _kernel_names(fn) -> list[str]:
    """The names of the GPU kernels one call of ``fn`` runs (torch.profiler): cuBLAS's kernel
    names its tile, stages and cluster."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        fn()
        torch.cuda.synchronize()
    return sorted({event.key for event in profiler.key_averages() if event.device_time_total > 0})


def _interleaved_ms(fns: dict, device: torch.device, rounds: int) -> dict[str, list[float]]:
    """Milliseconds per call of each of ``fns`` (``{name: callable}``) in each of ``rounds``
    rounds, every round timing each once in turn, each round starting one further along the list
    (so that no one is always first, on the GPU the others have warmed least): ``do_bench``'s
    median on GPUs, one call by the host clock on CPUs."""
    samples = {name: [] for name in fns}
    names = list(fns)
    for number in range(rounds):
        first = number % len(names)
        for name in names[first:] + names[:first]:
            if device.type == "cuda":
                samples[name].append(triton.testing.do_bench(fns[name], return_mode="median"))
            else:
                start = time.perf_counter()
                fns[name]()
                samples[name].append((time.perf_counter() - start) * 1e3)
    return samples


def _named_loops(text: str) -> list[str]:
    """The keys of :data:`LOOPS` named in ``text`` (comma-separated; ``plain`` is the loop of plain loads)."""
    by_name = {key.strip() or "plain": key for key in LOOPS}
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise SystemExit(f"--loops: no loop named {', '.join(map(repr, unknown))}; the loops: {', '.join(by_name)}")
    return [by_name[name] for name in names]


def measure(device: torch.device, rows: list[int], loops: dict = LOOPS, tiles: dict | None = None,
            shapes: list[str] | None = None, programs: int | None = None, rounds: int = 1) -> list[dict]:
    """One result row per (shape, M): cuBLAS and each of ``loops`` with every tile (default: the
    fused kernels' own), checked, then timed in ``rounds`` rounds (:func:`_interleaved_ms`), on
    ``programs`` persistent programs (default: one per multiprocessor)."""
    tiles = GEMM_TILES[device.type] if tiles is None else tiles
    if programs is None:
        programs = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    results = []
    for name, K, N in SHAPES[device.type]:
        if shapes is not None and name not in shapes:
            continue
        for M in rows:
            g = torch.Generator(device).manual_seed(M + K + N)
            a = torch.randn(M, K, generator=g, device=device).to(torch.bfloat16)
            b = torch.randn(K, N, generator=g, device=device).to(torch.bfloat16)
            reference = torch.matmul(a, b)
            c = torch.empty_like(reference)
            flops = 2 * M * N * K
            row = {"shape": name, "M": M, "K": K, "N": N, "dtype": "bfloat16", "cublas": {}}
            timed = {"cublas": functools.partial(torch.matmul, a, b, out=c)}
            b_t = b.t().contiguous().t()
            for loop_name, options, column_major, tile in _combinations(tiles, loops, device):
                b_loop = b_t if column_major else b
                out = tile_loop(a, b_loop, torch.empty_like(reference), tile, programs, **options)
                error = (out.float() - reference.float()).abs().max().item()
                scale = reference.float().abs().max().item()
                row[loop_name] = {"max_error": error, "correct": error <= 1e-2 * scale}
                timed[loop_name] = functools.partial(tile_loop, a, b_loop, c, tile, programs, **options)
            if device.type == "cuda":
                row["cublas"]["kernels"] = _kernel_names(timed["cublas"])
            for entry_name, samples in _interleaved_ms(timed, device, rounds).items():
                row[entry_name].update(ms=statistics.median(samples), rounds_ms=samples)
            for entry in row.values():
                if isinstance(entry, dict):
                    entry["tflops"] = flops / (entry["ms"] * 1e-3) / 1e12
                    entry["cublas_share"] = row["cublas"]["ms"] / entry["ms"]
            fused = _loops(tiles, {loop: how for loop, how in loops.items() if loop in FUSED_LOOPS}, device)
            if fused:
                best = max(fused, key=lambda t: row[t]["cublas_share"])
                row["fused_best"] = {"loop": best, "cublas_share": row[best]["cublas_share"]}
            results.append(row)
            print(f"{name:9s} M {M:6d}: cuBLAS {row['cublas']['tflops']:6.1f} TFLOP/s; "
                  + ", ".join(f"{t} {row[t]['tflops']:6.1f} ({row[t]['cublas_share']:.0%}"
                              f"{'' if row[t]['correct'] else ', INCORRECT'})" for t in _loops(tiles, loops, device))
                  + (f"; the fused kernels' fastest: {row['fused_best']['loop']} "
                     f"({row['fused_best']['cublas_share']:.0%})" if fused else ""))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gemm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=None, help="rows M of each product, comma-separated")
    parser.add_argument("--loops", default=None,
                        help="the loops timed beside cuBLAS, comma-separated: " + ", ".join(
                            key.strip() or "plain" for key in LOOPS) + " (default: all; the Gluon ones on Hopper "
                        "GPUs only)")
    parser.add_argument("--shapes", default=None,
                        help="the products timed, comma-separated: " + ", ".join(name for name, *_ in SHAPES["cuda"]))
    parser.add_argument("--tiles", default=None,
                        help="tiles timed instead of the fused kernels' own, as MxNxK:warps:stages[:group], "
                             "comma-separated")
    parser.add_argument("--programs", type=int, default=None,
                        help="persistent programs (default: one per multiprocessor)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of timing cuBLAS and every loop in turn (default 3 on GPUs, 1 on CPUs)")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes in Triton's interpreter")
    parser.add_argument("--out", default=None, help="directory for the JSON result")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    rows = [int(r) for r in (args.rows or ROWS[device.type]).split(",")]
    loops = LOOPS if args.loops is None else {name: LOOPS[name] for name in _named_loops(args.loops)}
    tiles = GEMM_TILES[device.type] if args.tiles is None else _named_tiles(args.tiles)
    shapes = None if args.shapes is None else [name.strip() for name in args.shapes.split(",")]
    unknown = set(shapes or ()) - {name for name, *_ in SHAPES[device.type]}
    if unknown:
        raise SystemExit(f"--shapes: no product named {', '.join(sorted(unknown))} on {device.type}")
    rounds = args.rounds if args.rounds is not None else 3 if device.type == "cuda" else 1
    if rounds < 1:
        raise SystemExit(f"--rounds: at least 1, got {rounds}")
    skipped = [name.strip() for name, (options, _) in loops.items() if options.get("gluon") and not runs_on(device)]
    if skipped:
        print(f"skipping {', '.join(skipped)}: Gluon's Hopper operations run on a Hopper GPU only, not in Triton's "
              f"interpreter")
    results = measure(device, rows, loops, tiles, shapes, args.programs, rounds)
    path = write_results("gemm", {"tiles": tiles, "gluon_tiles": _gluon_tiles(tiles), "programs": args.programs,
                                  "rounds": rounds, "results": results}, args.out, device.type)
    print(f"wrote {path}")
    if not all(row[t]["correct"] for row in results for t in _loops(tiles, loops, device)):
        raise SystemExit("a tile loop's product differs from torch.matmul (INCORRECT above)")


if __name__ == "__main__":
    main()
