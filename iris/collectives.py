"""Collective algorithms: what one is, the registry of each collective, and the automatic choice.

An :class:`Algorithm` implements one collective (``all_reduce``, ``all_gather``, ...). Each
collective has its own registry, filled from the entry-point group ``iris.ccl.<collective>``
(the Triton backend declares its algorithms there; a plugin distribution adds its own the same
way) and by :func:`register_algorithm` in process. ``ctx.ccl`` validates a call, then hands it
to the algorithm that ``algorithm=`` names or that :func:`choose` picks by size, world size and
dtype; the choice depends only on arguments every rank passes identically, so every rank runs
the same one.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any, Callable

import attrs
import torch

from iris.errors import IrisError
from iris.registry import PluginRegistry

__all__ = [
    "COLLECTIVES",
    "REDUCE_OPS",
    "Algorithm",
    "CollectiveCall",
    "algorithm_registry",
    "choose",
    "register_algorithm",
]

#: The collectives of ``ctx.ccl`` that dispatch to registered algorithms.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
#: Reductions, by the names the kernels use.
REDUCE_OPS = ("sum", "max", "min")


@attrs.frozen(kw_only=True, cache_hash=False)
class CollectiveCall:
    """One validated call, as an algorithm receives it."""

    context: Any
    """The iris context."""
    collective: str
    output: Any
    """The result tensor (for ``all_reduce`` and ``broadcast``: the tensor itself)."""
    input: Any
    op: str = "sum"
    """``"sum"``, ``"max"`` or ``"min"`` (reductions only)."""
    src: int = 0
    """The source rank (``broadcast`` only)."""

    @functools.cached_property
    def signature(self) -> int:
        """16 bits that every rank's identical call shares and a different call (another
        collective, size, dtype, op or source) almost surely does not; never 0. Kernels announce
        it to their peers with the call's number, so a peer that made a different call is caught
        on the device instead of exchanging mismatched data."""
        what = (self.collective, self.input.numel(), self.output.numel(), str(self.input.dtype), self.op, self.src)
        return zlib.crc32(repr(what).encode()) & 0xFFFF | 1


@attrs.frozen(kw_only=True)
class Algorithm:
    """An implementation of one collective, as registered under ``iris.ccl.<collective>``."""

    name: str
    collective: str = attrs.field(validator=attrs.validators.in_(COLLECTIVES))
    run: Callable[[CollectiveCall], Callable[[], None] | None]
    """Enqueues the collective on the context's current stream and returns without waiting.
    It may return a *repeat*: a callable that enqueues the same call again, on the then-current
    stream, without preparing it anew; ``ctx.ccl`` runs it instead of ``run`` for identical later
    calls (same tensors by address, size, dtype and layout, same options) until the workspace
    grows. None means every call goes through ``run``."""
    frontends: frozenset[str] = attrs.field(default=frozenset({"triton", "gluon"}), converter=frozenset)
    """Kernel languages it is implemented in; a context whose backend compiles in another
    language cannot run it."""
    description: str = ""


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


#: Automatic choice for all_reduce, by bytes per rank: low-latency (one-shot with a flag in every
#: word: no fence, twice the bytes on the link) up to the first limit; for floating-point tensors,
#: sentinel (one-shot into a workspace whose NaN sentinel marks missing data: no fence, no flag,
#: the bytes of a one-shot) up to the second; one-shot (every rank receives every input: one
#: exchange) up to the third; two-shot (reduce-scatter then all-gather: two exchanges, each rank
#: reducing only its share) above. Measured on 2 x H200 (benchmarks/NOTES-archive.md); other world sizes
#: are not measured yet, and take no sentinel.
LOW_LATENCY_MAX_BYTES = {2: 256 << 10}
LOW_LATENCY_MAX_BYTES_DEFAULT = 64 << 10
SENTINEL_MAX_BYTES = {2: 8 << 20}
ONE_SHOT_MAX_BYTES = {2: 8 << 20, 3: 1 << 20}
ONE_SHOT_MAX_BYTES_DEFAULT = 256 << 10
#: The dtypes the sentinel all_reduce takes (an all-ones element is a NaN in each).
SENTINEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def choose(collective: str, nbytes: int, world_size: int, dtype: torch.dtype) -> str:
    """The algorithm ``ctx.ccl`` runs when none is named: a function of the collective, the
    bytes per rank, the world size and the dtype only, hence the same on every rank."""
    if collective == "all_reduce":
        if nbytes <= LOW_LATENCY_MAX_BYTES.get(world_size, LOW_LATENCY_MAX_BYTES_DEFAULT):
            return "low_latency"
        if dtype in SENTINEL_DTYPES and nbytes <= SENTINEL_MAX_BYTES.get(world_size, 0):
            return "sentinel"
        return "one_shot" if nbytes <= ONE_SHOT_MAX_BYTES.get(world_size, ONE_SHOT_MAX_BYTES_DEFAULT) else "two_shot"
    return "direct"
