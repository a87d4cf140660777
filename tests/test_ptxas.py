"""``iris.tools.compile_check.ptxas``: ptxas's report that it serialized a kernel's tensor-core
(``wgmma``) instructions is found, and a kernel it does not serialize passes.

Two accumulators updated in each step of K, in a tile loop flattened into its K loop, is a form
ptxas serializes (a GEMM candidate of this form ran far below the same tile with one
accumulator); one accumulator flattened, or two without flattening, it does not. The kernels are
compiled for sm_90 in a process of their own (no GPU needed; the interpreter compiles nothing).
"""

from __future__ import annotations

from pathlib import Path

from iris.testing import run_without_interpreter

KERNELS = '''
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from iris.tools.compile_check.ptxas import serialized_tensor_cores


@triton.jit
def product(a_desc, b_desc, c, K, tiles, BLOCK: tl.constexpr, TWO: tl.constexpr, FLAT: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    for t in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLAT):
        acc = tl.zeros((BLOCK, BLOCK), tl.float32)
        rest = tl.zeros((BLOCK, BLOCK), tl.float32)
        for k in range(0, K, BLOCK):
            x = a_desc.load([t * BLOCK, k])
            acc = tl.dot(x, b_desc.load([k, 0]), acc)
            if TWO:
                rest = tl.dot(x, b_desc.load([k, BLOCK]), rest)
        tl.store(c + (t * BLOCK + rows)[:, None] * BLOCK + rows[None, :], acc + rest)


signature = {"a_desc": "tensordesc<bf16[64, 64]>", "b_desc": "tensordesc<bf16[64, 64]>", "c": "*fp32", "K": "i32",
             "tiles": "i32", "BLOCK": "constexpr", "TWO": "constexpr", "FLAT": "constexpr"}
found = {}
for two, flat in ((False, True), (True, False), (True, True)):
    source = triton.compiler.ASTSource(product, signature, {"BLOCK": 64, "TWO": two, "FLAT": flat})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3}).asm["ptx"]
    found[f"{'two' if two else 'one'}{' flat' if flat else ''}"] = {
        "wgmma": "wgmma.mma_async" in ptx, "serialized": serialized_tensor_cores(ptx, 90)}
print(json.dumps(found))
'''


def test_serialized_wgmma_is_reported_and_others_pass(tmp_path):
    script = tmp_path / "ptxas_kernels.py"
    script.write_text(KERNELS)
    found = run_without_interpreter(script, timeout=600, pythonpath=Path(__file__).resolve().parents[1])
    assert all(kernel["wgmma"] for kernel in found.values()), found  # each runs on tensor cores
    assert found["one flat"]["serialized"] == [] and found["two"]["serialized"] == [], found
    assert len(found["two flat"]["serialized"]) == 1 and "wgmma" in found["two flat"]["serialized"][0], found
