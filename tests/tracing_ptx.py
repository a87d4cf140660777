"""The PTX of iris's kernels with tracing compiled out, in, and without the feature at all; run as a
script by tests/test_tracing.py (without ``TRITON_INTERPRET``, like tests/ptx_kernels.py).

"Without the feature" is the kernel's module compiled from its own source less every statement
that mentions tracing (``span = dctx.tracing.begin(...)``, ``dctx.tracing.end(span)``, ...): what
the kernel would be had tracing never been written. Prints one JSON object: for each kernel,
``{"off", "on", "without"}``, each the PTX with the source locations and debug sections removed
(they name the file a kernel was compiled from), the statements removed from each module, and
``"errors"``.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import re
import sys
import tempfile
import traceback
from pathlib import Path

import triton
from triton.experimental.gluon._runtime import GluonASTSource

import ptx_kernels
from iris_gluon.frontend import GLUON
from iris_triton.collectives import kernels as ccl
from iris_triton.operations import fused
from iris_triton.device.frontend import TRITON
from iris_triton.tuning import GEMM_SHAPES, collective_shape


def without_tracing(module, directory: Path):
    """``module`` imported anew from its source less the statements that mention tracing, and
    how many were removed."""
    tree = ast.parse(inspect.getsource(module))
    removed = 0

    class Strip(ast.NodeTransformer):
        def generic_visit(self, node):
            nonlocal removed
            super().generic_visit(node)
            for field in ("body", "orelse"):
                statements = getattr(node, field, None)
                if isinstance(statements, list) and statements and isinstance(statements[0], ast.stmt):
                    kept = [s for s in statements if not _mentions_tracing(s)]
                    removed += len(statements) - len(kept)
                    setattr(node, field, kept or [ast.Pass()])
            return node

    path = directory / f"untraced_{module.__name__.rsplit('.', 1)[-1]}.py"
    path.write_text(ast.unparse(Strip().visit(tree)))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    stripped = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = stripped
    spec.loader.exec_module(stripped)
    return stripped, removed


def _mentions_tracing(statement: ast.stmt) -> bool:
    if not isinstance(statement, (ast.Assign, ast.Expr)):
        return False
    text = ast.unparse(statement)
    return ".tracing." in text or "DeviceTracing.of(" in text or bool(re.match(r"^\w+ = tracing\.|^tracing\.", text))


_LOCATIONS = re.compile(r"^\s*(\.loc|\.file)\b.*$|^\s*//.*$", re.MULTILINE)


def normalised(ptx: str) -> str:
    """``ptx`` without source locations, comments and debug sections."""
    ptx = ptx.split("\t.section\t.debug", 1)[0]
    return "\n".join(line for line in _LOCATIONS.sub("", ptx).splitlines() if line.strip())


def _compile(name: str, fn, constexprs: dict, types: dict, divisible, options: dict) -> str:
    fn_, signature, const, attrs = ptx_kernels._spec(fn, constexprs, types, divisible)
    source_class = GluonASTSource if name.startswith("gluon") else triton.compiler.ASTSource
    source = source_class(fn=fn_, signature=signature, constexprs=const, attrs=attrs)
    return normalised(triton.compile(source, target=ptx_kernels.TARGET, options=options).asm["ptx"])


def kernels(directory: Path) -> dict:
    """``{name: (compile(kernel module, tracing) -> PTX, module)}`` for the kernels checked."""
    shape = {k: v for k, v in collective_shape("cuda", 1 << 20).items() if k != "num_warps"}
    steps = ("_push_segments", "_reduce_and_share_segment", "_collect_shared")  # the two-shot all_reduce
    ccl_types = {"inp": "*bf16", "out": "*bf16", "ws": "*bf16", "sync": "*i32"}
    ccl_divisible = ("context", "inp", "out", "ws", "sync", "m", "stride")
    config = {k: v for k, v in GEMM_SHAPES["cuda"].items() if k not in ptx_kernels.OPTIONS}
    options = {k: v for k, v in GEMM_SHAPES["cuda"].items() if k in ptx_kernels.OPTIONS}
    fused_types = {name: "*bf16" for name in ("a", "b", "out", "recv")} | {"flags": "*i32", "calls": "*i32"}
    fused_divisible = ("a", "b", "out", "recv", "flags", "calls", "context", "m", "K", "N",
                       "stride_am", "stride_bk", "stride_om", "slot_stride")

    def collective(frontend):
        def build(module, tracing):
            push, middle, consume = (getattr(module, step) for step in steps)
            constexprs = dict(CTX=frontend.device_context, TRACING=tracing, RANK=0, WORLD=2, PUSH=push,
                              MIDDLE=middle, CONSUME=consume, OP="sum", SRC=1, SITE=2, **shape)
            return _compile(frontend.name, frontend.kernel(module.collective_kernel), constexprs, ccl_types,
                            ccl_divisible, {})
        return build

    # The tile loop by descriptors, B row-major (what GPUs run for such operands).
    descriptor_types = {"a_desc": f"tensordesc<bf16[1,1,{config['BLOCK_M']},{config['BLOCK_K']}]>",
                        "b_desc": f"tensordesc<bf16[{config['BLOCK_K']},{config['BLOCK_N']}]>"}

    def matmul_reduce_scatter(module, tracing):
        constexprs = dict(RANK=0, WORLD=2, TRACING=tracing, EVEN_K=True, TMA=True, B_COLUMN_MAJOR=False, stride_ak=1,
                          stride_bn=1, stride_on=1, **config)
        return _compile("triton", module.matmul_reduce_scatter_kernel, constexprs, fused_types | descriptor_types,
                        fused_divisible, options)

    return {"all_reduce": (collective(TRITON), ccl), "gluon:all_reduce": (collective(GLUON), ccl),
            "matmul_reduce_scatter": (matmul_reduce_scatter, fused)}


def main() -> dict:
    results, errors, stripped, removed = {}, {}, {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, (build, module) in kernels(Path(scratch)).items():
            try:
                if module not in stripped:
                    stripped[module], removed[module.__name__] = without_tracing(module, Path(scratch))
                results[name] = {"off": build(module, False), "on": build(module, True),
                                 "without": build(stripped[module], False)}
            except Exception:
                errors[name] = traceback.format_exc()
    return {"kernels": results, "removed": removed, "errors": errors}


if __name__ == "__main__":
    print(json.dumps(main()))
