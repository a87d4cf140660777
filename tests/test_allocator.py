"""HeapAllocator: the deterministic first-fit allocator behind every symmetric heap.

The allocator is pure offset arithmetic, so it is checked against a reference model: a bitmap of
alignment units in which first fit is "the lowest offset where enough consecutive units are free".
With correct coalescing the allocator's free list is exactly the bitmap's maximal free runs, so the
two must agree offset for offset over long random sequences.
"""

from __future__ import annotations

import itertools
import random

import pytest

from iris.errors import HeapExhaustedError, IrisError
from iris.heap.allocator import DEFAULT_ALIGNMENT, HeapAllocator

KiB = 1 << 10
MiB = 1 << 20


class ReferenceHeap:
    """First fit over a bitmap of alignment units (1 = used)."""

    def __init__(self, size: int, alignment: int):
        self.alignment = alignment
        self.units = bytearray(size // alignment)
        self.blocks: dict[int, int] = {}  # offset -> units

    def needed_units(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.alignment))

    def allocate(self, nbytes: int, alignment: int | None = None) -> int | None:
        n = self.needed_units(nbytes)
        step = max(alignment or self.alignment, self.alignment) // self.alignment
        unit = next((u for u in range(0, len(self.units) - n + 1, step) if not any(self.units[u : u + n])), -1)
        if unit < 0:
            return None
        self.units[unit : unit + n] = b"\x01" * n
        self.blocks[unit * self.alignment] = n
        return unit * self.alignment

    def free(self, offset: int) -> None:
        n = self.blocks.pop(offset)
        unit = offset // self.alignment
        self.units[unit : unit + n] = bytes(n)

    @property
    def free_bytes(self) -> int:
        return self.units.count(0) * self.alignment

    @property
    def largest_free_block(self) -> int:
        runs = (len(list(g)) for used, g in itertools.groupby(self.units) if not used)
        return max(runs, default=0) * self.alignment


def random_ops(seed: int, count: int, max_bytes: int):
    """A reproducible list of ("alloc", nbytes) / ("free", k) operations (k picks a live block)."""
    rng = random.Random(seed)
    ops = []
    for _ in range(count):
        if rng.random() < 0.55:
            # Mix tiny, zero, unaligned and large requests.
            nbytes = rng.choice([0, 1, rng.randrange(1, 300), rng.randrange(1, 4 * KiB), rng.randrange(1, max_bytes)])
            ops.append(("alloc", (nbytes, rng.choice([None, None, None, 512, 1024, 4 * KiB]))))
        else:
            ops.append(("free", rng.randrange(1 << 30)))
    return ops


def run_ops(alloc: HeapAllocator, ops, reference: ReferenceHeap | None = None, check=None):
    """Apply ``ops``; returns the offsets handed out (None for a refused allocation)."""
    live: list[int] = []
    offsets: list[int | None] = []
    for op, arg in ops:
        if op == "alloc":
            nbytes, alignment = arg if isinstance(arg, tuple) else (arg, None)
            try:
                offset = alloc.allocate(nbytes, alignment)
            except HeapExhaustedError:
                offset = None
            offsets.append(offset)
            if reference is not None:
                assert offset == reference.allocate(nbytes, alignment), (
                    f"allocate({nbytes}, alignment={alignment}) after {len(offsets)} allocations")
            if offset is not None:
                live.append(offset)
        elif live:
            offset = live.pop(arg % len(live))
            alloc.free(offset)
            if reference is not None:
                reference.free(offset)
        if check is not None:
            check(alloc, live)
    return offsets


# -- alignment ------------------------------------------------------------------------------------


def test_default_alignment_is_at_least_256():
    assert DEFAULT_ALIGNMENT >= 256
    assert HeapAllocator(MiB).alignment == DEFAULT_ALIGNMENT


@pytest.mark.parametrize("alignment", [DEFAULT_ALIGNMENT, 512, 4096])
def test_every_offset_is_aligned_and_blocks_are_rounded_up(alignment):
    alloc = HeapAllocator(4 * MiB, alignment=alignment)
    rng = random.Random(alignment)
    for _ in range(200):
        nbytes = rng.randrange(0, 3 * alignment)
        offset = alloc.allocate(nbytes)
        assert offset % alignment == 0
        size = alloc.block_size(offset)
        assert size % alignment == 0
        assert size >= max(nbytes, 1)
        assert size - max(nbytes, 1) < alignment  # rounded up, not more


def test_consecutive_allocations_are_packed():
    alloc = HeapAllocator(MiB)
    assert [alloc.allocate(n) for n in (1, 256, 257, 0, 1000)] == [0, 256, 512, 1024, 1280]


def test_heap_size_is_truncated_to_the_alignment():
    alloc = HeapAllocator(10 * 256 + 100)
    assert alloc.size == 10 * 256
    assert alloc.free_bytes == 10 * 256


@pytest.mark.parametrize("alignment", [0, -256, 3, 384, 1000])
def test_alignment_must_be_a_power_of_two(alignment):
    with pytest.raises(ValueError, match="power of two"):
        HeapAllocator(MiB, alignment=alignment)


def test_an_aligned_block_leaves_the_bytes_it_skips_free():
    alloc = HeapAllocator(64 * KiB)
    assert alloc.allocate(100) == 0
    assert alloc.allocate(100, alignment=4 * KiB) == 4 * KiB
    assert alloc.allocate(3 * KiB) == DEFAULT_ALIGNMENT  # the skipped bytes, first fit
    assert alloc.allocate(1, alignment=64) == DEFAULT_ALIGNMENT * 13  # never below the allocator's own
    assert alloc.free_bytes == 64 * KiB - 3 * DEFAULT_ALIGNMENT - 3 * KiB


@pytest.mark.parametrize("alignment", [0, 3, -256, 1.5, True])
def test_a_requested_alignment_must_be_a_power_of_two(alignment):
    with pytest.raises(ValueError, match="power of two"):
        HeapAllocator(MiB).allocate(8, alignment)


def test_negative_request_is_value_error():
    alloc = HeapAllocator(MiB)
    with pytest.raises(ValueError, match="negative"):
        alloc.allocate(-1)
    assert alloc.num_allocations == 0


# -- zero-byte requests ---------------------------------------------------------------------------


def test_zero_byte_allocations_get_distinct_blocks():
    alloc = HeapAllocator(MiB)
    offsets = [alloc.allocate(0) for _ in range(5)]
    assert len(set(offsets)) == 5
    assert all(alloc.block_size(o) == DEFAULT_ALIGNMENT for o in offsets)
    following = alloc.allocate(10)
    assert following not in offsets
    assert alloc.used_bytes == 6 * DEFAULT_ALIGNMENT
    for o in offsets:
        assert alloc.free(o) == DEFAULT_ALIGNMENT


# -- reuse and coalescing -------------------------------------------------------------------------


def test_first_fit_reuses_the_lowest_freed_hole():
    alloc = HeapAllocator(MiB)
    a, b, c, d = (alloc.allocate(4 * KiB) for _ in range(4))
    alloc.free(b)
    alloc.free(d)
    # Fits in b's hole (the first one) even though d's hole and the tail are free too.
    assert alloc.allocate(1 * KiB) == b
    # The rest of b's hole comes next.
    assert alloc.allocate(3 * KiB) == b + 1 * KiB
    # b's hole is full now: d's hole is next.
    assert alloc.allocate(4 * KiB) == d


def test_request_larger_than_a_hole_skips_it():
    alloc = HeapAllocator(MiB)
    a, b, c = (alloc.allocate(KiB) for _ in range(3))
    alloc.free(b)
    assert alloc.allocate(2 * KiB) == c + KiB  # skips b's 1 KiB hole
    assert alloc.allocate(KiB) == b


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_freed_neighbours_coalesce_in_any_order(order):
    alloc = HeapAllocator(16 * KiB)
    blocks = [alloc.allocate(KiB) for _ in range(3)]
    guard = alloc.allocate(KiB)  # a live block after the span keeps it from merging with the tail
    for i in order:
        alloc.free(blocks[i])
    assert alloc.free_bytes == alloc.size - KiB
    # First fit takes the lowest free block of 3 KiB: the three freed blocks merged into one, or
    # else the tail after the guard.
    span = alloc.allocate(3 * KiB)
    assert span == blocks[0]
    assert alloc.block_size(span) == 3 * KiB
    assert guard == blocks[0] + 3 * KiB


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_coalescing_without_a_guard_restores_the_whole_heap(order):
    alloc = HeapAllocator(3 * KiB)
    blocks = [alloc.allocate(KiB) for _ in range(3)]
    with pytest.raises(HeapExhaustedError):
        alloc.allocate(1)
    for i in order:
        alloc.free(blocks[i])
    assert alloc.free_bytes == alloc.largest_free_block == 3 * KiB
    assert alloc.allocate(3 * KiB) == 0


def test_free_returns_the_block_size():
    alloc = HeapAllocator(MiB)
    offset = alloc.allocate(1000)
    assert alloc.free(offset) == 1024


# -- errors ---------------------------------------------------------------------------------------


def test_exhaustion_raises_heap_exhausted_with_the_numbers():
    alloc = HeapAllocator(64 * KiB)
    blocks = [alloc.allocate(8 * KiB) for _ in range(8)]
    alloc.free(blocks[1])
    alloc.free(blocks[5])
    alloc.free(blocks[6])  # 8 KiB hole and a 16 KiB hole: 24 KiB free, largest 16 KiB
    with pytest.raises(HeapExhaustedError) as info:
        alloc.allocate(20 * KiB)
    err = info.value
    assert isinstance(err, MemoryError) and isinstance(err, IrisError)
    assert err.requested == 20 * KiB
    assert err.free == 24 * KiB
    assert err.largest_block == 16 * KiB
    assert err.heap_size == 64 * KiB
    message = str(err)
    for text in ("20.0 KiB", "24.0 KiB", "16.0 KiB", "64.0 KiB", "heap_size", "free"):
        assert text in message
    # A failed allocation changes nothing.
    assert alloc.free_bytes == 24 * KiB
    assert alloc.num_allocations == 5
    assert alloc.allocate(16 * KiB) == blocks[5]


def test_exhaustion_is_a_memory_error_for_callers_that_catch_those():
    alloc = HeapAllocator(KiB)
    with pytest.raises(MemoryError):
        alloc.allocate(KiB + 1)


def test_heap_smaller_than_alignment_refuses_everything():
    alloc = HeapAllocator(100)
    assert alloc.size == 0
    with pytest.raises(HeapExhaustedError) as info:
        alloc.allocate(0)
    assert info.value.free == 0 and info.value.largest_block == 0


def test_double_free_is_value_error():
    alloc = HeapAllocator(MiB)
    offset = alloc.allocate(100)
    other = alloc.allocate(100)
    alloc.free(offset)
    with pytest.raises(ValueError, match=f"offset {offset}"):
        alloc.free(offset)
    # The failed free left the allocator intact.
    assert alloc.block_size(other) == 256
    assert alloc.free_bytes == alloc.size - 256


@pytest.mark.parametrize("delta", [1, 4, 255, 256])
def test_free_of_an_offset_that_starts_no_block_is_value_error(delta):
    alloc = HeapAllocator(MiB)
    offset = alloc.allocate(4 * KiB)
    used = alloc.used_bytes
    with pytest.raises(ValueError, match="no allocation starts"):
        alloc.free(offset + delta)
    assert alloc.used_bytes == used
    assert alloc.block_size(offset) == 4 * KiB


def test_free_of_an_offset_never_allocated_is_value_error():
    alloc = HeapAllocator(MiB)
    with pytest.raises(ValueError):
        alloc.free(0)
    with pytest.raises(ValueError):
        alloc.free(-256)


# -- long random sequences ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_first_fit_reference_over_a_random_sequence(seed):
    size = 1 * MiB
    alloc = HeapAllocator(size)
    reference = ReferenceHeap(size, DEFAULT_ALIGNMENT)
    offsets = run_ops(alloc, random_ops(seed, 3000, 64 * KiB), reference)
    assert alloc.free_bytes == reference.free_bytes
    assert alloc.largest_free_block == reference.largest_free_block
    assert alloc.used_bytes + alloc.free_bytes == alloc.size
    # The sequence exercised both success and exhaustion.
    assert any(o is None for o in offsets) and sum(o is not None for o in offsets) > 1000


def test_two_allocators_fed_the_same_sequence_agree():
    ops = random_ops(1234, 5000, 128 * KiB)
    first = run_ops(HeapAllocator(2 * MiB), ops)
    second = run_ops(HeapAllocator(2 * MiB), ops)
    assert first == second
    assert len(set(o for o in first if o is not None)) > 50  # varied, not one offset reused


def test_live_blocks_never_overlap_and_stay_in_bounds():
    def check(alloc, live):
        spans = sorted((o, o + alloc.block_size(o)) for o in live)
        assert all(end <= alloc.size for _, end in spans)
        assert all(prev_end <= start for (_, prev_end), (start, _) in zip(spans, spans[1:]))
        assert alloc.used_bytes == sum(end - start for start, end in spans)
        assert alloc.used_bytes + alloc.free_bytes == alloc.size

    run_ops(HeapAllocator(512 * KiB), random_ops(99, 1500, 48 * KiB), check=check)


def test_freeing_everything_restores_one_free_block():
    alloc = HeapAllocator(MiB)
    rng = random.Random(5)
    offsets = [alloc.allocate(rng.randrange(0, 8 * KiB)) for _ in range(100)]
    rng.shuffle(offsets)
    for o in offsets:
        alloc.free(o)
    assert alloc.num_allocations == 0
    assert alloc.free_bytes == alloc.largest_free_block == alloc.size
    assert alloc.allocate(alloc.size) == 0
