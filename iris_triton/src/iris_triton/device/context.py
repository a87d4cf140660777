"""``DeviceContext``: the device API bound to one rank, built from ``ctx.get_device_context()``.

Inside a kernel::

    dctx = DeviceContext.initialize(context_tensor, RANK, WORLD_SIZE)
    x = dctx.load(buf + offs, from_rank=peer, mask=mask)
    dctx.store(buf + offs, x, to_rank=peer, mask=mask)

The methods are the free functions of :mod:`iris_triton.device.functions` with the caller's rank and the
heap bases filled in. They are generated, one per entry of
:data:`iris_triton.device.functions.DEVICE_FUNCTIONS`, into :class:`DeviceMethods`, which the Gluon
backend's ``IrisDeviceCtx`` shares (:func:`with_device_methods`): they call the free functions,
which compile under both Triton's and Gluon's front end (a callee is compiled in its caller's
language). Only how a context is built differs: here rank and world size are compile-time
constants.

Compiled, ``DeviceContext`` is a Triton aggregate whose methods are ``@triton.jit`` functions;
in Triton's interpreter a plain class (:mod:`iris_triton.device.compiled`).
"""
# No `from __future__ import annotations`: Triton aggregates read the field annotations as types.

import ast
import inspect
import linecache
import textwrap

import triton.language as tl

from iris_triton.device import functions as device
from iris_triton.device.compiled import device_class, device_constructor, device_method
from iris_triton.device.failstop import FailStop
from iris_triton.device.tracing import DeviceTracing

__all__ = ["DeviceContext", "DeviceMethods", "method_source", "with_device_methods"]



def method_source(name: str) -> str:
    """The source of the device contexts' method ``name``: the parameters of the free function
    ``iris_triton.device.functions.<name>`` (names, annotations and defaults as written there) less
    ``heap_bases`` and the caller's rank (``DEVICE_FUNCTIONS[name]``), renamed where upstream's
    methods name a parameter otherwise (``METHOD_PARAMETER_NAMES``), and a body that calls the free
    function with every argument in its place, ``self.heap_bases`` and ``self.rank`` for the two
    dropped. For ``load`` (the caller's rank is ``to_rank``; the header is one line)::

        def load(self, ptr, from_rank, mask=None, other=None, cache_modifier: tl.constexpr = tl.constexpr(""),
                 volatile: tl.constexpr = False):
            return device.load(ptr, self.rank, from_rank, self.heap_bases, mask, other, cache_modifier, volatile)
    """
    source = textwrap.dedent(inspect.getsource(getattr(device, name).fn))
    args = ast.parse(source).body[0].args
    if args.posonlyargs or args.vararg or args.kwonlyargs or args.kwarg:
        raise TypeError(f"iris_triton.device.functions.{name}: a device function takes plain parameters only")
    filled = {device.DEVICE_FUNCTIONS[name]: "self.rank", "heap_bases": "self.heap_bases"}
    renamed = device.METHOD_PARAMETER_NAMES.get(name, {})
    defaults = [None] * (len(args.args) - len(args.defaults)) + args.defaults
    params, call = ["self"], []
    for param, default in zip(args.args, defaults):
        if param.arg in filled:
            if default is not None:
                raise TypeError(f"iris_triton.device.functions.{name}: {param.arg} must not have a default")
            call.append(filled.pop(param.arg))
        else:
            own_name = renamed.get(param.arg, param.arg)
            text = own_name + ast.get_source_segment(source, param).removeprefix(param.arg)  # with its annotation
            if default is not None:
                equals = " = " if param.annotation else "="
                text += equals + ast.get_source_segment(source, default)
            params.append(text)
            call.append(own_name)
    if filled:
        raise TypeError(f"iris_triton.device.functions.{name} has no parameter {', '.join(filled)}")
    return f"def {name}({', '.join(params)}):\n    return device.{name}({', '.join(call)})\n"


def _generate_method(name: str):
    """The method ``name`` compiled from :func:`method_source`, ``@triton.jit`` when compiling.
    Triton's and Gluon's JIT read a function's source (``inspect.getsource``), so the source is
    registered with :mod:`linecache` under the file name it is compiled with."""
    source = method_source(name)
    filename = f"<iris_triton.device.context: DeviceMethods.{name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = {"__name__": __name__, "device": device, "tl": tl}
    exec(compile(source, filename, "exec", dont_inherit=True), namespace)
    method = namespace[name]
    method.__qualname__ = f"DeviceMethods.{name}"
    method.__doc__ = (f":func:`iris_triton.device.functions.{name}` with the context's rank as "
                      f"``{device.DEVICE_FUNCTIONS[name]}`` and its ``heap_bases``.")
    return device_method(method)


class DeviceMethods:
    """The device API of one rank: for every device function (``DEVICE_FUNCTIONS``), the method
    that calls it with ``self.rank`` as the caller's rank and ``self.heap_bases``, generated below
    (:func:`method_source` shows its source). A subclass declares the fields ``rank``,
    ``world_size`` and ``heap_bases`` and how to build itself."""


for _name in device.DEVICE_FUNCTIONS:
    setattr(DeviceMethods, _name, _generate_method(_name))
del _name


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
    tracing: DeviceTracing
    failstop: FailStop

    @device_constructor
    def __init__(self, rank, world_size, heap_bases, tracing=None, failstop=None):
        self.rank = tl.constexpr(rank)
        self.world_size = tl.constexpr(world_size)
        self.heap_bases = heap_bases
        self.tracing = DeviceTracing(False, heap_bases, heap_bases) if tracing is None else tracing
        self.failstop = FailStop(False, heap_bases, heap_bases, heap_bases) if failstop is None else failstop

    @device_method
    def initialize(context_tensor, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, tracing: tl.constexpr = False):
        """The context of rank ``RANK`` of ``WORLD_SIZE`` from the tensor ``[rank, world_size,
        base_0, ..., base_{W-1}, ...]`` that ``ctx.get_device_context()`` returns. ``RANK`` and
        ``WORLD_SIZE`` are compile-time constants (``tl.constexpr`` kernel arguments), as in
        upstream iris kernels; ``tracing`` builds its ``tracing`` member
        (:class:`iris_triton.device.tracing.DeviceTracing`). Its ``failstop`` member
        (:class:`iris_triton.device.failstop.FailStop`) carries what iris's waits need."""
        return DeviceContext(RANK, WORLD_SIZE, context_tensor + 2,
                             DeviceTracing.of(context_tensor, WORLD_SIZE, tracing),
                             FailStop.of(context_tensor, WORLD_SIZE))

    @device_method
    def block_offsets(self, ptr, start, BLOCK: tl.constexpr):
        """``start + [0, BLOCK)``: the offsets of one block of accesses to ``ptr``'s elements
        (Gluon's context lays the same offsets out explicitly; Triton picks the layout)."""
        return start + tl.arange(0, BLOCK)

    @device_method
    def tile_indices(self, ptr, first_row, first_column, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """``(first_row + [0, BLOCK_M), first_column + [0, BLOCK_N))``: the row and column indices
        of one tile of ``ptr``'s matrix (:mod:`iris_triton.tiles.views`; Gluon's context lays them out
        explicitly)."""
        return tl.arange(0, BLOCK_M) + first_row, tl.arange(0, BLOCK_N) + first_column


DeviceContext = device_class(DeviceContext)
