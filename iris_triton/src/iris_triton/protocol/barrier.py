"""Device-side barrier across ranks, launched from the host and capturable in a CUDA graph.

State lives on the symmetric heap, one int32 block per rank: ``arrivals[W]`` (how many barriers
each peer has entered, counted on the receiving rank) and ``epoch`` (barriers this rank has
entered). The epoch is advanced by the kernel itself, so a captured launch stays correct on every
replay without host involvement. A wait that gives up records the failure in the context's fault
words (:mod:`iris_triton.protocol.waits`).
"""

import triton
import triton.language as tl

from iris_triton.device.context import DeviceContext
from iris_triton.device.tracing import OPERATION_EVENT
from iris_triton.protocol.waits import failed, site_code, wait_or_record

__all__ = ["device_barrier_kernel", "state_words"]

DEVICE_BARRIER_SITE: tl.constexpr = tl.constexpr(site_code("device_barrier"))


def state_words(world_size: int) -> int:
    """int32 words of barrier state per rank."""
    return world_size + 1


@triton.jit
def device_barrier_kernel(context, state_ptr, RANK: tl.constexpr, WORLD: tl.constexpr, TRACING: tl.constexpr):
    dctx = DeviceContext.initialize(context, RANK, WORLD, TRACING)
    arrivals = state_ptr
    epoch_ptr = state_ptr + WORLD
    epoch = tl.load(epoch_ptr) + 1
    span = dctx.tracing.begin(OPERATION_EVENT + DEVICE_BARRIER_SITE, op=epoch)
    tl.store(epoch_ptr, epoch)
    if not failed(dctx):  # a failed context sends peers nothing: they give up rather than pass
        for peer in range(WORLD):
            dctx.atomic_add(arrivals + RANK, 1, peer, sem="release", scope="sys")
    for peer in range(WORLD):
        wait_or_record(dctx, arrivals + peer, epoch, peer, DEVICE_BARRIER_SITE)
    dctx.tracing.end(span)
