"""Collective algorithms: what one is, where it applies, the registry of each collective, and the
automatic choice.

An :class:`Algorithm` implements one collective (``all_reduce``, ``all_gather``, ...) and
declares where it applies: the kernel languages it is written in, the devices, dtypes, reductions
and world sizes it runs on, the most bytes per rank it takes, and, for the automatic choice, a
priority and the bytes per rank up to which it is worth choosing. Each collective has its own
registry, filled from the entry-point group ``iris.ccl.<collective>`` (the Triton backend declares
its algorithms there; a plugin distribution adds its own the same way) and by
:func:`register_algorithm` in process.

``ctx.ccl`` validates a call, then hands it to the algorithm that ``algorithm=`` names (refused,
with the reason, where it does not apply) or else to :func:`choose`'s: of the algorithms that
apply and are worth choosing for the call, the one of highest priority. The choice depends only on
the registered declarations and on arguments every rank passes identically, so every rank runs
the same algorithm; a plugin wins it by declaring a higher priority where it is better.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Callable

import attrs
import torch

from iris.calls.declarations import DECLARATIONS, REDUCE_OPS, reduce_op_name
from iris.errors import IrisError
from iris.registry import PluginRegistry

__all__ = [
    "COLLECTIVES",
    "MOVED_ONLY_DTYPES",
    "POINT_TO_POINT",
    "REDUCE_OPS",
    "REDUCIBLE_DTYPES",
    "REDUCING",
    "ROOT_ONLY",
    "SAME_SIZE_INTEGER",
    "SUPPORTED_DTYPES",
    "UNEVEN",
    "Algorithm",
    "CallShape",
    "CollectiveCall",
    "algorithm_registry",
    "choose",
    "reduce_op_name",
    "register_algorithm",
    "signature_of",
]

#: The collectives of ``ctx.ccl`` that dispatch to registered algorithms.
COLLECTIVES = tuple(d.name for d in DECLARATIONS.values() if d.algorithms)
#: Those of them whose tensors' sizes differ between ranks (rows split by counts): every rank's
#: rows have the same shape, their numbers differ.
UNEVEN = tuple(d.name for d in DECLARATIONS.values() if d.uneven)
#: Those of them that only two ranks make (a pair's calls: the others make none).
POINT_TO_POINT = tuple(d.name for d in DECLARATIONS.values() if d.pair)
#: Those of them with a root rank (:attr:`CollectiveCall.src`), and what only the root passes:
#: the other ranks pass None there (reduce's and gather's output, scatter's input).
ROOT_ONLY = MappingProxyType({d.name: d.root_only for d in DECLARATIONS.values() if d.root_only})
#: Those of them that reduce (they take ``op``).
REDUCING = tuple(d.name for d in DECLARATIONS.values() if d.reduces)
#: Element types the reductions take (16-bit floats accumulate in float32).
REDUCIBLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.int8, torch.uint8)
#: Element types the collectives only move (the reductions refuse them: cast to a 16- or 32-bit
#: float and back).
MOVED_ONLY_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Element types the collectives accept (the reductions: :data:`REDUCIBLE_DTYPES`).
SUPPORTED_DTYPES = REDUCIBLE_DTYPES + MOVED_ONLY_DTYPES
#: The integer type of each element size: what data moved bit for bit (and all-ones poison) is
#: viewed as.
SAME_SIZE_INTEGER = MappingProxyType({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64})


@attrs.frozen(kw_only=True, cache_hash=False)
class CollectiveCall:
    """One validated call, as an algorithm receives it."""

    context: Any
    """The iris context."""
    collective: str
    output: Any
    """The result tensor (for ``all_reduce``, ``broadcast`` and ``reduce``: the tensor itself); None
    on a rank that receives nothing (``reduce``'s and ``gather``'s ranks but the root)."""
    input: Any
    """None on a rank that sends nothing (``scatter``'s ranks but the root)."""
    op: str = "sum"
    """One of :data:`REDUCE_OPS` (reductions only)."""
    src: int = 0
    """The root rank: broadcast's and scatter's source, reduce's and gather's destination; or the
    peer (``send``: the destination, ``recv``: the source)."""
    input_splits: Any = None
    """The uneven collectives' rows of ``input`` for each rank (int64 [world_size], on the device):
    the host's split sizes (``all_to_all_single``) or the caller's counts (``all_to_all_vdev``)."""
    output_splits: Any = None
    """The rows ``output`` receives from each rank (int64 [world_size], on the device): the host's
    split sizes, read (``all_to_all_single``), or where the counts received are written
    (``all_to_all_vdev``)."""
    launch_shape: str | None = None
    """The name of one of the algorithm's :attr:`Algorithm.launch_shapes` on this device to launch
    with (named ``algorithm="name/shape"``, or tuned: :mod:`iris.tuning`); None: the algorithm's
    own choice."""
    algorithm: str | None = None
    """The name of the algorithm that runs the call (``ctx.ccl`` sets it): part of the
    signature, as ranks that run different algorithms made different calls."""

    @functools.cached_property
    def signature(self) -> int:
        """16 bits that every rank's identical call shares and a different call (another
        collective, size, dtype, op, root, algorithm or launch shape) almost surely does not;
        never 0. Kernels announce it to their peers with the call's number, so a peer that made a
        different call is caught on the device instead of exchanging mismatched data."""
        if self.collective in UNEVEN:  # the numbers of rows differ between ranks, not their shape
            what = (self.collective, self.input.shape[1:].numel(), str(self.input.dtype))
        elif self.collective in ROOT_ONLY:  # what only the root passes has no part in it
            what = (self.collective, self.shared.numel(), str(self.shared.dtype), self.op, self.src)
        else:
            what = (self.collective, self.input.numel(), self.output.numel(), str(self.input.dtype), self.op, self.src)
        return signature_of(what + (self.algorithm, self.launch_shape))

    @property
    def shared(self) -> torch.Tensor:
        """The tensor every rank passes: ``scatter``'s output, every other collective's input."""
        return self.output if ROOT_ONLY.get(self.collective) == "input" else self.input

    @property
    def nbytes(self) -> int:
        """Bytes of the input per rank, the same on every rank (:attr:`CallShape.nbytes`)."""
        if ROOT_ONLY.get(self.collective) == "input":  # scatter: the root's input, world_size x the output
            return self.context.world_size * self.output.numel() * self.output.element_size()
        return self.input.numel() * self.input.element_size()


def signature_of(what) -> int:
    """16 bits of ``repr(what)``, never 0: a call's signature (:attr:`CollectiveCall.signature`)."""
    return zlib.crc32(repr(what).encode()) & 0xFFFF | 1


@attrs.frozen(kw_only=True)
class CallShape:
    """What decides which algorithms apply to a call; the same on every rank for one call."""

    collective: str
    nbytes: int
    """Bytes of the input per rank (``scatter``: of the root's input; the collectives of
    :data:`UNEVEN`, whose inputs differ between ranks: 0)."""
    world_size: int
    dtype: torch.dtype
    device_type: str
    """``"cuda"`` or ``"cpu"``."""
    language: str | None = None
    """The kernel language of the context's backend (None: the backend has none)."""
    op: str | None = None
    """The reduction (None: the collective does not reduce, or any)."""


def _frozen_dtypes(dtypes) -> frozenset[torch.dtype] | None:
    return None if dtypes is None else frozenset(dtypes)


def _frozen_ops(ops) -> frozenset[str] | None:
    return None if ops is None else frozenset(ops)


def _frozen_limits(limits: Mapping) -> Mapping:
    return MappingProxyType(dict(limits))


def _frozen_shapes(shapes: Mapping) -> Mapping:
    return MappingProxyType({device: MappingProxyType({name: MappingProxyType(dict(shape))
                                                       for name, shape in named.items()})
                             for device, named in shapes.items()})


@attrs.frozen(kw_only=True, eq=False)
class Algorithm:
    """An implementation of one collective, as registered under ``iris.ccl.<collective>``, with
    the declaration of where it applies and when the automatic choice takes it."""

    name: str
    collective: str = attrs.field(validator=attrs.validators.in_(COLLECTIVES))
    run: Callable[[CollectiveCall], Callable[[int], None] | None]
    """Enqueues the collective on the context's current stream and returns without waiting.
    It may return a *repeat*: a callable that enqueues the same call again, on the raw CUDA
    stream it is given (the then-current one; 0 on CPU ranks), without preparing it anew;
    ``ctx.ccl`` runs it instead of ``run`` for identical later calls (same tensors by address,
    size, dtype and layout, same options) until a workspace grows. None means every call goes
    through ``run``."""
    languages: frozenset[str] = attrs.field(converter=frozenset)
    """Kernel languages it is implemented in; a context whose backend compiles in another
    language (``DeviceOps.kernel_language``) cannot run it. Empty: it launches no kernel of a
    backend and runs on any."""
    description: str = ""
    device_types: frozenset[str] = attrs.field(default=frozenset({"cuda", "cpu"}), converter=frozenset)
    """Device types it runs on."""
    dtypes: frozenset[torch.dtype] | None = attrs.field(default=None, converter=_frozen_dtypes)
    """Element types it takes (None: every one of :data:`SUPPORTED_DTYPES`; ``ctx.ccl`` hands a
    reduction none but :data:`REDUCIBLE_DTYPES`)."""
    ops: frozenset[str] | None = attrs.field(
        default=None, converter=_frozen_ops,
        validator=attrs.validators.optional(attrs.validators.deep_iterable(attrs.validators.in_(REDUCE_OPS))))
    """Reductions it takes, of :data:`REDUCE_OPS` (None: every one); only the calls of the
    collectives that reduce (:data:`REDUCING`) have one."""
    world_sizes: range = attrs.field(default=range(1, 1 << 20), validator=attrs.validators.instance_of(range))
    """World sizes it runs on (a ``range``)."""
    max_bytes: int | None = None
    """Most input bytes per rank it takes (None: no limit)."""
    priority: int = 0
    """The automatic choice takes, of the algorithms worth choosing for a call, the one of highest
    priority (then the first name in alphabetical order)."""
    chosen_up_to: Mapping[int | None, int] = attrs.field(factory=dict, converter=_frozen_limits)
    """For the automatic choice: the most bytes per rank it is worth choosing for, by world size;
    the key None holds the limit of the world sizes not listed. No limit where neither is given;
    0: never chosen automatically there."""
    launch_shapes: Mapping[str, Mapping[str, Mapping]] = attrs.field(factory=dict, converter=_frozen_shapes)
    """Launch shapes it can run with, by device type and name (``{"cuda": {"8192x2": {...}}}``):
    what ``algorithm="name/shape"`` selects and the tuner times (:mod:`iris.tuning`). Without
    one named, the algorithm picks its own (a call then has ``launch_shape`` None)."""

    def refusal(self, shape: CallShape) -> str | None:
        """Why this algorithm cannot run a call of ``shape``, or None when it can."""
        if self.languages and shape.language not in self.languages:
            compiles = f"{shape.language} kernels" if shape.language else "no such kernels"
            return (f"it is implemented for {', '.join(sorted(self.languages))} kernels, and this context's backend "
                    f"compiles {compiles}")
        if shape.device_type not in self.device_types:
            return f"it runs on {', '.join(sorted(self.device_types))} devices, not {shape.device_type}"
        if self.dtypes is not None and shape.dtype not in self.dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))
            return f"it takes {names} tensors, this call has {str(shape.dtype).removeprefix('torch.')}"
        if self.ops is not None and shape.op is not None and shape.op not in self.ops:
            names = ", ".join(op for op in REDUCE_OPS if op in self.ops)
            return f"it takes the reductions {names}, this call has op={shape.op!r}"
        if shape.world_size not in self.world_sizes:
            sizes = f"{self.world_sizes.start}..{self.world_sizes.stop - 1}"
            return f"it runs on world sizes {sizes}, not {shape.world_size}"
        if self.max_bytes is not None and shape.nbytes > self.max_bytes:
            return f"it takes at most {_size(self.max_bytes)} per rank, this call has {shape.nbytes} bytes"
        return None

    def worth_choosing(self, shape: CallShape) -> bool:
        """Whether the automatic choice may take it for a call of ``shape`` (it applies there, and
        the call is within the size it is worth choosing for)."""
        if self.refusal(shape) is not None:
            return False
        limit = self.chosen_up_to.get(shape.world_size, self.chosen_up_to.get(None))
        return limit is None or shape.nbytes <= limit


def _size(nbytes: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} bytes"


@functools.cache
def algorithm_registry(collective: str) -> PluginRegistry:
    """The registry of ``collective``'s algorithms (entry-point group ``iris.ccl.<collective>``)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; collectives: {', '.join(COLLECTIVES)}")
    return PluginRegistry(f"{collective} algorithm", f"iris.ccl.{collective}", error=IrisError)


def register_algorithm(algorithm: Algorithm, *, clobber: bool = False) -> None:
    """Register ``algorithm`` in process under its collective and name."""
    if not isinstance(algorithm, Algorithm):
        raise TypeError(f"expected an iris.collectives.Algorithm, got {type(algorithm).__name__}")
    algorithm_registry(algorithm.collective).register(algorithm.name, algorithm, clobber=clobber)


def choose(collective: str, nbytes: int, world_size: int, dtype: torch.dtype, device_type: str,
           language: str | None, op: str | None = None) -> Algorithm:
    """The algorithm ``ctx.ccl`` runs for a call when none is named: of the registered
    algorithms worth choosing for its :class:`CallShape` (:meth:`Algorithm.worth_choosing`), the
    one of highest priority, then of the first name. A function of the declarations and the
    call's shape only (``op``: the reduction of a collective that reduces), hence the same on every
    rank (with the same plugins installed: ``create()`` checks that). Remembered per shape until a
    registry changes."""
    global _choices_made_with
    if _choices_made_with != PluginRegistry.changes or len(_choices) >= MAX_CHOICES_KEPT:
        _choices.clear()
        _choices_made_with = PluginRegistry.changes
    key = (collective, nbytes, world_size, dtype, device_type, language, op)
    chosen = _choices.get(key)
    if chosen is None:
        chosen = _choices[key] = _choose(CallShape(collective=collective, nbytes=nbytes, world_size=world_size,
                                                   dtype=dtype, device_type=device_type, language=language, op=op))
    return chosen


#: Most choices :func:`choose` remembers (all are forgotten at once beyond it).
MAX_CHOICES_KEPT = 4096
#: Choices of :func:`choose` by call shape (as a tuple), made while the registries had changed
#: this many times.
_choices: dict[tuple, Algorithm] = {}
_choices_made_with = -1


def _choose(shape: CallShape) -> Algorithm:
    registry = algorithm_registry(shape.collective)
    candidates = [registry.get(name) for name in registry.names()]
    worth = [a for a in candidates if a.worth_choosing(shape)]
    if not worth:
        reasons = "; ".join(f"{a.name}: {a.refusal(shape) or 'not worth choosing at this size'}" for a in candidates)
        raise IrisError(f"{shape.collective}: no registered algorithm runs this call ({reasons or 'none installed'})")
    return min(worth, key=lambda a: (-a.priority, a.name))
