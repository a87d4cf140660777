"""The ``failstop`` member of the device contexts: what iris's device-side waits need to give up
in time and say why.

Built by ``initialize`` from the device-context tensor's trailer (:mod:`iris.heap.device_context`),
it carries the context's timeout in nanoseconds, its fault words and their host-visible copy
(:mod:`iris_triton.protocol.waits` has their layout and the waits that use them). A context built
directly from heap bases has none (``present`` is False; the fields then hold the heap bases,
never read): the protocols that wait (tile collectives, say) refuse it when the kernel is compiled.
"""
# No `from __future__ import annotations`: Triton aggregates read the field annotations as types.

import triton.language as tl

from iris.heap.device_context import TRAILER
from iris_triton.device.compiled import device_class, device_constructor, device_method

__all__ = ["FailStop"]

# Each trailer word's distance from the context tensor, less the world size.
_TIMEOUT: tl.constexpr = tl.constexpr(2 + TRAILER.index("timeout_ns"))
_FAULTS: tl.constexpr = tl.constexpr(2 + TRAILER.index("faults"))
_HOST_FAULTS: tl.constexpr = tl.constexpr(2 + TRAILER.index("host_faults"))


class FailStop:
    """The fault words (int32 pointers ``faults`` and ``host_faults``) and the timeout
    (``timeout_ns``) of the device-side waits of one context."""

    present: tl.constexpr
    faults: tl.tensor
    host_faults: tl.tensor
    timeout_ns: tl.tensor

    @device_constructor
    def __init__(self, present, faults, host_faults, timeout_ns):
        self.present = tl.constexpr(present)
        self.faults = faults
        self.host_faults = host_faults
        self.timeout_ns = timeout_ns

    @device_method
    def of(context_tensor, world_size):
        """The member of a context built from ``context_tensor`` (``world_size`` ranks)."""
        trailer = context_tensor + world_size
        return FailStop(True, tl.load(trailer + _FAULTS).to(tl.pointer_type(tl.int32)),
                        tl.load(trailer + _HOST_FAULTS).to(tl.pointer_type(tl.int32)), tl.load(trailer + _TIMEOUT))


FailStop = device_class(FailStop)
