"""One context's symmetric heap: a provider's mapping plus the allocator over it."""

from __future__ import annotations

import attrs
import torch

from iris.bootstrap import Communicator
from iris.errors import AsymmetricHeapError, IrisError
from iris.heap.allocator import HeapAllocator
from iris.heap.mapping import HeapMapping

__all__ = ["SymmetricHeap", "HeapCall"]


@attrs.frozen
class HeapCall:
    """One allocation or free, as compared across ranks in debug mode."""

    index: int
    op: str
    nbytes: int
    detail: str

    def __str__(self) -> str:
        return f"call #{self.index}: {self.op}({self.nbytes} bytes{', ' + self.detail if self.detail else ''})"


class SymmetricHeap:
    """Allocates and frees blocks at offsets identical on every rank.

    Allocation and free are collective in the sense that every rank must make the same calls in
    the same order; they communicate only in debug mode, where each call is compared across
    ranks and the first mismatch raises :class:`AsymmetricHeapError` on every rank.
    """

    def __init__(self, mapping: HeapMapping, comm: Communicator, *, debug: bool = False):
        self.mapping = mapping
        self.comm = comm
        self.debug = debug
        self.allocator = HeapAllocator(mapping.size)
        self._calls = 0
        #: (shape, stride, dtype) of the tensor each live block was allocated as, by offset:
        #: ``free`` accepts that tensor only, never a view of it.
        self.allocated_as: dict[int, tuple] = {}

    @property
    def size(self) -> int:
        return self.mapping.size

    @property
    def local(self) -> torch.Tensor:
        """This rank's heap as a flat uint8 tensor."""
        return self.mapping.peers[self.comm.rank]

    def _check_symmetric(self, op: str, nbytes: int, detail: str) -> None:
        call = HeapCall(self._calls, op, nbytes, detail)
        self._calls += 1
        if not self.debug:
            return
        calls = self.comm.all_gather_object(call)
        if any(c != call for c in calls):
            listing = "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
            raise AsymmetricHeapError(
                f"ranks made different heap calls at call #{call.index} ({listing}); every rank "
                f"must allocate and free the same sizes in the same order"
            )

    def allocate(self, nbytes: int, detail: str = "") -> int:
        """Offset of a new block of ``nbytes``; identical on every rank."""
        self._check_symmetric("allocate", nbytes, detail)
        return self.allocator.allocate(nbytes)

    def free_offset(self, offset: int, detail: str = "") -> None:
        self._check_symmetric("free", self.allocator.block_size(offset) or 0, detail)
        self.allocator.free(offset)
        self.allocated_as.pop(offset, None)

    def view(self, offset: int, nbytes: int, rank: int | None = None) -> torch.Tensor:
        """``nbytes`` of the heap of ``rank`` (default: this rank) from ``offset``, as uint8."""
        heap = self.mapping.peers[self.comm.rank if rank is None else rank]
        return heap[offset : offset + nbytes]

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Byte offset of ``tensor``'s first element in this rank's heap, or None if not on it."""
        local = self.local
        if tensor.device != local.device:
            return None
        # Not tensor.data_ptr(): torch reports 0 for a tensor with no elements, which would put
        # every zero-size heap tensor off the heap (and make it impossible to free). The storage
        # pointer plus the storage offset is the element address for every tensor, empty or not.
        address = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()
        offset = address - local.data_ptr()
        return offset if 0 <= offset < self.size else None

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether every element of ``tensor`` lies on this rank's heap."""
        offset = self.offset_of(tensor)
        if offset is None:
            return False
        if tensor.numel() == 0:
            return True
        span = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1
        return offset + span * tensor.element_size() <= self.size

    def peer_view(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """The tensor at the same offset, shape and strides on ``rank``'s heap (host access)."""
        offset = self.offset_of(tensor)
        if offset is None:
            raise IrisError("tensor is not on the symmetric heap")
        usable = (self.size - offset) // tensor.element_size() * tensor.element_size()
        raw = self.mapping.peers[rank][offset : offset + usable]
        return raw.view(tensor.dtype).as_strided(tensor.shape, tensor.stride())
