"""A user kernel that records trace events (tests/test_tracing.py): each program puts its block
of ``src`` into the next rank's ``dst`` inside a ``put`` event, records the same store the way
upstream iris's kernels do (``record_event_start`` with a mask) and an instant ``compute``."""

import triton
import triton.language as tl

from iris_triton.device.kernel_api import DeviceContext, TraceEvent

#: The call number the kernel's events carry.
OP = tl.constexpr(7)


@triton.jit
def traced_ring_put(context, src, dst, n, TRACING: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                    BLOCK: tl.constexpr):
    dctx = DeviceContext.initialize(context, RANK, WORLD, tracing=TRACING)
    peer = (RANK + 1) % WORLD
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    elements = tl.minimum(n - tl.program_id(0) * BLOCK, BLOCK)
    span = dctx.tracing.begin(TraceEvent().put, target_rank=peer, nbytes=elements * 4, tile=tl.program_id(0), op=OP)
    dctx.put(src + offs, dst + offs, peer, mask=mask)
    dctx.tracing.end(span)
    handle = dctx.tracing.record_event_start(TraceEvent().store, peer, dst + offs, tl.program_id(0), 1, mask=mask)
    dctx.tracing.record_event_end(handle)
    dctx.tracing.record(TraceEvent().compute, tile=tl.program_id(0), op=OP)
