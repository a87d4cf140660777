"""Device-side barrier across ranks, launched from the host and capturable in a CUDA graph.

State lives on the symmetric heap, one int32 block per rank: ``arrivals[W]`` (how many barriers
each peer has entered, counted on the receiving rank), ``missing[W]`` (set when a wait for that
peer timed out) and ``epoch`` (barriers this rank has entered). The epoch is advanced by the
kernel itself, so a captured launch stays correct on every replay without host involvement.
"""

import triton
import triton.language as tl

from iris_triton import device
from iris_triton.waits import site_code, wait_or_record

__all__ = ["device_barrier_kernel", "state_words"]

DEVICE_BARRIER_SITE: tl.constexpr = tl.constexpr(site_code("device_barrier"))


def state_words(world_size: int) -> int:
    """int32 words of barrier state per rank."""
    return 2 * world_size + 1


@triton.jit
def device_barrier_kernel(state_ptr, heap_bases, rank, world_size, max_spins):
    arrivals = state_ptr
    missing = state_ptr + world_size
    epoch_ptr = state_ptr + 2 * world_size
    epoch = tl.load(epoch_ptr) + 1
    tl.store(epoch_ptr, epoch)
    for peer in range(world_size):
        device.atomic_add(arrivals + rank, 1, rank, peer, heap_bases, sem="release", scope="sys")
    for peer in range(world_size):
        wait_or_record(arrivals + peer, epoch, rank, heap_bases, max_spins, missing, peer, DEVICE_BARRIER_SITE)
