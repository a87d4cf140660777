"""A compile-only world: one rank of a world of any size, made in one process without peers.

A compile-only context is a real context of a backend (its class, mixins and set-up) whose rank
and world size are given rather than bootstrapped, whose heap is host memory standing in for every
rank's, and whose kernels are those of a GPU (``kernel_device_type="cuda"``: GPU launch shapes,
methods and tables). Its host code runs as on any rank; the kernels it launches are recorded and
compiled, never run (:mod:`iris.tools.compile_check.recorder`), so nothing a kernel would write is ever
read back as data.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from iris.context.bootstrap import Communicator
from iris.config import DEFAULT_TIMEOUT, ContextConfig
from iris.context import context_class
from iris.heap.mapping import HeapMapping, HeapProvider
from iris.registry import get_backend, heap_providers
from iris.tuning import SWITCH_ENV, TuningTable, machine_key

__all__ = ["COMPILE_ONLY_HEAP", "StandInCommunicator", "compile_only_context"]

#: The name of the heap provider of compile-only contexts.
COMPILE_ONLY_HEAP = "compile-only"
#: Heap bytes per compile-only context: host memory the operating system provides on first touch,
#: so its size costs nothing untouched. Enough for the largest fixed state a context allocates.
HEAP_BYTES = 1 << 30


class StandInCommunicator(Communicator):
    """The host exchanges of one rank whose peers all make the same calls: every rank's value is
    this rank's (what a peer would send is never known here, and only the kernels' compile-time
    arguments matter). It overrides every exchange of :class:`Communicator` (a test checks it)."""

    group = None

    def __init__(self, rank: int, world_size: int, timeout: float = DEFAULT_TIMEOUT):  # no process group to join
        self.rank, self.world_size, self.timeout = rank, world_size, timeout

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj] * self.world_size

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def host_max(self, values: list[int]) -> list[int]:
        return list(values)

    def exchange_calls(self, value: int, description: str, on_slow=None, grace: float = 0.0) -> list[tuple[int, str]]:
        return [(value, description)] * self.world_size

    def barrier(self) -> None:
        pass


def _one_heap_for_every_rank(size: int, comm: StandInCommunicator, device: torch.device) -> HeapMapping:
    own = torch.empty(size, dtype=torch.uint8)  # untouched pages cost no memory
    return HeapMapping(size=size, peers=(own,) * comm.world_size)


def _register_heap() -> None:
    if COMPILE_ONLY_HEAP not in heap_providers.names():
        heap_providers.register(COMPILE_ONLY_HEAP, HeapProvider(name=COMPILE_ONLY_HEAP, device_type="cpu",
                                                                create=_one_heap_for_every_rank))


def compile_only_context(backend: str, rank: int, world_size: int, *, tracing: bool = False):
    """Rank ``rank`` of a compile-only world of ``world_size`` ranks of ``backend``, with device-side
    tracing on or off. Destroy it with ``ctx.destroy()``."""
    _register_heap()
    spec = get_backend(backend)
    config = ContextConfig.from_env(backend=backend, heap_size=HEAP_BYTES, device="cpu",
                                    heap_provider=COMPILE_ONLY_HEAP)
    with _tuning_unread():
        ctx = context_class(spec)(config, spec, torch.device("cpu"), comm=StandInCommunicator(rank, world_size),
                                  kernel_device_type="cuda")
    if ctx.tuning is None:  # rank 0 reads the table for every rank, and here no rank 0 broadcast it
        ctx.tuning = TuningTable(machine_key(ctx))
    if tracing:
        ctx.tracing.enable()
    return ctx


@contextlib.contextmanager
def _tuning_unread():
    """The built-in choices, not a tuning cache's: the check names every algorithm, launch shape
    and method itself, and a cache's choices are among them."""
    previous = os.environ.get(SWITCH_ENV)
    os.environ[SWITCH_ENV] = "off"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[SWITCH_ENV]
        else:
            os.environ[SWITCH_ENV] = previous
