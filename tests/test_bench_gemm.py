"""``benchmarks.gemm``: every loop it times (plain loads, tensor descriptors, a last wave cut
along K or not, flattened, warp-specialized) computes ``a @ b`` as torch does, in Triton's
interpreter, and compiles for sm_90 (which the interpreter does not prove). The Gluon loops
(:mod:`benchmarks.gemm_gluon`) do not run in the interpreter: they compile for sm_90 without
serialized tensor-core instructions, and refuse clearly what they cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton

from benchmarks import gemm
from benchmarks.gemm import LOOPS, tile_loop
from benchmarks.gemm_gluon import WS_TILE, ws_tile_loop
from iris.testing import run_without_interpreter
from iris_triton.operations.gemm import split_parts
from iris_triton.tuning import GEMM_TILES

TILE = GEMM_TILES["cpu"]["16x16x16"]
#: The loops Triton's interpreter runs (not Gluon's Hopper operations).
INTERPRETED = [loop for loop, (options, _) in LOOPS.items() if not options.get("gluon")]


@pytest.mark.parametrize("loop", INTERPRETED)
@pytest.mark.parametrize(("M", "K", "N", "programs", "parts"), [
    (24, 264, 40, 4, 2),   # 6 tiles on 4 programs: a last wave of 2, cut in 2 (17 steps: K ragged)
    (40, 400, 48, 8, 4),   # 9 tiles on 8 programs: a last wave of 1, cut in 4 (uneven along K)
    (32, 200, 64, 6, 3),   # 8 tiles on 6 programs: a last wave of 2, cut in 3 (one round of 2 tiles)
    (32, 32, 32, 4, 1),    # 4 tiles, no last wave
    (16, 296, 112, 4, 1),  # 7 tiles on 4 programs: a last wave of 3, which no cut shortens by a third
    (16, 600, 112, 5, 2),  # 7 tiles on 5 programs: a last wave of 2, cut in 2
])
def test_every_loop_matches_torch(loop, M, K, N, programs, parts):
    if torch.cuda.is_available():
        pytest.skip("runs in Triton's interpreter (the GPU figures come from the benchmark itself)")
    assert split_parts(triton.cdiv(M, 16) * triton.cdiv(N, 16), programs, triton.cdiv(K, 16)) == parts
    options, column_major = LOOPS[loop]
    g = torch.Generator().manual_seed(M + K + N)
    a = torch.randn(M, K, generator=g).to(torch.bfloat16)
    b = torch.randn(K, N, generator=g).to(torch.bfloat16)
    if column_major:
        b = b.t().contiguous().t()
    for _ in range(2):  # the arrival words are left as they were found, for the next launch
        out = tile_loop(a, b, torch.full((M, N), float("nan"), dtype=torch.bfloat16), TILE, programs, **options)
        torch.testing.assert_close(out.float(), a.float() @ b.float(), rtol=2e-2, atol=2e-2 * K ** 0.5)


COMPILE_EVERY_LOOP = '''
import json
import torch
from benchmarks.gemm import LOOPS, tile_loop
from benchmarks.gemm_gluon import WS_TILE, _launch, refusal
from iris.tools.compile_check.ptxas import serialized_tensor_cores
from iris.tools.compile_check.recorder import compile_launch, parse_arch, recording

target = parse_arch("sm_90")
small = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)
a = torch.randn(256, 256).to(torch.bfloat16)
b = torch.randn(256, 192).to(torch.bfloat16)
compiled, serialized, tail_split = {}, {}, {}
for name, (options, column_major) in LOOPS.items():
    tile = dict(small, BLOCK_N=128, num_warps=8) if options.get("warp_specialize") else small
    c = torch.empty(256, 192, dtype=torch.bfloat16)
    where = [name]
    with recording(target, where) as launches:  # 12 tiles on 8 programs, 8 steps: not cut
        if options.get("gluon"):  # ws_tile_loop refuses CPU tensors: launched past that check
            assert refusal(a, b, c, WS_TILE) is None
            _launch(a, b, c, WS_TILE, 8, options.get("split_tail", False))  # 2 tiles on 8 programs: split
        else:
            tile_loop(a, b.t().contiguous().t() if column_major else b, c, tile, 8, **options)
    ptx = {launch: compile_launch(launch, target) for launch in launches}
    compiled[name] = {launch.kernel.fn.__name__: len(text) for launch, text in ptx.items()}
    if options.get("gluon"):
        serialized[name] = [line for launch, text in ptx.items()
                            for line in serialized_tensor_cores(text, target, launch.options.__dict__)]
        tail_split[name] = [value for launch in launches for path, value in launch.constexprs.items()
                            if launch.kernel.arg_names[path[0]] == "TAIL_SPLIT"]
print(json.dumps({"compiled": compiled, "serialized": serialized, "tail_split": tail_split}))
'''


def test_every_loop_compiles_for_sm_90(tmp_path):
    """The interpreter accepts code the compiler refuses: each loop's kernels compiled for sm_90
    as the benchmark launches them (no GPU needed; the interpreter off in a process of its own)."""
    script = tmp_path / "compile_every_loop.py"
    script.write_text(COMPILE_EVERY_LOOP)
    root = Path(__file__).resolve().parents[1]
    found = run_without_interpreter(script, timeout=600, cwd=root, pythonpath=root)
    compiled = found["compiled"]
    assert set(compiled) == set(LOOPS)
    assert set(compiled["tma "]) == {"tile_loop_kernel"}, compiled
    assert found["tail_split"] == {"gluon ws ": [False], "gluon ws tail ": [True]}, found["tail_split"]
    assert all(chars > 0 for kernels in compiled.values() for chars in kernels.values())
    assert found["serialized"] == {"gluon ws ": [], "gluon ws tail ": []}, found["serialized"]


def _bf16(rows: int, cols: int) -> torch.Tensor:
    return torch.zeros(rows, cols, dtype=torch.bfloat16)


@pytest.mark.parametrize(("a", "b", "c", "tile", "says"), [
    (_bf16(256, 64), _bf16(256, 64).t(), _bf16(256, 256), WS_TILE, "b is column-major"),
    (_bf16(256, 64).half(), _bf16(64, 256), _bf16(256, 256), WS_TILE, "must be bfloat16"),
    (_bf16(256, 60), _bf16(60, 256), _bf16(256, 256), WS_TILE, "TMA cannot address a"),
    (_bf16(256, 64), _bf16(64, 256)[:, 1:], _bf16(256, 255), WS_TILE, "TMA cannot address b"),
    (_bf16(256, 64), _bf16(64, 256), _bf16(256, 128), WS_TILE, "not a matrix product"),
    (_bf16(256, 64), _bf16(64, 256), _bf16(256, 256), dict(WS_TILE, num_warps=4), "the tile must be 128x256x64"),
    (_bf16(256, 64), _bf16(64, 256), _bf16(256, 256), dict(WS_TILE, num_stages=5), "the tile must be 128x256x64"),
    (_bf16(0, 64), _bf16(64, 256), _bf16(0, 256), WS_TILE, "an empty product"),
    (_bf16(256, 64), _bf16(64, 256), _bf16(256, 256), WS_TILE, "run on a Hopper GPU"),
])
def test_gluon_loop_refuses_what_it_cannot_run(a, b, c, tile, says):
    """The Gluon loop says why it cannot run a product, and what to do, before launching anything
    (on CPU tensors the last reason)."""
    with pytest.raises(ValueError, match=says):
        ws_tile_loop(a, b, c, tile, 4)


def test_gluon_loop_refuses_no_programs():
    with pytest.raises(ValueError, match="programs must be a positive int"):
        ws_tile_loop(_bf16(256, 64), _bf16(64, 256), _bf16(256, 256), WS_TILE, 0)


def test_every_figure_is_the_median_of_rounds_timed_in_turn(monkeypatch):
    """cuBLAS and each loop are timed once per round, each round starting one further along, and
    each figure is the median of its rounds (on CPU ranks: the host clock)."""
    if torch.cuda.is_available():
        pytest.skip("runs in Triton's interpreter")
    order = []
    real = gemm._interleaved_ms

    def recorded(fns, device, rounds):
        timed = {name: (lambda name=name, fn=fn: (order.append(name), fn())) for name, fn in fns.items()}
        return real(timed, device, rounds)

    monkeypatch.setattr(gemm, "_interleaved_ms", recorded)
    loops = {key: LOOPS[key] for key in ("tma ", "gluon ws ")}
    tiles = {"16x16x16": TILE}
    (row,) = gemm.measure(torch.device("cpu"), [24], loops, tiles, ["tiny"], 4, rounds=3)
    assert order == ["cublas", "tma 16x16x16", "tma 16x16x16", "cublas", "cublas", "tma 16x16x16"]
    assert "gluon ws 128x256x64:8:4" not in row  # Gluon's Hopper operations: skipped on CPUs
    for name in ("cublas", "tma 16x16x16"):
        assert len(row[name]["rounds_ms"]) == 3 and row[name]["ms"] == sorted(row[name]["rounds_ms"])[1]
    assert row["tma 16x16x16"]["correct"]


@pytest.mark.gpu
@pytest.mark.parametrize("tail_split", [False, True])
@pytest.mark.parametrize(("M", "K", "N"), [(2048, 192, 5120), (777, 1000, 1544), (300, 64, 264)])
def test_gluon_loop_matches_torch_on_a_hopper_gpu(tail_split, M, K, N):
    """The Gluon loop's product against torch's at ragged sizes (partial tiles, K not a multiple of
    its block, a single K step; 2048 x 5120 leaves a last wave the tail split halves)."""
    from benchmarks.gemm_gluon import runs_on

    if not runs_on(torch.device("cuda")):
        pytest.skip("Gluon's Hopper operations need a Hopper GPU (sm_90)")
    g = torch.Generator("cuda").manual_seed(M + K + N)
    a = torch.randn(M, K, generator=g, device="cuda").to(torch.bfloat16)
    b = torch.randn(K, N, generator=g, device="cuda").to(torch.bfloat16)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    ws_tile_loop(a, b, out, WS_TILE, programs, tail_split=tail_split)
    torch.testing.assert_close(out.float(), a.float() @ b.float(), rtol=2e-2, atol=2e-2 * K ** 0.5)


def test_candidate_tiles_are_parsed_with_their_group():
    """``--tiles`` names each candidate's blocks, warps and stages, and optionally its group of
    tile rows (``GROUP_M``, 8 unless given); what is not such a name is refused, saying why."""
    tiles = gemm._named_tiles("128x128x64:4:5, 128x128x64:4:5:16")
    assert tiles == {
        "128x128x64w4s5": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=5),
        "128x128x64w4s5g16": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=16, num_warps=4, num_stages=5),
    }
    with pytest.raises(SystemExit, match="is not MxNxK:warps:stages"):
        gemm._named_tiles("128x128:4:5")
    with pytest.raises(SystemExit, match="not a power of two"):
        gemm._named_tiles("128x160x64:4:5")
