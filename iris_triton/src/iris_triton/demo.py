"""The Triton backend's step of ``iris demo``: a kernel that stores into the next rank's heap."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iris_triton.device import functions as device
from iris_triton.device.tracing import DeviceTracing, TraceEvent

__all__ = ["ring_store_kernel", "ring_store_step"]


@triton.jit
def ring_store_kernel(src, dst, n, heap_bases, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                      TRACING: tl.constexpr):
    """Store this rank's ``src`` into ``dst`` on rank ``RANK + 1`` (remote stores), each
    program's block a ``store`` event when ``TRACING``."""
    tracing = DeviceTracing.of(heap_bases - 2, WORLD, TRACING)  # heap_bases is the device context + 2
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    span = tracing.begin(TraceEvent().store, (RANK + 1) % WORLD, tl.minimum(n - tl.program_id(0) * BLOCK, BLOCK) *
                         (src.dtype.element_ty.primitive_bitwidth // 8), tile=tl.program_id(0))
    device.store(dst + offs, tl.load(src + offs, mask=mask), RANK, (RANK + 1) % WORLD, heap_bases, mask=mask)
    tracing.end(span)


def ring_store_step(ctx, inputs: list[torch.Tensor]) -> bool:
    """Every rank stores its input into the next rank's heap; whether this rank received the
    previous rank's input, exactly."""
    rank, world, n = ctx.rank, ctx.world_size, inputs[0].numel()
    src = ctx.as_symmetric(inputs[rank])
    dst = ctx.zeros(n, dtype=src.dtype)
    ctx.barrier()
    ring_store_kernel[(triton.cdiv(n, 1024),)](src, dst, n, ctx.get_heap_bases(), RANK=rank, WORLD=world, BLOCK=1024,
                                                TRACING=ctx.tracing.enabled)
    ctx.barrier()
    return torch.equal(dst, inputs[(rank - 1) % world])
