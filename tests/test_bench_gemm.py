"""``benchmarks.gemm``: every loop it times (plain loads, tensor descriptors, the last wave split
along K, flattened, warp-specialized) computes ``a @ b`` as torch does, in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gemm import LOOPS, tile_loop, wide_parts
from iris_triton.tuning import GEMM_TILES

TILE = GEMM_TILES["cpu"]["16x16x16"]


@pytest.mark.parametrize("loop", [name for name, (options, _) in LOOPS.items() if not options.get("wide")])
@pytest.mark.parametrize(("M", "K", "N", "programs"), [
    (24, 48, 40, 4),   # 6 tiles on 4 programs: a last wave of 2, split in 2 parts
    (40, 40, 48, 8),   # 9 tiles on 8 programs: a last wave of 1, split in 8 parts (uneven along K)
    (32, 32, 32, 4),   # 4 tiles, no last wave
    (16, 48, 112, 4),  # 7 tiles on 4 programs: a last wave of 3, more than half, not split
    (16, 48, 112, 5),  # 7 tiles on 5 programs: a last wave of 2, split in 2 parts
])
def test_every_loop_matches_torch(loop, M, K, N, programs):
    if torch.cuda.is_available():
        pytest.skip("runs in Triton's interpreter (the GPU figures come from the benchmark itself)")
    options, column_major = LOOPS[loop]
    g = torch.Generator().manual_seed(M + K + N)
    a = torch.randn(M, K, generator=g).to(torch.bfloat16)
    b = torch.randn(K, N, generator=g).to(torch.bfloat16)
    if column_major:
        b = b.t().contiguous().t()
    out = tile_loop(a, b, torch.full((M, N), float("nan"), dtype=torch.bfloat16), TILE, programs, **options)
    torch.testing.assert_close(out.float(), a.float() @ b.float(), rtol=2e-2, atol=2e-2 * K ** 0.5)


@pytest.mark.parametrize(("M", "K", "N", "width"), [
    (32, 48, 72, 24),  # 3 tiles of 16 + 8 columns per row of tiles
    (32, 32, 96, 48),  # 2 tiles of 32 + 16 columns
    (24, 40, 56, 24),  # the last column and row of tiles, and the last step of K, partly outside
])
def test_the_wide_loop_runs_tiles_of_two_powers_of_two_columns(M, K, N, width):
    """(The other loops' test above leaves this loop out: its tile is 16 columns wide.)"""
    if torch.cuda.is_available():
        pytest.skip("runs in Triton's interpreter (the GPU figures come from the benchmark itself)")
    g = torch.Generator().manual_seed(M + K + N)
    a = torch.randn(M, K, generator=g).to(torch.bfloat16)
    b = torch.randn(K, N, generator=g).to(torch.bfloat16)
    tile = dict(TILE, BLOCK_N=width)
    out = tile_loop(a, b, torch.full((M, N), float("nan"), dtype=torch.bfloat16), tile, 4, wide=True)
    torch.testing.assert_close(out.float(), a.float() @ b.float(), rtol=2e-2, atol=2e-2 * K ** 0.5)


def test_a_wide_tile_is_split_into_two_powers_of_two_or_refused():
    assert wide_parts(320) == (256, 64) and wide_parts(24) == (16, 8) and wide_parts(256) == (128, 128)
    with pytest.raises(ValueError, match="not two powers of two"):
        wide_parts(352)  # 256 + 96
