"""Tiles of a matrix product, for the fused GEMM + communication kernels (:mod:`iris_triton.operations.fused`).

A persistent kernel walks the output tiles of ``C = A @ B`` (``A`` of ``rows x K``, ``B`` of
``K x cols``, any strides) and computes each with :func:`tile_product`, accumulating in float32
with ``tl.dot`` (tensor cores on GPUs). :func:`tile_coordinates` orders tiles in groups of rows
so that programs running at the same time share tiles of ``A`` and ``B`` in L2.

:func:`tile_product_tma` computes the same tile from tensor descriptors: Hopper's tensor memory
accelerator copies each block of ``A`` and ``B`` into shared memory, and the rows and columns past
the matrices' ends read as zero without masks. It is the faster loop on GPUs (benchmarks/NOTES.md)
wherever the operands' layouts allow descriptors (rows of whole 16-byte units, 16-byte aligned
bases); :func:`descriptors` makes them on the host, or says the plain loop must run.

A persistent loop's last wave may leave programs idle: 320 tiles on 132 programs are two whole
waves and 56 tiles, which take as long as a third wave. :func:`split_parts` says how many parts
along K to cut each tile of such a wave into, where that pays (the parts of a tile run at once,
on programs of one round); :func:`loop_units` and :func:`loop_unit` lay out the loop's units
(whole tiles, then the parts), and :func:`tile_sum` has the part that finishes a tile add the
others' float32 sums, which they publish, before it stores the tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from iris_triton.device.compiled import INTERPRETING
from iris_triton.device.functions import spin_until

__all__ = ["PLAIN_LOOP", "add_partial", "describable", "descriptors", "dot_step", "loop_unit", "loop_units",
           "partial_slot", "publish_partial", "row_block_tile", "split_launch", "split_parts", "split_slots",
           "tile_coordinates", "tile_product", "tile_product_tma", "tile_sum"]

#: Whether a descriptor loop orders its copies after what the program acquired before
#: (``fence.proxy.async``): compiled, yes; the interpreter has no asynchronous proxy.
FENCE_ASYNC_PROXY: tl.constexpr = tl.constexpr(not INTERPRETING)

#: Triton 3.6's interpreter returns garbage from ``tl.dot`` of bf16 operands (fp16 and fp32 are
#: right), so interpreted products widen bf16 to fp32 first; compiled ones never do.
WIDEN_BF16_PRODUCTS: tl.constexpr = tl.constexpr(INTERPRETING)


@triton.jit
def dot_step(x, y, acc):
    """``acc + x @ y``: one step of a tile's product (bf16 widened to fp32 where interpreted,
    :data:`WIDEN_BF16_PRODUCTS`)."""
    if WIDEN_BF16_PRODUCTS and x.dtype == tl.bfloat16:
        x, y = x.to(tl.float32), y.to(tl.float32)
    return tl.dot(x, y, acc)


@triton.jit
def tile_coordinates(tile, row_tiles, col_tiles, GROUP_M: tl.constexpr):
    """(tile row, tile column) of the ``tile``-th output tile, taking ``GROUP_M`` tile rows at
    a time column by column."""
    per_group = GROUP_M * col_tiles
    first_row = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(row_tiles - first_row, GROUP_M)
    within = tile % per_group
    return first_row + within % group_rows, within // group_rows


@triton.jit
def tile_product(a, b, rows, cols, K, stride_am, stride_ak, stride_bk, stride_bn, tile_row, tile_col,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr = False,
                 first_step=0, end_step=None):
    """``(acc, row offsets, column offsets)``: the float32 ``BLOCK_M x BLOCK_N`` tile
    ``(tile_row, tile_col)`` of ``A @ B``, rows past ``rows`` and columns past ``cols`` zero,
    summed over the steps ``[first_step, end_step)`` of ``BLOCK_K`` along K (default: all of K).
    ``EVEN_K`` (``K`` a multiple of ``BLOCK_K``) drops the masks along K: unmasked loads keep
    the pipelined copies simple (faster on GPUs: benchmarks/NOTES.md)."""
    end = tl.cdiv(K, BLOCK_K)
    if end_step is not None:
        end = end_step
    offs_m = tile_row * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_col * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_tile = a + offs_m[:, None] * stride_am + (first_step * BLOCK_K + offs_k[None, :]) * stride_ak
    b_tile = b + (first_step * BLOCK_K + offs_k[:, None]) * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(first_step, end):
        if EVEN_K:
            x = tl.load(a_tile, mask=offs_m[:, None] < rows, other=0.0)
            y = tl.load(b_tile, mask=offs_n[None, :] < cols, other=0.0)
        else:
            k_left = K - k * BLOCK_K
            x = tl.load(a_tile, mask=(offs_m[:, None] < rows) & (offs_k[None, :] < k_left), other=0.0)
            y = tl.load(b_tile, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < cols), other=0.0)
        acc = dot_step(x, y, acc)
        a_tile += BLOCK_K * stride_ak
        b_tile += BLOCK_K * stride_bk
    return acc, offs_m, offs_n


@triton.jit
def tile_product_tma(a_desc, b_desc, a_slot, a_block, first_step, end_step, tile_row, tile_col,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     B_COLUMN_MAJOR: tl.constexpr):
    """``(acc, row offsets, column offsets)`` as :func:`tile_product`, summed over the steps
    ``[first_step, end_step)`` of ``BLOCK_K`` along K (all of K: ``0`` to ``cdiv(K, BLOCK_K)``),
    for the ``A`` that is block ``a_block`` of slot ``a_slot`` of ``a_desc`` (``[slots, blocks,
    rows, K]``, block ``1 x 1 x BLOCK_M x BLOCK_K``: the fused kernels' parity slots and ranks'
    blocks of rows), and ``B`` from ``b_desc``: ``B`` itself (``K x N``, block ``BLOCK_K x
    BLOCK_N``), or with ``B_COLUMN_MAJOR`` its transpose (``N x K``, block ``BLOCK_N x BLOCK_K``: a
    linear layer's weight). The rows are those of the block, from 0.

    The blocks may have been written by other programs or GPUs whose flags this program acquired;
    an acquire orders the generic proxy only, and descriptor copies go through the asynchronous
    proxy, so a proxy fence comes first."""
    if FENCE_ASYNC_PROXY:
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
    first_row = tile_row * BLOCK_M
    first_col = tile_col * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(first_step, end_step):
        x = a_desc.load([a_slot, a_block, first_row, k * BLOCK_K]).reshape(BLOCK_M, BLOCK_K)
        if B_COLUMN_MAJOR:
            y = b_desc.load([first_col, k * BLOCK_K]).T
        else:
            y = b_desc.load([k * BLOCK_K, first_col])
        acc = dot_step(x, y, acc)
    return acc, first_row + tl.arange(0, BLOCK_M), first_col + tl.arange(0, BLOCK_N)


@triton.jit
def row_block_tile(a, b, a_desc, b_desc, slot, block, m, N, K, stride_am, stride_ak, stride_bk, stride_bn, tile_row,
                   tile_col, first_step, end_step, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, TMA: tl.constexpr, B_COLUMN_MAJOR: tl.constexpr):
    """Tile ``(tile_row, tile_col)`` of row block ``block`` (``m`` rows from ``a + block * m *
    stride_am``) of ``A @ B``, summed over the steps ``[first_step, end_step)`` along K: with
    ``TMA`` by :func:`tile_product_tma` from slot ``slot`` of ``a_desc`` and from ``b_desc``
    (:func:`descriptors`), else by :func:`tile_product`."""
    if TMA:
        acc, offs_m, offs_n = tile_product_tma(a_desc, b_desc, slot, block, first_step, end_step, tile_row,
                                               tile_col, BLOCK_M, BLOCK_N, BLOCK_K, B_COLUMN_MAJOR)
    else:
        acc, offs_m, offs_n = tile_product(a + block * m * stride_am, b, m, N, K, stride_am, stride_ak, stride_bk,
                                           stride_bn, tile_row, tile_col, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                                           first_step, end_step)
    return acc, offs_m, offs_n


# -- a last wave cut along K -----------------------------------------------------------------------

#: Most parts a tile of a last wave is cut into: each part but the finishing one stores a float32
#: tile, which the finishing one reads back.
MOST_PARTS = 4

#: Fewest K steps of a part: fewer would leave its pipeline of copies mostly filling and draining.
FEWEST_STEPS_PER_PART = 4

#: What a round of a cut wave costs beyond its parts' share of K, in whole tiles' time: a tile's
#: parts start as the slowest of their programs finishes its whole tiles, and the last part adds
#: the others' float32 sums (read from rounds of halves and of thirds timed on an H100:
#: benchmarks/NOTES.md).
ROUND_COST = 0.25

#: Least share of the loop's time a cut must save (on many waves the last is a small share).
LEAST_GAIN = 0.05


def split_parts(tiles: int, programs: int, steps: int) -> int:
    """Into how many parts along K (``steps`` steps of ``BLOCK_K``) a persistent loop of
    ``tiles`` tiles on ``programs`` programs cuts each tile of its last, partial wave: the count
    whose rounds (of ``programs // parts`` tiles, one after another, each costing its share of a
    tile's time plus :data:`ROUND_COST`) finish that wave soonest, where that saves at least
    :data:`LEAST_GAIN` of the loop's time; 1 (nothing is cut) where no count does."""
    tail = tiles % programs
    best, best_time = 1, 1.0
    for parts in range(2, MOST_PARTS + 1):
        per_round = programs // parts
        if tail == 0 or per_round == 0 or steps < parts * FEWEST_STEPS_PER_PART:
            break
        time = -(-tail // per_round) * (1 / parts + ROUND_COST)  # in whole tiles' time
        if time < best_time:
            best, best_time = parts, time
    return best if (1 - best_time) / -(-tiles // programs) >= LEAST_GAIN else 1


def split_launch(tiles: int, programs: int, steps: int) -> tuple[int, int]:
    """``(parts, grid)`` of a persistent loop of ``tiles`` tiles on at most ``programs``
    programs: its last wave's parts (:func:`split_parts`), and the programs to launch (all of
    them where the wave is cut, whose units :func:`loop_units` lays out by the grid; else no more
    than there are tiles)."""
    parts = split_parts(tiles, programs, steps)
    return parts, programs if parts > 1 else min(programs, tiles)


def split_slots(tiles: int, programs: int, parts: int) -> int:
    """How many float32 partial tiles (and arrival words) a loop split by :func:`split_parts`
    publishes: ``parts - 1`` for each tile of the last wave."""
    return tiles % programs * (parts - 1) if parts > 1 else 0


@triton.jit
def _whole_tiles(tiles, parts):
    """How many of ``tiles`` a loop split into ``parts`` (on ``tl.num_programs(0)`` programs)
    computes whole: all but the last, partial wave (all when ``parts`` is 1)."""
    return tiles - tl.where(parts > 1, tiles % tl.num_programs(0), 0)


@triton.jit
def loop_units(tiles, parts):
    """The units of a persistent loop over ``tiles`` tiles whose last wave is cut into ``parts``
    (:func:`split_parts`): program ``p`` takes units ``p, p + P, ...`` (:func:`loop_unit`)."""
    whole = _whole_tiles(tiles, parts)
    programs = tl.num_programs(0)
    return whole + tl.cdiv(tiles - whole, programs // parts) * programs


@triton.jit
def loop_unit(unit, tiles, parts, steps):
    """``(tile, part, first step, end step)`` of unit ``unit`` (:func:`loop_units`): the whole
    tiles first (part -1, all ``steps``); then rounds of ``P // parts`` tiles of the last wave,
    the parts of each tile on adjacent programs of one round, part 0 (the one that finishes the
    tile: :func:`partial_slot`) on the highest, so that it waits only for programs scheduled
    before it (the interpreter runs programs one after another). ``tile`` is ``tiles`` (nothing
    to do) for units past the last tile."""
    programs = tl.num_programs(0)
    whole = _whole_tiles(tiles, parts)
    per_round = programs // parts
    within = (unit - whole) % programs
    split = unit >= whole
    tile = tl.where(within < per_round * parts, whole + (unit - whole) // programs * per_round + within // parts,
                    tiles)
    part = parts - 1 - within % parts
    per_part = tl.cdiv(steps, parts)
    first = tl.where(split, part * per_part, 0)
    end = tl.where(split, tl.minimum(part * per_part + per_part, steps), steps)
    return tl.where(split, tl.minimum(tile, tiles), unit), tl.where(split, part, -1), first, end


@triton.jit
def partial_slot(tile, part, tiles, parts):
    """The slot where part ``part`` (1 to ``parts - 1``) of ``tile``, a tile of the last wave,
    publishes its sum (:func:`split_slots` slots in all)."""
    return (tile - _whole_tiles(tiles, parts)) * (parts - 1) + part - 1


@triton.jit
def tile_sum(acc, tile, part, tiles, parts, partials, arrived, timeout_ns, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """``(sum, ok, whole)`` of unit ``(tile, part)`` (:func:`loop_unit`) that summed ``acc``: a
    part after the first publishes its sum (:func:`publish_partial`); the part that finishes a
    tile adds the others' sums, each once it arrived, waiting at most ``timeout_ns`` for each
    (``ok``: False when a wait gave up, for the caller to record; the others' programs run
    beside it, so only a fault makes one give up); ``whole``: the sum is the tile's, to store
    (that part's, or a whole tile's)."""
    ok = True
    if part > 0:
        publish_partial(acc, partials, arrived, partial_slot(tile, part, tiles, parts), BLOCK_M, BLOCK_N)
    if part == 0:
        for other in range(1, parts):
            ready = partial_slot(tile, other, tiles, parts)
            ok = ok & spin_until(arrived + ready, 1, timeout_ns, sem="acquire", scope="gpu")
            acc = add_partial(acc, partials, arrived, ready, BLOCK_M, BLOCK_N)
    return acc, ok, part <= 0


@triton.jit
def publish_partial(acc, partials, arrived, slot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store ``acc`` (a float32 partial tile) into slot ``slot`` of ``partials`` and then set word
    ``slot`` of ``arrived`` to 1 (release, once every thread of the program stored its share)."""
    within = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(partials + slot.to(tl.int64) * BLOCK_M * BLOCK_N + within, acc)
    tl.debug_barrier()
    tl.atomic_xchg(arrived + slot, 1, sem="release", scope="gpu")


@triton.jit
def add_partial(acc, partials, arrived, slot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``acc`` plus the partial tile in slot ``slot``, whose word of ``arrived`` the caller saw set
    (acquire); the word is cleared for the next call (every word is 0 between calls)."""
    tl.debug_barrier()
    within = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    acc += tl.load(partials + slot.to(tl.int64) * BLOCK_M * BLOCK_N + within)
    tl.atomic_xchg(arrived + slot, 0, sem="relaxed", scope="gpu")
    return acc


#: The fused kernels' arguments that choose the plain loop (:func:`tile_product`): no descriptors.
PLAIN_LOOP = dict(a_desc=None, b_desc=None, TMA=False, B_COLUMN_MAJOR=False)


def describable(tensor: torch.Tensor, strides) -> bool:
    """Whether a descriptor can address ``tensor``'s memory with ``strides`` (elements): the base
    16-byte aligned, the last stride 1, the others whole 16-byte units."""
    size = tensor.element_size()
    return tensor.data_ptr() % 16 == 0 and strides[-1] == 1 and all(s * size % 16 == 0 for s in strides[:-1])


def descriptors(a: torch.Tensor, a_shape: tuple, a_strides: tuple, b: torch.Tensor, tile: dict) -> dict:
    """The fused kernels' arguments that choose their tile loop: ``TMA=True`` with the descriptors
    ``a_desc`` and ``b_desc`` of :func:`tile_product_tma` (``a``'s memory as ``[slots, blocks, rows,
    K]`` of ``a_shape`` and ``a_strides``; ``b`` row-major or column-major, which
    ``B_COLUMN_MAJOR`` says) where both layouts allow descriptors, else :data:`PLAIN_LOOP`."""
    K, N = b.shape
    column_major = b.stride(0) == 1 and b.stride(1) != 1
    b_view, b_block = (b.t(), [tile["BLOCK_N"], tile["BLOCK_K"]]) if column_major else \
        (b, [tile["BLOCK_K"], tile["BLOCK_N"]])
    if 0 in (*a_shape, K, N) or not (describable(a, a_strides) and describable(b_view, b_view.stride())):
        return dict(PLAIN_LOOP)
    return dict(a_desc=TensorDescriptor(a, list(a_shape), list(a_strides), [1, 1, tile["BLOCK_M"], tile["BLOCK_K"]]),
                b_desc=TensorDescriptor(b_view, list(b_view.shape), list(b_view.stride()), b_block), TMA=True,
                B_COLUMN_MAJOR=column_major)
