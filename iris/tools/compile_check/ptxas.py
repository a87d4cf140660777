"""What ptxas, the assembler that turns a kernel's PTX into machine code, says about it.

On Hopper (sm_90) a matrix product runs on ``wgmma``: asynchronous tensor-core instructions that a
kernel keeps in flight while it loads the next blocks. Where it cannot keep them in flight (an
accumulator written between a ``wgmma``'s start and its wait, too few registers for the pipeline,
...), ptxas serializes them and says so in an advisory (C7515, C7511, ...), which costs a large
share of the product's throughput. The kernel still compiles and computes the right result, so
only ptxas's own report shows it. Triton runs ptxas with ``-v`` but keeps its report only for a
failure, and not at all where the kernel comes from its cache, so the check assembles every
kernel that uses ``wgmma`` once more, through Triton's own step (the same ptxas and flags), and
reads the report.
"""

from __future__ import annotations

import contextlib
import io

__all__ = ["serialized_tensor_cores"]

#: What every one of ptxas's advisories that it serialized a kernel's wgmma instructions says.
SERIALIZED = "wgmma.mma_async instructions are serialized"


def serialized_tensor_cores(ptx: str, target, options: dict) -> list[str]:
    """ptxas's lines saying it serialized ``wgmma`` instructions of ``ptx``, assembled for
    ``target`` (Triton's ``GPUTarget``) with the kernel's compile ``options`` as Triton assembles
    it. Empty where the PTX has no ``wgmma`` (nothing is assembled)."""
    if "wgmma.mma_async" not in ptx:
        return []
    return [line.strip() for line in _assembler_report(ptx, target, options).splitlines() if SERIALIZED in line]


def _assembler_report(ptx: str, target, options: dict) -> str:
    """What ``ptxas -v`` writes for ``ptx`` in Triton's assembling step (``make_cubin``), which
    prints it where ``knobs.nvidia.dump_ptxas_log`` is set."""
    from triton import knobs
    from triton.backends.nvidia.compiler import CUDABackend

    backend = CUDABackend(target)
    report = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(report):
        knobs.nvidia.dump_ptxas_log = True
        backend.make_cubin(ptx, {}, backend.parse_options(dict(options)), target.arch)
    return report.getvalue()
