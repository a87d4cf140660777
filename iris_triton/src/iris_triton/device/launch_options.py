"""AMD-only launch options, accepted and ignored on NVIDIA GPUs.

Upstream iris's GEMM programs launch their kernels with options of Triton's AMD backend
(``waves_per_eu=``, ``matrix_instr_nonkdim=``, ``kpack=``). Triton's NVIDIA backend refuses a
launch keyword that is neither a kernel parameter nor one of its options ("Keyword argument ...
was specified but unrecognised"). :func:`accept_amd_launch_options` gives the NVIDIA backend's
options those fields, with AMD's defaults: a launch that passes them compiles exactly as one that
does not (the NVIDIA compiler reads none of them; they only enter the kernel cache's key).
"""

from __future__ import annotations

import dataclasses

__all__ = ["AMD_LAUNCH_OPTIONS", "accept_amd_launch_options"]

#: The AMD backend's launch options upstream's programs pass, with that backend's defaults.
AMD_LAUNCH_OPTIONS = {"waves_per_eu": 0, "matrix_instr_nonkdim": 0, "kpack": 1}


def accept_amd_launch_options() -> None:
    """Make Triton's NVIDIA backend accept (and ignore) :data:`AMD_LAUNCH_OPTIONS`; idempotent."""
    from triton.backends.nvidia import compiler

    options = compiler.CUDAOptions
    if all(name in options.__dataclass_fields__ for name in AMD_LAUNCH_OPTIONS):
        return
    compiler.CUDAOptions = dataclasses.make_dataclass(
        options.__name__, [(name, int, default) for name, default in AMD_LAUNCH_OPTIONS.items()], bases=(options,),
        frozen=True, namespace={"__module__": options.__module__, "__doc__": options.__doc__})
