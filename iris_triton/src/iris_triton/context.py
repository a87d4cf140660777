"""``DeviceContext``: the device API bound to one rank, built from ``ctx.get_device_context()``.

The methods live in :class:`DeviceMethods`, which the Gluon backend's ``IrisDeviceCtx`` shares
(:func:`with_device_methods`): they call the free functions of :mod:`iris_triton.device`, which
compile under both Triton's and Gluon's front end (a callee is compiled in its caller's
language). Only how a context is built differs: here rank and world size are compile-time
constants.

Inside a kernel::

    dctx = DeviceContext.initialize(context_tensor, RANK, WORLD_SIZE)
    x = dctx.load(buf + offs, from_rank=peer, mask=mask)
    dctx.store(buf + offs, x, to_rank=peer, mask=mask)

The methods are the free functions of :mod:`iris_triton.device` with the caller's rank and the
heap bases filled in.

Compiled, ``DeviceContext`` is a Triton aggregate whose methods are ``@triton.jit`` functions.
Triton's interpreter (CPU ranks) cannot attach interpreted functions to an aggregate, so there
the same class stays a plain Python class with plain methods, which the interpreter runs as any
other Python code inside a kernel.
"""
# No `from __future__ import annotations`: Triton aggregates read the field annotations as types.

import triton
import triton.language as tl
from triton import knobs
from triton.runtime.jit import constexpr_function
from triton.language.core import _aggregate as aggregate

from iris_triton import device

__all__ = ["DeviceContext", "DeviceMethods", "with_device_methods"]


INTERPRETING = bool(knobs.runtime.interpret)


def _method(fn):
    return fn if INTERPRETING else triton.jit(fn)


def _constructor(fn):
    return fn if INTERPRETING else constexpr_function(fn)


class DeviceMethods:
    """The device API of one rank: every method is the :mod:`iris_triton.device` function of
    the same name with ``self.rank`` as the caller and ``self.heap_bases`` filled in. A subclass
    declares the fields ``rank``, ``world_size`` and ``heap_bases`` and how to build itself."""

    @_method
    def translate(self, ptr, to_rank):
        return device.translate(ptr, self.rank, to_rank, self.heap_bases)

    @_method
    def load(self, ptr, from_rank, mask=None, other=None, cache_modifier: tl.constexpr = tl.constexpr(""),
             volatile: tl.constexpr = False):
        return device.load(ptr, self.rank, from_rank, self.heap_bases, mask, other, cache_modifier, volatile)

    @_method
    def store(self, ptr, value, to_rank, mask=None, cache_modifier: tl.constexpr = tl.constexpr("")):
        device.store(ptr, value, self.rank, to_rank, self.heap_bases, mask, cache_modifier)

    @_method
    def get(self, from_ptr, to_ptr, from_rank, mask=None, other=None):
        device.get(from_ptr, to_ptr, from_rank, self.rank, self.heap_bases, mask, other)

    @_method
    def put(self, from_ptr, to_ptr, to_rank, mask=None, other=None):
        device.put(from_ptr, to_ptr, self.rank, to_rank, self.heap_bases, mask, other)

    @_method
    def copy(self, src_ptr, dst_ptr, from_rank, to_rank, mask=None, other=None):
        device.copy(src_ptr, dst_ptr, from_rank, to_rank, self.rank, self.heap_bases, mask, other)

    @_method
    def atomic_add(self, ptr, val, to_rank, mask=None, sem: tl.constexpr = None,
                   scope: tl.constexpr = None):
        return device.atomic_add(ptr, val, self.rank, to_rank, self.heap_bases, mask, sem, scope)

    @_method
    def atomic_sub(self, ptr, val, to_rank, mask=None, sem: tl.constexpr = None,
                   scope: tl.constexpr = None):
        return device.atomic_sub(ptr, val, self.rank, to_rank, self.heap_bases, mask, sem, scope)

    @_method
    def atomic_xchg(self, ptr, val, to_rank, mask=None, sem: tl.constexpr = None,
                    scope: tl.constexpr = None):
        return device.atomic_xchg(ptr, val, self.rank, to_rank, self.heap_bases, mask, sem, scope)

    @_method
    def atomic_and(self, ptr, val, to_rank, mask=None, sem: tl.constexpr = None,
                   scope: tl.constexpr = None):
        return device.atomic_and(ptr, val, self.rank, to_rank, self.heap_bases, mask, sem, scope)

    @_method
    def atomic_or(self, ptr, val, to_rank, mask=None, sem: tl.constexpr = None,
                  scope: tl.constexpr = None):
        return device.atomic_or(ptr, val, self.rank, to_rank, self.heap_bases, mask, sem, scope)

    @_method
    def atomic_xor(self, ptr, val, to_rank, mask=None, sem: tl.constexpr = None,
                   scope: tl.constexpr = None):
        return device.atomic_xor(ptr, val, self.rank, to_rank, self.heap_bases, mask, sem, scope)

    @_method
    def atomic_min(self, ptr, val, to_rank, mask=None, sem: tl.constexpr = None,
                   scope: tl.constexpr = None):
        return device.atomic_min(ptr, val, self.rank, to_rank, self.heap_bases, mask, sem, scope)

    @_method
    def atomic_max(self, ptr, val, to_rank, mask=None, sem: tl.constexpr = None,
                   scope: tl.constexpr = None):
        return device.atomic_max(ptr, val, self.rank, to_rank, self.heap_bases, mask, sem, scope)

    @_method
    def atomic_cas(self, ptr, cmp, val, to_rank, sem: tl.constexpr = None,
                   scope: tl.constexpr = None):
        return device.atomic_cas(ptr, cmp, val, self.rank, to_rank, self.heap_bases, sem, scope)

    @_method
    def signal(self, ptr, value, to_rank, sem: tl.constexpr = None,
               scope: tl.constexpr = None):
        return device.signal(ptr, value, self.rank, to_rank, self.heap_bases, sem, scope)

    @_method
    def wait_until(self, ptr, value, rank, timeout_ns, CMP: tl.constexpr = tl.constexpr("ge"),
                   sem: tl.constexpr = None, scope: tl.constexpr = None):
        return device.wait_until(ptr, value, self.rank, rank, self.heap_bases, timeout_ns, CMP, sem, scope)


def with_device_methods(cls):
    """``cls`` with every method of :class:`DeviceMethods` that it does not define itself. The
    methods are shared by copying the same function objects into the class, not by inheritance:
    newer Tritons (3.9) accept only other aggregates as an aggregate's base classes."""
    for name, member in vars(DeviceMethods).items():
        if not name.startswith("__") and name not in vars(cls):
            setattr(cls, name, member)
    return cls


@with_device_methods
class DeviceContext:
    rank: tl.constexpr
    world_size: tl.constexpr
    heap_bases: tl.tensor

    @_constructor
    def __init__(self, rank, world_size, heap_bases):
        self.rank = tl.constexpr(rank)
        self.world_size = tl.constexpr(world_size)
        self.heap_bases = heap_bases

    @_method
    def initialize(context_tensor, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
        """The context of rank ``RANK`` of ``WORLD_SIZE`` from the tensor ``[rank, world_size,
        heap_size, base_0, ...]`` that ``ctx.get_device_context()`` returns. ``RANK`` and ``WORLD_SIZE`` are
        compile-time constants (``tl.constexpr`` kernel arguments), as in upstream iris kernels."""
        return DeviceContext(RANK, WORLD_SIZE, context_tensor + 3)

    @_method
    def block_offsets(self, ptr, start, BLOCK: tl.constexpr):
        """``start + [0, BLOCK)``: the offsets of one block of accesses to ``ptr``'s elements
        (Gluon's context lays the same offsets out explicitly; Triton picks the layout)."""
        return start + tl.arange(0, BLOCK)


if not INTERPRETING:
    DeviceContext = aggregate(DeviceContext)
