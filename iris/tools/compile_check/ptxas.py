"""What ptxas, the assembler that turns a kernel's PTX into machine code, says about it.

On Hopper (sm_90) a matrix product runs on ``wgmma``: asynchronous tensor-core instructions that a
kernel keeps in flight while it loads the next blocks. Where it cannot keep them in flight (an
accumulator written between a ``wgmma``'s start and its wait, too few registers for the pipeline,
...), ptxas serializes them and says so in an advisory (C7515, C7511, ...), which costs a large
share of the product's throughput. The kernel still compiles and computes the right result, so
only ptxas's own report shows it. Triton runs ptxas with ``-v`` but keeps its report only for a
failure, unless asked to print it: the check compiles each kernel asking (:func:`reported`), and
reads that report; a kernel that came from Triton's cache was not assembled, so one that uses
``wgmma`` is assembled once more, through Triton's own step (the same ptxas and flags).
"""

from __future__ import annotations

import contextlib
import io
from typing import Callable, TypeVar

__all__ = ["reported", "serialized_tensor_cores"]

T = TypeVar("T")

#: What every one of ptxas's advisories that it serialized a kernel's wgmma instructions says.
SERIALIZED = "wgmma.mma_async instructions are serialized"


def serialized_tensor_cores(ptx: str, target, options: dict, report: str = "") -> list[str]:
    """ptxas's lines saying it serialized ``wgmma`` instructions of ``ptx``, assembled for
    ``target`` (Triton's ``GPUTarget``) with the kernel's compile ``options`` as Triton assembles
    it: read from ``report``, what ptxas said when the kernel was compiled (:func:`reported`), or
    where that is empty from assembling it again. Empty where the PTX has no ``wgmma``."""
    if "wgmma.mma_async" not in ptx:
        return []
    if not report:
        from triton.backends.nvidia.compiler import CUDABackend

        backend = CUDABackend(target)
        _, report = reported(lambda: backend.make_cubin(ptx, {}, backend.parse_options(dict(options)), target.arch))
    return [line.strip() for line in report.splitlines() if SERIALIZED in line]


def reported(assemble: Callable[[], T]) -> tuple[T, str]:
    """``assemble()``, a step that may run Triton's assembler (``make_cubin``: a compile, say), and
    what ``ptxas -v`` wrote meanwhile, which Triton prints where ``knobs.nvidia.dump_ptxas_log``
    is set; empty where nothing was assembled (a kernel from Triton's cache)."""
    from triton import knobs

    report = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(report):
        knobs.nvidia.dump_ptxas_log = True
        result = assemble()
    return result, report.getvalue()
