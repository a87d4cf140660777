"""``iris.tools.compile_check.ptxas``: ptxas's reports that it serialized a kernel's tensor-core
(``wgmma``) instructions are found, whatever their reason, and a kernel it does not serialize
passes.

Two accumulators updated in each step of K, in a tile loop flattened into its K loop, is a form
ptxas serializes (C7515: a GEMM candidate of this form ran far below the same tile with one
accumulator); so is a 128 x 256 tile on 4 warps (C7511: too few registers for the pipeline). One
accumulator flattened, two without flattening, or the 128 x 256 tile on 8 warps it does not.
The report ptxas gave when the kernel was compiled (:func:`~iris.tools.compile_check.ptxas.reported`,
what the compile check reads) says the same as assembling it again. The kernels are compiled for
sm_90 in a process of their own, with a cache of their own (no GPU needed; the interpreter
compiles nothing).
"""

from __future__ import annotations

from pathlib import Path

from iris.testing import run_without_interpreter

KERNELS = '''
import json
import os
import tempfile

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # every kernel assembled here, none from a cache
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from iris.tools.compile_check.ptxas import reported, serialized_tensor_cores


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


@triton.jit
def tile(a_desc, b_desc, c, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        acc = tl.dot(a_desc.load([0, k]), b_desc.load([k, 0]), acc)
    tl.store(c + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], acc)


def serialized(kernel, signature, constexprs, warps):
    target, options = GPUTarget("cuda", 90, 32), {"num_warps": warps, "num_stages": 3}
    compiled, report = reported(lambda: triton.compile(triton.compiler.ASTSource(kernel, signature, constexprs),
                                                       target=target, options=options))
    ptx = compiled.asm["ptx"]
    return {"wgmma": "wgmma.mma_async" in ptx, "serialized": serialized_tensor_cores(ptx, target, options),
            "reported": "ptxas info" in report, "as compiled": serialized_tensor_cores(ptx, target, options, report)}


signature = {"a_desc": "tensordesc<bf16[64, 64]>", "b_desc": "tensordesc<bf16[64, 64]>", "c": "*fp32", "K": "i32",
             "tiles": "i32", "BLOCK": "constexpr", "TWO": "constexpr", "FLAT": "constexpr"}
found = {f"{'two' if two else 'one'}{' flat' if flat else ''}":
         serialized(product, signature, {"BLOCK": 64, "TWO": two, "FLAT": flat}, 4)
         for two, flat in ((False, True), (True, False), (True, True))}
wide = {"a_desc": "tensordesc<bf16[128, 64]>", "b_desc": "tensordesc<bf16[64, 256]>", "c": "*fp32", "K": "i32",
        "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
for warps in (4, 8):
    found[f"128x256 {warps} warps"] = serialized(tile, wide, {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}, warps)
print(json.dumps(found))
'''


def test_serialized_wgmma_is_reported_and_others_pass(tmp_path):
    script = tmp_path / "ptxas_kernels.py"
    script.write_text(KERNELS)
    found = run_without_interpreter(script, timeout=600, pythonpath=Path(__file__).resolve().parents[1])
    assert all(kernel["wgmma"] for kernel in found.values()), found  # each runs on tensor cores
    assert all(kernel["reported"] and kernel["as compiled"] == kernel["serialized"] for kernel in found.values()), found
    passing = ("one flat", "two", "128x256 8 warps")
    assert all(found[name]["serialized"] == [] for name in passing), found
    for name, reason in (("two flat", "C7515"), ("128x256 4 warps", "C7511")):
        assert len(found[name]["serialized"]) == 1 and reason in found[name]["serialized"][0], found
