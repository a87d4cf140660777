"""``benchmarks.gemm``: every loop it times (plain loads, tensor descriptors, the last wave split
along K, flattened, warp-specialized) computes ``a @ b`` as torch does, in Triton's
interpreter, and compiles for sm_90 (which the interpreter does not prove)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.gemm import LOOPS, tile_loop
from iris.testing import run_without_interpreter
from iris_triton.tuning import GEMM_TILES

TILE = GEMM_TILES["cpu"]["16x16x16"]


@pytest.mark.parametrize("loop", LOOPS)
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


COMPILE_EVERY_LOOP = '''
import json
import torch
from benchmarks.gemm import LOOPS, tile_loop
from iris.tools.compile_check.recorder import compile_launch, parse_arch, recording

target = parse_arch("sm_90")
small = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)
a = torch.randn(256, 256).to(torch.bfloat16)
b = torch.randn(256, 192).to(torch.bfloat16)
compiled = {}
for name, (options, column_major) in LOOPS.items():
    tile = dict(small, BLOCK_N=128, num_warps=8) if options.get("warp_specialize") else small
    where = [name]
    with recording(target, where) as launches:  # 12 tiles on 8 programs: a last wave of 4, split
        tile_loop(a, b.t().contiguous().t() if column_major else b, torch.empty(256, 192, dtype=torch.bfloat16),
                  tile, 8, **options)
    compiled[name] = {launch.kernel.fn.__name__: len(compile_launch(launch, target)) for launch in launches}
print(json.dumps(compiled))
'''


def test_every_loop_compiles_for_sm_90(tmp_path):
    """The interpreter accepts code the compiler refuses: each loop's kernels compiled for sm_90
    as the benchmark launches them (no GPU needed; the interpreter off in a process of its own)."""
    script = tmp_path / "compile_every_loop.py"
    script.write_text(COMPILE_EVERY_LOOP)
    root = Path(__file__).resolve().parents[1]
    compiled = run_without_interpreter(script, timeout=600, cwd=root, pythonpath=root)
    assert set(compiled) == set(LOOPS)
    assert set(compiled["tma split "]) == {"tile_loop_kernel", "tail_split_kernel"}, compiled
    assert all(chars > 0 for kernels in compiled.values() for chars in kernels.values())
