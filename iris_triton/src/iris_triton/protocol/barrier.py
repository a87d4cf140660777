"""Device-side barrier across ranks, launched from the host and capturable in a CUDA graph.

State lives on the symmetric heap, one int32 block per rank: ``arrivals[W]`` (how many barriers
each peer has entered, counted on the receiving rank) and ``epoch`` (barriers this rank has
entered). The epoch is advanced by the kernel itself, so a captured launch stays correct on every
replay without host involvement. A wait that gives up records the failure in the context's fault
words (:mod:`iris_triton.protocol.waits`).
"""

import triton
import triton.language as tl

from iris_triton.device import functions as device
from iris_triton.device.tracing import OPERATION_EVENT, DeviceTracing
from iris_triton.protocol.waits import failed, site_code, wait_or_record

__all__ = ["device_barrier_kernel", "state_words"]

DEVICE_BARRIER_SITE: tl.constexpr = tl.constexpr(site_code("device_barrier"))


def state_words(world_size: int) -> int:
    """int32 words of barrier state per rank."""
    return world_size + 1


@triton.jit
def device_barrier_kernel(state_ptr, heap_bases, faults, host_faults, rank, world_size, timeout_ns,
                          TRACING: tl.constexpr):
    tracing = DeviceTracing.of(heap_bases - 2, world_size, TRACING)  # heap_bases is the device context + 2
    arrivals = state_ptr
    epoch_ptr = state_ptr + world_size
    epoch = tl.load(epoch_ptr) + 1
    span = tracing.begin(OPERATION_EVENT + DEVICE_BARRIER_SITE, op=epoch)
    tl.store(epoch_ptr, epoch)
    if not failed(faults):  # a failed context sends peers nothing: they give up rather than pass
        for peer in range(world_size):
            device.atomic_add(arrivals + rank, 1, rank, peer, heap_bases, sem="release", scope="sys")
    for peer in range(world_size):
        wait_or_record(arrivals + peer, epoch, rank, heap_bases, timeout_ns, faults, host_faults, world_size, peer,
                       DEVICE_BARRIER_SITE)
    tracing.end(span)
