"""Upstream iris's ``ctx.heap``: what its programs and tests call on the heap object.

Upstream's heap allocates tensors (``heap.allocate(num_elements, dtype)``: a flat tensor, not
zeroed), tells whether a tensor is on it, and hands out the heap bases and the device; its
``allocator`` answers ``owns_tensor`` and ``get_base_address`` (:class:`iris.heap.allocator.HeapAllocator`
has those). :class:`iris.heap.SymmetricHeap` takes these methods from :class:`UpstreamHeapMethods`,
on every context; the ones that need the context reach it through the heap's ``owner``.
"""

from __future__ import annotations

import torch

from iris.errors import IrisError

__all__ = ["UPSTREAM_ALIGNMENT", "UpstreamHeapMethods"]

#: Upstream's default alignment of ``heap.allocate``, in bytes.
UPSTREAM_ALIGNMENT = 1024


class UpstreamHeapMethods:
    """Upstream iris's heap methods and attributes, for :class:`iris.heap.SymmetricHeap`."""

    def _context(self, what: str):
        if self.owner is None:
            raise IrisError(f"heap.{what}: this heap belongs to no context (it was made outside one, or its context "
                            f"was destroyed); call it on ctx.heap of a live context")
        return self.owner

    def allocate(self, num_elements: int, dtype: torch.dtype, alignment: int = UPSTREAM_ALIGNMENT) -> torch.Tensor:
        """A flat tensor of ``num_elements`` elements of ``dtype`` on the heap, not zeroed, its
        offset on the heap a multiple of ``alignment`` bytes; ``ctx.free`` takes it back.
        Collective: every rank allocates the same in the same order."""
        if isinstance(num_elements, bool) or not isinstance(num_elements, int) or num_elements < 0:
            raise ValueError(f"heap.allocate: num_elements must be an int >= 0, got {num_elements!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"heap.allocate: dtype must be a torch.dtype, got {dtype!r}")
        with self._context("allocate")._call("heap.allocate"):
            return self.allocate_strided((num_elements,), (1,), dtype, alignment)

    def on_symmetric_heap(self, tensor: torch.Tensor) -> bool:
        """Upstream's name of ``is_symmetric``."""
        return self.is_symmetric(tensor)

    def as_symmetric(self, tensor: torch.Tensor) -> torch.Tensor:
        """``ctx.as_symmetric(tensor)``."""
        return self._context("as_symmetric").as_symmetric(tensor)

    def get_heap_bases(self) -> torch.Tensor:
        return self._context("get_heap_bases").get_heap_bases()

    def get_device(self) -> torch.device:
        return self.local.device

    def refresh_peer_access(self) -> None:
        """Nothing to do: every peer's heap is mapped once, when the context is made, and stays
        mapped (upstream maps allocations made since the last call)."""

    @property
    def heap_size(self) -> int:
        return self.size

    @property
    def device_id(self) -> int | None:
        return self.local.device.index

    @property
    def cur_rank(self) -> int:
        return self.comm.rank

    @property
    def num_ranks(self) -> int:
        return self.comm.world_size
