"""How device-side classes are built for the mode kernels run in.

Compiled, the device contexts are Triton aggregates whose methods are ``@triton.jit`` functions
and whose constructors are constexpr functions. Triton's interpreter (CPU ranks) cannot attach
interpreted functions to an aggregate, so there the same classes stay plain Python classes with
plain methods, which the interpreter runs as any other Python code inside a kernel.
"""

from __future__ import annotations

import triton
from triton import knobs
from triton.language.core import _aggregate
from triton.runtime.jit import constexpr_function

__all__ = ["INTERPRETING", "device_class", "device_constructor", "device_method"]

#: Whether kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when Triton was imported).
INTERPRETING = bool(knobs.runtime.interpret)


def device_method(fn):
    """A method of a device class: ``@triton.jit`` when compiling."""
    return fn if INTERPRETING else triton.jit(fn)


def device_constructor(fn):
    """The ``__init__`` of a device class: a constexpr function when compiling."""
    return fn if INTERPRETING else constexpr_function(fn)


def device_class(cls):
    """``cls`` as a Triton aggregate when compiling, else as it is."""
    return cls if INTERPRETING else _aggregate(cls)
