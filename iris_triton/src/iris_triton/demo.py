"""The Triton backend's step of ``iris demo``: a kernel that stores into the next rank's heap."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iris_triton import device

__all__ = ["ring_store_kernel", "ring_store_step"]


@triton.jit
def ring_store_kernel(src, dst, n, heap_bases, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Store this rank's ``src`` into ``dst`` on rank ``RANK + 1`` (remote stores)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    device.store(dst + offs, tl.load(src + offs, mask=mask), RANK, (RANK + 1) % WORLD, heap_bases, mask=mask)


def ring_store_step(ctx, inputs: list[torch.Tensor]) -> bool:
    """Every rank stores its input into the next rank's heap; whether this rank received the
    previous rank's input, exactly."""
    rank, world, n = ctx.rank, ctx.world_size, inputs[0].numel()
    src = ctx.as_symmetric(inputs[rank])
    dst = ctx.zeros(n, dtype=src.dtype)
    ctx.barrier()
    ring_store_kernel[(triton.cdiv(n, 1024),)](src, dst, n, ctx.get_heap_bases(), RANK=rank, WORLD=world, BLOCK=1024)
    ctx.barrier()
    return torch.equal(dst, inputs[(rank - 1) % world])
