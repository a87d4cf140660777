"""Deterministic first-fit allocator over the byte range of one symmetric heap.

Every rank runs the same sequence of ``allocate``/``free`` calls, so every rank computes the
same offsets: that is what makes the heap symmetric. Freed blocks are coalesced with free
neighbours and reused. The allocator only does arithmetic on offsets; it never touches memory.
It knows where its heap starts, for upstream iris's allocator queries (``owns_tensor``,
``get_base_address``).
"""

from __future__ import annotations

import bisect

import torch

from iris.errors import HeapExhaustedError

__all__ = ["HeapAllocator", "DEFAULT_ALIGNMENT"]

#: Smallest alignment of every block: enough for 16-byte vector accesses and 128-byte lines.
DEFAULT_ALIGNMENT = 256


class HeapAllocator:
    """First-fit allocation with coalescing free, over ``[0, size)``."""

    def __init__(self, size: int, alignment: int = DEFAULT_ALIGNMENT, *, base_address: int = 0,
                 device: torch.device | None = None):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.size = size - size % alignment
        self.alignment = alignment
        #: Where offset 0 is in this process, and on which device (0 and None: not known).
        self.base_address, self.device = base_address, device
        # Free blocks as parallel sorted lists of offsets and sizes: first fit walks them in
        # offset order, which keeps the layout compact and identical on every rank.
        self._free_offsets: list[int] = [0] if self.size else []
        self._free_sizes: list[int] = [self.size] if self.size else []
        self._allocated: dict[int, int] = {}

    def _round_up(self, nbytes: int) -> int:
        return max(self.alignment, -(-nbytes // self.alignment) * self.alignment)

    def allocate(self, nbytes: int, alignment: int | None = None) -> int:
        """Offset of a new block of at least ``nbytes`` (a zero-byte request still gets a block), a
        multiple of ``alignment`` bytes (a power of two; default and at least the allocator's):
        the first free block that fits it once aligned, the bytes skipped to align staying free."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative number of bytes ({nbytes})")
        if alignment is not None and (isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0
                                      or alignment & (alignment - 1)):
            raise ValueError(f"alignment must be a power of two number of bytes, got {alignment!r}")
        align = max(alignment or self.alignment, self.alignment)
        needed = self._round_up(nbytes)
        for i, block in enumerate(self._free_sizes):
            offset = self._free_offsets[i]
            skipped = -offset % align
            if block < skipped + needed:
                continue
            rest = block - skipped - needed
            del self._free_offsets[i], self._free_sizes[i]
            for start, size in ((offset + skipped + needed, rest), (offset, skipped)):  # kept in offset order
                if size:
                    self._free_offsets.insert(i, start)
                    self._free_sizes.insert(i, size)
            self._allocated[offset + skipped] = needed
            return offset + skipped
        raise HeapExhaustedError(nbytes, self.free_bytes, self.largest_free_block, self.size)

    def free(self, offset: int) -> int:
        """Return the block at ``offset`` to the heap; returns its size."""
        try:
            size = self._allocated.pop(offset)
        except KeyError:
            raise ValueError(
                f"no allocation starts at heap offset {offset}: free only tensors returned by the "
                f"context's constructors (not views into them), and each only once"
            ) from None
        freed = size
        i = bisect.bisect_left(self._free_offsets, offset)
        # Merge with the following free block, then with the preceding one.
        if i < len(self._free_offsets) and self._free_offsets[i] == offset + size:
            size += self._free_sizes[i]
            del self._free_offsets[i], self._free_sizes[i]
        if i > 0 and self._free_offsets[i - 1] + self._free_sizes[i - 1] == offset:
            self._free_sizes[i - 1] += size
        else:
            self._free_offsets.insert(i, offset)
            self._free_sizes.insert(i, size)
        return freed

    def block_size(self, offset: int) -> int | None:
        """Size of the allocated block starting at ``offset``, or None."""
        return self._allocated.get(offset)

    @property
    def free_bytes(self) -> int:
        return sum(self._free_sizes)

    @property
    def used_bytes(self) -> int:
        return sum(self._allocated.values())

    @property
    def largest_free_block(self) -> int:
        return max(self._free_sizes, default=0)

    @property
    def num_allocations(self) -> int:
        return len(self._allocated)

    # -- upstream iris's allocator queries ------------------------------------------------------

    def get_base_address(self) -> int:
        """The address of offset 0 (the heap's first byte) in this process."""
        return self.base_address

    def get_device(self) -> torch.device | None:
        return self.device

    def get_minimum_allocation_size(self) -> int:
        """Bytes of the smallest block (what a request of 0 or 1 byte takes)."""
        return self.alignment

    def owns_tensor(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` starts inside the heap (a tensor without elements always does)."""
        if not isinstance(tensor, torch.Tensor) or (self.device is not None and tensor.device != self.device):
            return False
        if tensor.numel() == 0:
            return True
        return self.base_address <= tensor.data_ptr() < self.base_address + self.size
