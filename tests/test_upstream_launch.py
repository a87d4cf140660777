"""Upstream iris's GEMM programs launch with AMD-only options (``waves_per_eu``,
``matrix_instr_nonkdim``, ``kpack``): on NVIDIA GPUs a context with upstream's conventions makes
Triton's NVIDIA backend accept and ignore them. Checked without a GPU by compiling for sm_90 in a
fresh process (kernels compile only where Triton's interpreter is off); the launch itself is
checked on a GPU (the GEMM examples)."""

from __future__ import annotations

import pytest
import torch

from iris.testing import run_without_interpreter

COMPILE = r"""
import json
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import compiler
from iris_triton.device.launch_options import AMD_LAUNCH_OPTIONS, accept_amd_launch_options

@triton.jit
def scale(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, 2 * tl.load(x + offs, mask=offs < n), mask=offs < n)

def ptx(options):
    signature = {"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    source = triton.compiler.ASTSource(fn=scale, signature=signature, constexprs={(3,): 128})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

known_before = sorted(set(AMD_LAUNCH_OPTIONS) & set(compiler.CUDAOptions.__dataclass_fields__))
plain = ptx({"num_warps": 8})
accept_amd_launch_options()
accept_amd_launch_options()  # idempotent
backend = compiler.CUDABackend(GPUTarget("cuda", 90, 32))
parsed = backend.parse_options({"num_warps": 8, "waves_per_eu": 2, "matrix_instr_nonkdim": 16, "kpack": 2})
with_amd = ptx({"num_warps": 8, "waves_per_eu": 2, "matrix_instr_nonkdim": 16, "kpack": 2})
print(json.dumps({"known_before": known_before, "same_ptx": plain == with_amd, "ptx_lines": len(plain.splitlines()),
                  "parsed": {k: getattr(parsed, k) for k in AMD_LAUNCH_OPTIONS}, "num_warps": parsed.num_warps}))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    script = tmp_path_factory.mktemp("launch") / "compile_with_amd_options.py"  # Triton reads a kernel's source file
    script.write_text(COMPILE)
    return run_without_interpreter(script, timeout=600)


def test_the_nvidia_backend_does_not_know_the_amd_options_by_itself(compiled):
    assert compiled["known_before"] == []


def test_accepted_options_are_kept_and_change_nothing_in_the_code(compiled):
    assert compiled["parsed"] == {"waves_per_eu": 2, "matrix_instr_nonkdim": 16, "kpack": 2}
    assert compiled["num_warps"] == 8
    assert compiled["ptx_lines"] > 10 and compiled["same_ptx"]


@pytest.mark.gpu
def test_an_upstream_style_launch_with_amd_options_runs_on_a_gpu():
    import triton
    import triton.language as tl

    from iris_triton.device.launch_options import accept_amd_launch_options

    @triton.jit
    def double(x, y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + offs, 2 * tl.load(x + offs, mask=offs < n), mask=offs < n)

    accept_amd_launch_options()
    x = torch.randn(1000, device="cuda")
    y = torch.empty_like(x)
    double[(8,)](x, y, 1000, BLOCK=128, num_warps=8, num_stages=2, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1)
    torch.testing.assert_close(y, 2 * x, rtol=0, atol=0)
