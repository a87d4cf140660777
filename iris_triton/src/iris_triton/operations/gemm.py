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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from iris_triton.device.compiled import INTERPRETING

__all__ = ["PLAIN_LOOP", "describable", "descriptors", "dot_step", "row_block_tile", "tile_coordinates", "tile_product",
           "tile_product_tma"]

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
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr = False):
    """``(acc, row offsets, column offsets)``: the float32 ``BLOCK_M x BLOCK_N`` tile
    ``(tile_row, tile_col)`` of ``A @ B``, rows past ``rows`` and columns past ``cols`` zero.
    ``EVEN_K`` (``K`` a multiple of ``BLOCK_K``) drops the masks along K: unmasked loads keep
    the pipelined copies simple (faster on GPUs: benchmarks/NOTES.md)."""
    offs_m = tile_row * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_col * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_tile = a + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_tile = b + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
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
                   tile_col, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, TMA: tl.constexpr, B_COLUMN_MAJOR: tl.constexpr):
    """Tile ``(tile_row, tile_col)`` of row block ``block`` (``m`` rows from ``a + block * m *
    stride_am``) of ``A @ B``: with ``TMA`` by :func:`tile_product_tma` from slot ``slot`` of
    ``a_desc`` and from ``b_desc`` (:func:`descriptors`), else by :func:`tile_product`."""
    if TMA:
        acc, offs_m, offs_n = tile_product_tma(a_desc, b_desc, slot, block, 0, tl.cdiv(K, BLOCK_K), tile_row,
                                               tile_col, BLOCK_M, BLOCK_N, BLOCK_K, B_COLUMN_MAJOR)
    else:
        acc, offs_m, offs_n = tile_product(a + block * m * stride_am, b, m, N, K, stride_am, stride_ak, stride_bk,
                                           stride_bn, tile_row, tile_col, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    return acc, offs_m, offs_n


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
