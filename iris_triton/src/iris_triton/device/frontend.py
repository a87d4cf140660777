"""Front ends: one kernel source, compiled as a Triton kernel or as a Gluon kernel.

iris writes each of its kernels once, as an undecorated function that takes the device-context
class as a constexpr argument (``CTX``) and uses only what both languages accept: the context
(``CTX.initialize(context, RANK, WORLD)``, ``dctx.block_offsets(...)``, its remote accesses,
atomics and flags) and ``tl`` operations on the tensors it returns. A :class:`Frontend` compiles
such a function with its language's ``jit`` and supplies its context class; the Triton backend
uses :data:`TRITON`, the Gluon backend its own. Nothing of a kernel is written twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import attrs
import torch
import triton
from triton.runtime import driver

from iris_triton.device.compiled import INTERPRETING
from iris_triton.device.context import DeviceContext

__all__ = ["Frontend", "LaunchCache", "SHARED_SOURCE_LANGUAGES", "TRITON", "current_stream", "passed", "tensor_passed"]

#: The kernel languages iris's shared kernel sources compile in (the Triton backend's and the
#: Gluon backend's front ends): what the collective algorithms written that way declare.
SHARED_SOURCE_LANGUAGES = frozenset({"triton", "gluon"})


@attrs.frozen(eq=False)
class Frontend:
    """A language to compile iris kernels in."""

    name: str
    """``"triton"`` or ``"gluon"``."""
    jit: Callable[[Callable], Any]
    """The language's decorator (``triton.jit`` or ``gluon.jit``)."""
    device_context: type
    """The device-context class kernels receive as ``CTX``."""
    _kernels: dict = attrs.field(factory=dict, init=False, repr=False)

    def kernel(self, fn: Callable):
        """``fn`` compiled by this front end (wrapped once, then reused)."""
        compiled = self._kernels.get(fn)
        if compiled is None:
            compiled = self._kernels[fn] = self.jit(fn)
        return compiled

    def launch(self, fn: Callable, grid: tuple, **arguments) -> Callable[[int], None] | None:
        """Launch ``fn`` (compiled by this front end) on ``grid`` with ``arguments`` (every
        parameter by name, constexprs included), and return its *repeat*: a callable that
        launches it again with the same arguments on the stream it is given (a raw CUDA stream
        handle, as :func:`current_stream` reads it).

        The repeat skips the JIT's per-launch work (binding and specializing the arguments,
        looking the kernel up): it calls the compiled kernel directly, with tensors passed as
        their addresses, so it holds no reference to them; callers must repeat it only while
        those tensors are alive, on a stream of the device it was first launched on. Under the
        Triton interpreter there is no compiled kernel, and the result is None."""
        jitted = self.kernel(fn)
        compiled = jitted[grid](**arguments)
        if compiled is None or not hasattr(compiled, "run"):
            return None
        values = [passed(arguments[name]) for name in jitted.arg_names]
        run = _launcher(compiled, grid)
        return lambda stream: run(*values, stream=stream)


def current_stream() -> int:
    """The raw handle of the current device's current stream, where Triton's launcher would
    launch (0: the legacy default stream, which no CUDA graph captures)."""
    return driver.active.get_current_stream(driver.active.get_current_device())


def _launcher(compiled, grid: tuple) -> Callable:
    """The compiled kernel's launch on ``grid``: called with its arguments' values (tensors as
    addresses) and ``stream=``, it does what Triton's launcher does once it has bound the
    arguments and found the stream."""
    return compiled[(*grid, 1, 1)[:3]]


def _direct_launch(compiled, grid: tuple, trailing: Sequence) -> Callable[[list, int], None]:
    """The compiled kernel's launch on ``grid`` (:func:`_launcher`), as a callable of its runtime
    arguments' values and the raw stream, ``trailing`` (the constexprs after them) added."""
    launch = _launcher(compiled, grid)
    return lambda values, stream: launch(*values, *trailing, stream=stream)


TRITON = Frontend(name="triton", jit=triton.jit, device_context=DeviceContext)


def _specialisation(value) -> tuple:
    """What Triton compiles a runtime argument for: a tensor's dtype and whether its address is a
    multiple of 16; an int's range (32 or 64 bits), whether it is 1 or a multiple of 16."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool) or not isinstance(value, int):
        return type(value), value if isinstance(value, bool) or value is None else None
    return int, value == 1, value % 16 == 0, -2**31 <= value < 2**31, value < 2**63


@attrs.define(eq=False)
class LaunchCache:
    """Launches of one kernel whose arguments change from call to call, without most of the JIT's
    per-launch work (binding the arguments, specialising them, checking its globals, looking the
    kernel up): the first launch of each specialisation of the runtime arguments
    (:func:`_specialisation`) and each set of constexprs and launch options goes through the JIT,
    which compiles the kernel; later ones call that compiled kernel directly, with tensors passed
    as their addresses, on the current stream of the device. Under the Triton interpreter (or
    while the compile check records launches) every launch goes through the JIT."""

    jitted: Any
    """The kernel (``triton.jit``)."""
    _compiled: dict = attrs.field(factory=dict, init=False, repr=False)

    def launch(self, grid: tuple, *args, **keywords) -> None:
        """``jitted[grid](*args, **keywords)``: ``args`` the runtime arguments, in order;
        ``keywords`` the constexprs (the parameters after them, by name) and launch options."""
        if INTERPRETING:
            self.jitted[grid](*args, **keywords)
            return
        device = driver.active.get_current_device()
        key = self._key(device, grid, args, keywords)
        runner = self._compiled.get(key)
        if runner is None:
            compiled = self.jitted[grid](*args, **keywords)
            if compiled is None or not hasattr(compiled, "run"):
                return
            constexprs = [keywords[name] for name in self.jitted.arg_names[len(args):]]
            self._compiled[key] = _direct_launch(compiled, grid, constexprs)
            return
        runner([passed(a) for a in args], driver.active.get_current_stream(device))

    @staticmethod
    def _key(device: int, grid: tuple, args: tuple, keywords: dict) -> tuple:
        """What the compiled kernel of a launch depends on: the device, the grid, the runtime
        arguments' specialisations, the constexprs and launch options."""
        return (device, grid, *map(_specialisation, args), *keywords.items())

    def bound(self, grid: tuple, *args, **keywords) -> tuple[Callable[[list, int], None], list] | None:
        """The kernel as :meth:`launch` ran it with these arguments, for a caller that launches one
        specialisation many times and changes only some arguments: ``(runner, values)``, where
        ``values`` are the runtime arguments as the kernel takes them (:func:`passed`) and
        ``runner(values, stream)`` launches it on ``stream`` (:func:`current_stream`) with
        ``values`` (a copy of them with some replaced, each tensor by one of the same dtype and
        16-byte alignment). None where no compiled kernel was kept (the compile check)."""
        if INTERPRETING:
            return (lambda values, stream: self.jitted[grid](*values, **keywords)), list(args)
        runner = self._compiled.get(self._key(driver.active.get_current_device(), grid, args, keywords))
        return None if runner is None else (runner, [passed(a) for a in args])


def passed(value):
    """``value`` as a launch's runtime argument (:meth:`LaunchCache.bound`): a tensor as its
    address for a compiled kernel, as itself under the interpreter."""
    return value.data_ptr() if not INTERPRETING and isinstance(value, torch.Tensor) else value


#: :func:`passed` of a value known to be a tensor, without the type test: the per-call tensors a
#: caller of :meth:`LaunchCache.bound` writes into its arguments on every launch.
tensor_passed: Callable[[torch.Tensor], Any] = (lambda tensor: tensor) if INTERPRETING else torch.Tensor.data_ptr
