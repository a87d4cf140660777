"""The symmetric heap: provider mappings, the allocator, and the per-context heap."""

from iris.heap.allocator import DEFAULT_ALIGNMENT, HeapAllocator
from iris.heap.mapping import HeapMapping, HeapProvider
from iris.heap.symmetric import SymmetricHeap

__all__ = ["DEFAULT_ALIGNMENT", "HeapAllocator", "HeapMapping", "HeapProvider", "SymmetricHeap"]
