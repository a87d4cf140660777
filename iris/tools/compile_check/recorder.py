"""Kernel launches recorded instead of run, and compiled for a GPU that need not be there.

While :func:`recording` is active, Triton's JIT (``triton.jit`` and ``gluon.jit`` kernels alike)
binds and specializes a launch's arguments as for any launch, then hands what it would compile
(the kernel, its signature, constexprs, alignment attributes and options) to the recorder
instead of compiling and running it, and the launch returns without a kernel. The device Triton
targets is a stand-in that names the target architecture. :func:`compile_launch` later compiles
one recorded launch exactly as the JIT would have, to PTX and a cubin (Triton's own ``ptxas``).
Compiled kernels land in Triton's cache, keyed by the kernel's source hash and arguments, so an
unchanged kernel compiles once per machine.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import attrs
import torch

__all__ = ["Launch", "compile_launch", "parse_arch", "recording"]


@attrs.frozen(eq=False)
class Launch:
    """One kernel launch as the JIT specialized it."""

    kernel: Any
    """The ``JITFunction`` (Triton or Gluon)."""
    key: Any
    """The JIT's cache key of the specialization: equal keys of one kernel compile alike."""
    signature: dict
    constexprs: dict
    attrs: dict
    options: Any
    where: str
    """Which context and call launched it (for the report)."""

    @property
    def family(self) -> str:
        """The kernel's name, with its language when it is not Triton's."""
        name = self.kernel.fn.__name__
        return f"{name} [gluon]" if self.kernel.is_gluon() else name

    @property
    def identity(self) -> tuple:
        return (id(self.kernel), self.key)

    def arguments(self) -> str:
        """The compile-time arguments, as the report shows them."""
        shown = []
        for path, value in self.constexprs.items():
            name = self.kernel.arg_names[path[0]]
            shown.append(f"{name}={getattr(value, '__name__', value)!s}")
        types = ", ".join(f"{name}: {kind}" for name, kind in self.signature.items() if kind != "constexpr")
        return f"{', '.join(shown)}; {types}"


class _StandInDriver:
    """What Triton's JIT asks of the active driver before it compiles: a device, a stream and the
    target. Nothing is ever launched through it."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def parse_arch(arch: str):
    """Triton's target for ``arch`` (``sm_90``, ``sm_100``, ...)."""
    from triton.backends.compiler import GPUTarget

    found = re.fullmatch(r"sm_(\d+)a?", arch)
    if not found:
        raise ValueError(f"arch must be an NVIDIA architecture such as sm_90 or sm_100, not {arch!r}")
    return GPUTarget("cuda", int(found.group(1)), 32)


@contextlib.contextmanager
def recording(target, where: list[str]) -> Iterator[list[Launch]]:
    """Record every kernel launch made inside instead of running it; ``where[0]`` names the call
    that launches (the caller keeps it current)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []

    def record(kernel, key, signature, device, constexprs, options, attrs, *_):
        launches.append(Launch(kernel=kernel, key=key, signature=signature, constexprs=constexprs, attrs=attrs,
                               options=options, where=where[0]))
        return None  # no kernel: the launch returns without running anything

    compile_and_cache = JITFunction._do_compile
    driver.set_active(_StandInDriver(target))
    JITFunction._do_compile = record
    try:
        yield launches
    finally:
        JITFunction._do_compile = compile_and_cache
        driver.set_active(None)  # the default driver again, found when next asked for


def compile_launch(launch: Launch, target) -> str:
    """Compile ``launch`` for ``target`` as the JIT would; returns the PTX."""
    kernel = launch.kernel
    source = kernel.ASTSource(kernel, launch.signature, launch.constexprs, launch.attrs)
    compiled = kernel.compile(source, target=target, options=launch.options.__dict__)
    return compiled.asm["ptx"]
