"""Which output tiles a rank owns in upstream iris's full-shape reduce-scatters, and the
reduce-scatter of such tiles on iris's own collective.

Upstream's ``reduce_scatter(out, inp)`` and ``matmul_reduce_scatter(C, A, B)`` keep the whole
``(M, N)`` shape: each rank's output holds the sum over ranks on the tiles it owns. Here the
owned tiles of every rank are gathered into that rank's segment of one buffer, iris's
``reduce_scatter`` (torch.distributed's equal segments) sums them, and the segment comes back
into the tiles: the same kernels as every other reduce-scatter, two local gathers around them.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["matmul_reduce_scatter_tiles", "reduce_scatter_owned", "reduce_scatter_tiles", "tile_elements"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _swizzled(tile: int, num_pid_m: int, num_pid_n: int, group: int) -> tuple[int, int]:
    """(row, column) of tile number ``tile`` in the grouped order: ``group`` rows of tiles at a time,
    column by column within the group."""
    per_group = group * num_pid_n
    first_row = tile // per_group * group
    rows = min(num_pid_m - first_row, group)
    return first_row + tile % per_group % rows, tile % per_group // rows


def reduce_scatter_tiles(M: int, N: int, block_m: int, block_n: int, swizzle: int, distribution: int,
                         world: int) -> list[list[tuple[int, int]]]:
    """Tiles (row, column) each rank owns in ``ccl.reduce_scatter``: tile numbers in the grouped
    order of ``swizzle`` rows; distribution 0 gives rank r every world-th number from r,
    distribution 1 a contiguous run of ``ceil(tiles / world)``."""
    num_pid_m, num_pid_n = _cdiv(M, block_m), _cdiv(N, block_n)
    total = num_pid_m * num_pid_n
    per_rank = _cdiv(total, world)
    if distribution == 0:
        numbers = [range(rank, total, world) for rank in range(world)]
    else:
        numbers = [range(rank * per_rank, min((rank + 1) * per_rank, total)) for rank in range(world)]
    return [[_swizzled(t, num_pid_m, num_pid_n, swizzle) for t in ts] for ts in numbers]


def matmul_reduce_scatter_tiles(M: int, N: int, block_m: int, block_n: int, world: int) -> list[list[tuple[int, int]]]:
    """Tiles each rank owns in ``ops.matmul_reduce_scatter``: numbered row by row, rank r owning
    ``floor(tiles / world)`` from ``r * floor(tiles / world)``, the last rank the rest too."""
    num_pid_m, num_pid_n = _cdiv(M, block_m), _cdiv(N, block_n)
    total = num_pid_m * num_pid_n
    per_rank = total // world
    bounds = [rank * per_rank for rank in range(world)] + [total]
    return [[divmod(t, num_pid_n) for t in range(bounds[rank], bounds[rank + 1])] for rank in range(world)]


@functools.lru_cache(maxsize=64)
def _elements(M: int, N: int, block_m: int, block_n: int, tiles: tuple[tuple[int, int], ...]) -> torch.Tensor:
    rows = torch.arange(M).view(M, 1)
    cols = torch.arange(N).view(1, N)
    parts = [(rows[r * block_m:(r + 1) * block_m] * N + cols[:, c * block_n:(c + 1) * block_n]).flatten()
             for r, c in tiles]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def tile_elements(M: int, N: int, block_m: int, block_n: int, tiles, device) -> torch.Tensor:
    """Flat (row-major) indices of the elements of ``tiles`` in an ``M x N`` matrix, tile by tile."""
    return _elements(M, N, block_m, block_n, tuple(tiles)).to(device)


def reduce_scatter_owned(ctx, out: torch.Tensor, inp: torch.Tensor, owned: list[torch.Tensor], op: str) -> None:
    """``out``'s elements at ``owned[ctx.rank]`` := the reduction over ranks of ``inp`` there, every
    rank's ``owned`` being the flat indices of its elements (disjoint, the same lists on every rank).
    Other elements of ``out`` are left as they are."""
    world = ctx.world_size
    longest = max(len(indices) for indices in owned)
    if longest == 0:
        return
    segments = torch.zeros(world, longest, dtype=inp.dtype, device=inp.device)
    flat = inp.reshape(-1)
    for rank, indices in enumerate(owned):
        segments[rank, :len(indices)] = flat[indices]
    mine = torch.empty(longest, dtype=inp.dtype, device=inp.device)
    ctx._torch_ccl.reduce_scatter(mine, segments, op=op)
    mine_indices = owned[ctx.rank]
    out.view(-1)[mine_indices] = mine[:len(mine_indices)]
