"""Element-wise reductions shared by the collective kernels (compiled in the caller's language)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["combine", "widen"]


@triton.jit
def widen(x):
    """``x`` in the type reductions accumulate in (float32 for 16-bit floats)."""
    if x.dtype.is_fp16() or x.dtype.is_bf16():
        x = x.to(tl.float32)
    return x


@triton.jit
def combine(acc, x, OP: tl.constexpr):
    """``acc`` combined with ``x`` by ``OP`` (``"sum"``, ``"max"`` or ``"min"``)."""
    if OP == "sum":
        acc = acc + x
    elif OP == "max":
        acc = tl.maximum(acc, x)
    else:
        tl.static_assert(OP == "min", "OP must be 'sum', 'max' or 'min'")
        acc = tl.minimum(acc, x)
    return acc
