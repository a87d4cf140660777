"""all_gather_matmul calls whose GEMM's last wave is cut along K
(:func:`iris_triton.operations.gemm.split_parts`), for the tests of the fused products and of their
faults: the context is made to report few units, so that a small product has a last wave to cut.
The fused kernels lay out their state by the context's units, which a real context never changes:
a context is given few units before its first call and keeps them (:func:`with_few_units`).

A row tile per rank and enough columns make at least 6 tiles at any world size; the context
reports as many units as give the GEMM 2 programs fewer than tiles (its units less the pushing
kernel's programs): a whole wave, then 2 tiles, which :func:`split_parts` cuts (into 2 parts from
8 steps along K on, at worlds 2 and 3). Small, so that Triton's interpreter runs such a call in a
fraction of a fault test's timeout.
"""

from __future__ import annotations

import triton

from iris_triton.operations.gemm import split_parts
from iris_triton.tuning import PUSH_PROGRAMS

#: The fused kernels' tile (BLOCK_M, BLOCK_N, BLOCK_K) on each device.
TILE = {"cpu": (16, 16, 16), "cuda": (128, 256, 64)}
#: Fewest tiles of a cut product.
TILES = 6


def _column_tiles(world: int) -> int:
    return triton.cdiv(TILES, world)


def cut_shape(device_type: str, world: int, steps: int) -> tuple[int, int, int]:
    """``(m, K, N)`` of an all_gather_matmul of ``world`` ranks whose K takes ``steps`` steps,
    every extent ragged against the tile."""
    block_m, block_n, block_k = TILE[device_type]
    return block_m - 3, block_k * steps - 4, block_n * _column_tiles(world) - 3


def units(device_type: str, world: int) -> int:
    """The units the context reports for :func:`cut_shape`'s product: its GEMM on 2 programs
    fewer than its tiles."""
    return world * _column_tiles(world) - 2 + PUSH_PROGRAMS[device_type]


def parts_of(device_type: str, world: int, steps: int) -> int:
    """The parts the last wave of :func:`cut_shape`'s product is cut into (:func:`with_few_units`)."""
    tiles = world * _column_tiles(world)
    return split_parts(tiles, units(device_type, world) - PUSH_PROGRAMS[device_type], steps)


def with_few_units(ctx):
    """``ctx``, made to report :func:`units` units (its persistent kernels' grid) from now on:
    before its first call."""
    ctx.get_cu_count = lambda: units(ctx.device.type, ctx.world_size)
    return ctx
