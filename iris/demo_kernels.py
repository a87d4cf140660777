"""The demo's Triton kernel (imported only when the demo runs: ``import iris`` never imports Triton)."""

from __future__ import annotations

import triton
import triton.language as tl

import iris


@triton.jit
def ring_store_kernel(src, dst, n, heap_bases, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Store this rank's ``src`` into ``dst`` on rank ``RANK + 1`` (remote stores)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    iris.store(dst + offs, tl.load(src + offs, mask=mask), RANK, (RANK + 1) % WORLD, heap_bases, mask=mask)
