"""HeapMixin: the symmetric heap of a context."""

from __future__ import annotations

import time
import weakref
from typing import Any, Protocol

import torch

from iris.config import debug_from_environment
from iris.errors import IrisError, NotOnHeapError, format_bytes
from iris.heap import SymmetricHeap
from iris.heap.device_context import make_device_context
from iris.registry import heap_providers

__all__ = ["HeapMixin", "DEFAULT_HEAP_PROVIDERS"]

#: Heap provider used for each device type unless ``create(heap_provider=...)`` names one.
DEFAULT_HEAP_PROVIDERS = {"cpu": "shm", "cuda": "cuda-ipc"}


class HeapHost(Protocol):
    """What HeapMixin needs from the context it is part of (checked when a context is made)."""

    config: Any
    comm: Any
    rank: int
    world_size: int
    device: Any


class HeapMixin:
    """Adds the symmetric heap: ``heap_size``, ``get_heap_bases()``, ``is_symmetric(t)``,
    ``free(t)``, ``get_device_context()``, the heap's symmetry check in ``barrier()`` and, for
    other mixins, ``heap`` (a :class:`iris.heap.SymmetricHeap`).

    Set up by the ``_setup`` hook.
    """

    needs = HeapHost

    heap: SymmetricHeap

    def _setup(self) -> None:
        super()._setup()
        name = self.config.heap_provider or DEFAULT_HEAP_PROVIDERS[self.device.type]
        provider = heap_providers.get(name)
        if provider.device_type != self.device.type:
            raise IrisError(
                f"heap provider {name!r} provides {provider.device_type} memory, but this context "
                f"runs on {self.device}; use heap_provider={DEFAULT_HEAP_PROVIDERS[self.device.type]!r}"
            )
        start = time.perf_counter()
        # Shared with this rank's node only (a world of one node: with every rank).
        mapping = self._node_local_mapping(provider.create(self.config.heap_size, self.node_comm, self.device))
        # The allocation map also when IRIS_DEBUG=1 asks kernels to check writes against it.
        self.heap = SymmetricHeap(mapping, self.comm, debug=self.config.debug,
                                  allocation_map=self.config.debug or debug_from_environment(),
                                  node_layout=self.node_layout if self.node_layout.nodes > 1 else None)
        self.heap.owner = weakref.proxy(self)
        self.heap_creation_seconds = time.perf_counter() - start
        self._device_context = make_device_context(self.rank, self.world_size, mapping.bases, mapping.size,
                                                   self.device)
        self._heap_bases = self._device_context[2:2 + self.world_size]
        self.debug(
            f"heap: {format_bytes(mapping.size)} per rank via {name!r} in "
            f"{self.heap_creation_seconds * 1e3:.1f} ms"
        )

    def _teardown(self) -> None:
        # Peers may still be reading this rank's heap until they arrive here; a failed context
        # does not wait for peers, which may be gone.
        if not self.failed:
            self.comm.barrier()
        self.heap.owner = None
        del self.heap, self._heap_bases, self._device_context
        super()._teardown()

    def _summary(self) -> dict[str, Any]:
        return {**super()._summary(), "heap_size": format_bytes(self.heap.size)}

    def barrier(self) -> None:
        """Host barrier, then the check that every rank made the same allocations and frees
        (:class:`iris.errors.AsymmetricHeapError` on every rank otherwise): after it, peers
        may write into every tensor allocated before it. Collective."""
        super().barrier()
        self.heap.check_symmetric()

    @property
    def heap_size(self) -> int:
        """Bytes of symmetric heap per rank."""
        return self.heap.size

    @property
    def heap_bases(self) -> torch.Tensor:
        """Upstream iris's name of :meth:`get_heap_bases`."""
        return self._heap_bases

    def get_heap_bases(self) -> torch.Tensor:
        """int64 tensor ``[world_size]``: where each rank's heap is mapped in this process."""
        return self._heap_bases

    def get_device_context(self) -> torch.Tensor:
        """int64 tensor ``[rank, world_size, base_0, ..., base_{W-1}, ...]`` on the context's
        device, the single argument from which device code builds its context. Upstream iris's
        layout: the rank, the world size, then the heap bases (``heap_bases`` is ``context + 2``);
        what follows the bases is iris's own trailer (:mod:`iris.heap.device_context`: the heap
        size, the trace buffer, the timeout and fault words of the device-side waits) and may grow."""
        return self._device_context

    def is_symmetric(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies entirely on this context's heap."""
        return self.heap.is_symmetric(tensor)

    def _heap_offset(self, tensor: torch.Tensor, what: str = "tensor") -> int:
        if not self.is_symmetric(tensor):
            raise NotOnHeapError(
                f"{what} (shape {tuple(tensor.shape)}, {tensor.dtype}, on {tensor.device}) is not on "
                f"this context's symmetric heap (rank {self.rank}, {self.device}); allocate it with "
                f"ctx.empty/zeros/... or copy it there with ctx.as_symmetric(t)"
            )
        return self.heap.offset_of(tensor)

    def free(self, tensor: torch.Tensor) -> None:
        """Return ``tensor``'s block to the heap for reuse. This is a collective operation:
        every rank frees the same tensors in the same order. The tensor must not be used after."""
        with self._call("free"):
            self._free(tensor)

    def _free(self, tensor: torch.Tensor) -> None:
        offset = self._heap_offset(tensor)
        signature = (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        mapped = self.heap.imports.get(offset)
        if mapped is not None and mapped.signature == signature:
            self.heap.unmap_in_place(offset)
            return
        if self.heap.allocator.block_size(offset) is None or self.heap.allocated_as.get(offset) != signature:
            raise ValueError(
                f"tensor at heap offset {offset} is not the start of a live allocation: free only "
                f"tensors returned by the context's constructors (not views into them), each once"
            )
        self.heap.free_offset(offset, detail=f"{tuple(tensor.shape)} {tensor.dtype}")
