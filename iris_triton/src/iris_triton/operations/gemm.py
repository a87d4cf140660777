"""Tiles of a matrix product, for the fused GEMM + communication kernels (:mod:`iris_triton.operations.fused`).

A persistent kernel walks the output tiles of ``C = A @ B`` (``A`` of ``rows x K``, ``B`` of
``K x cols``, any strides) and computes each with :func:`tile_product`, accumulating in float32
with ``tl.dot`` (tensor cores on GPUs). :func:`tile_coordinates` orders tiles in groups of rows
so that programs running at the same time share tiles of ``A`` and ``B`` in L2.
:func:`tile_product_tma` computes the same tile from tensor descriptors (row-major ``A`` and
``B``): Hopper's tensor memory accelerator copies each block, and the rows and columns past the
matrices' ends read as zero without masks.
"""

from __future__ import annotations

import triton
import triton.language as tl

from iris_triton.device.compiled import INTERPRETING

__all__ = ["tile_coordinates", "tile_product", "tile_product_tma"]

#: Triton 3.6's interpreter returns garbage from ``tl.dot`` of bf16 operands (fp16 and fp32 are
#: right), so interpreted products widen bf16 to fp32 first; compiled ones never do.
WIDEN_BF16_PRODUCTS: tl.constexpr = tl.constexpr(INTERPRETING)


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
        if WIDEN_BF16_PRODUCTS and x.dtype == tl.bfloat16:
            x, y = x.to(tl.float32), y.to(tl.float32)
        acc = tl.dot(x, y, acc)
        a_tile += BLOCK_K * stride_ak
        b_tile += BLOCK_K * stride_bk
    return acc, offs_m, offs_n


@triton.jit
def tile_product_tma(a_desc, b_desc, K, tile_row, tile_col, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """``(acc, row offsets, column offsets)`` as :func:`tile_product`, from the descriptors of ``A``
    (block ``BLOCK_M x BLOCK_K``) and ``B`` (block ``BLOCK_K x BLOCK_N``)."""
    first_row = tile_row * BLOCK_M
    first_col = tile_col * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        x = a_desc.load([first_row, k * BLOCK_K])
        y = b_desc.load([k * BLOCK_K, first_col])
        if WIDEN_BF16_PRODUCTS and x.dtype == tl.bfloat16:
            x, y = x.to(tl.float32), y.to(tl.float32)
        acc = tl.dot(x, y, acc)
    return acc, first_row + tl.arange(0, BLOCK_M), first_col + tl.arange(0, BLOCK_N)
