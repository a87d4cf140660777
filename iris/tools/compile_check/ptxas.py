"""What ptxas, the assembler that turns a kernel's PTX into machine code, says about it.

On Hopper (sm_90) a matrix product runs on ``wgmma``: asynchronous tensor-core instructions that a
kernel keeps in flight while it loads the next blocks. When other instructions write an
accumulator between a ``wgmma``'s start and its wait, ptxas cannot keep them in flight and
serializes them (its advisory C7515), which costs a large share of the product's throughput (two
accumulators updated in one step of K are enough). The kernel still compiles and computes the
right result, so only ptxas's own report shows it. Triton runs ptxas with ``-v`` but keeps its
report only for a failure, and not at all where the kernel comes from its cache, so the check
assembles every kernel that uses ``wgmma`` once more and reads the report.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

__all__ = ["serialized_tensor_cores"]

#: ptxas's advisory that it serialized a kernel's wgmma instructions.
SERIALIZED = "C7515"


def serialized_tensor_cores(ptx: str, arch: int) -> list[str]:
    """ptxas's C7515 lines for ``ptx`` assembled for ``arch`` (90 for sm_90): ``wgmma``
    instructions it serialized. Empty where the PTX has no ``wgmma`` (nothing to assemble)."""
    if "wgmma.mma_async" not in ptx:
        return []
    return [line.strip() for line in _assembler_report(ptx, arch).splitlines() if SERIALIZED in line]


def _assembler_report(ptx: str, arch: int) -> str:
    """What ``ptxas -v`` (the one Triton compiles with) writes for ``ptx``."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory(prefix="iris-ptxas-") as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={sm_arch_from_capability(arch)}",
                               str(source), "-o", str(source.with_suffix(".cubin"))],
                              capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed on a kernel Triton had compiled:\n{done.stderr[-2000:]}")
    return done.stdout + done.stderr
