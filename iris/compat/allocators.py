"""Upstream iris's ``iris.allocators``: its allocator classes, by name.

Upstream chooses between a torch-allocated pool (``TorchAllocator``) and AMD virtual memory
(``VMemAllocator``), both ``BaseAllocator``s. iris's heap has one allocator whichever
``allocator_type`` ``iris.iris`` is given: :class:`iris.heap.allocator.HeapAllocator`, over the
heap its provider maps, with upstream's queries (``owns_tensor``, ``get_base_address``,
``get_minimum_allocation_size``, ``get_device``). Each name is that class, so that upstream's
``isinstance(ctx.heap.allocator, TorchAllocator)`` holds.
"""

from __future__ import annotations

from iris.heap.allocator import HeapAllocator

__all__ = ["BaseAllocator", "TorchAllocator", "VMemAllocator"]

BaseAllocator = TorchAllocator = VMemAllocator = HeapAllocator
