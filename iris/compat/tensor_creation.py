"""Upstream iris's ``iris.tensor_creation``: its tensor constructors as free functions of the
heap, ``zeros(heap, iris_device, size, ...)`` and so on, with its argument checks.

Each constructor is the heap's context's own (``ctx.zeros`` and the rest, torch's semantics on
the heap), after upstream's device check: the same tensors, the same ``out=`` rules and errors.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from iris.compat.heap import UPSTREAM_ALIGNMENT
from iris.mixins.tensors import _unnest_size

__all__ = ["allocate", "apply_layout", "apply_memory_format", "arange", "empty", "full", "is_valid_device",
           "linspace", "ones", "parse_size", "rand", "randint", "randn", "throw_if_invalid_device",
           "throw_if_invalid_output_tensor", "uniform", "zeros", "zeros_like"]


def _context(heap):
    """The context whose heap ``heap`` is."""
    context = getattr(heap, "_context", None)
    if context is None:
        raise TypeError(f"iris.tensor_creation: heap must be a context's heap (ctx.heap), got {type(heap).__name__}")
    return context("tensor_creation")


def allocate(heap, num_elements: int, dtype: torch.dtype) -> torch.Tensor:
    """``heap.allocate(num_elements, dtype)``: a flat tensor on the heap, not zeroed."""
    return heap.allocate(num_elements, dtype, UPSTREAM_ALIGNMENT)


def parse_size(size) -> tuple[tuple, int]:
    """``(size, number of elements)`` of a size given as ``(2, 3)``, ``((2, 3),)`` or ``([2, 3],)``."""
    size = tuple(_unnest_size(tuple(size)))
    return size, math.prod(size)


def is_valid_device(device, iris_device) -> bool:
    """Whether a requested ``device`` (None, a name or a :class:`torch.device`) is the heap's
    device ``iris_device``: None always is; otherwise the same type, and the same index unless the
    request names none."""
    if device is None:
        return True
    requested, own = torch.device(device), torch.device(iris_device)
    return requested.type == own.type and requested.index in (None, own.index)


def throw_if_invalid_device(device, iris_device) -> None:
    if not is_valid_device(device, iris_device):
        raise RuntimeError(f"Device mismatch: requested device {device} but the heap is on device {iris_device}; "
                           f"tensors on the symmetric heap live on its device: omit device= or pass {iris_device}")


def throw_if_invalid_output_tensor(heap, tensor: torch.Tensor, num_elements: int, dtype: torch.dtype) -> None:
    """Raise RuntimeError unless ``tensor`` has ``num_elements`` elements of ``dtype`` and lies on ``heap``."""
    if tensor.numel() != num_elements:
        raise RuntimeError(f"The output tensor has {tensor.numel()} elements, but {num_elements} are required")
    if tensor.dtype != dtype:
        raise RuntimeError(f"The output tensor has dtype {tensor.dtype}, but {dtype} is required")
    if not heap.is_symmetric(tensor):
        raise RuntimeError("The output tensor is not on the symmetric heap")


def apply_layout(tensor: torch.Tensor, layout: torch.layout) -> torch.Tensor:
    """``tensor``, whose layout must be ``torch.strided`` (the heap's only one)."""
    if layout == torch.strided:
        return tensor
    raise ValueError(f"Layout {layout} not supported: tensors on the symmetric heap are torch.strided")


def apply_memory_format(heap, tensor: torch.Tensor, size: tuple, memory_format: torch.memory_format,
                        input_tensor: torch.Tensor | None = None) -> torch.Tensor:
    """``tensor`` (of shape ``size``) in ``memory_format``, on the heap: itself when its strides
    already are, else a copy (``torch.preserve_format``: ``input_tensor``'s format)."""
    if memory_format == torch.preserve_format:
        memory_format = (input_tensor if input_tensor is not None else tensor).suggest_memory_format()
    if tensor.is_contiguous(memory_format=memory_format):
        return tensor
    copy = _context(heap).empty(*size, dtype=tensor.dtype, memory_format=memory_format)
    copy.copy_(tensor)
    return copy


def _made(heap, iris_device, device, constructor: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    throw_if_invalid_device(device, iris_device)
    return getattr(_context(heap), constructor)(*args, device=device, **kwargs)


def zeros(heap, iris_device, size, *, out=None, dtype=None, layout=torch.strided, device=None, requires_grad=False):
    return _made(heap, iris_device, device, "zeros", *parse_size(size)[0], out=out, dtype=dtype, layout=layout,
                 requires_grad=requires_grad)


def ones(heap, iris_device, size, *, out=None, dtype=None, layout=torch.strided, device=None, requires_grad=False):
    return _made(heap, iris_device, device, "ones", *parse_size(size)[0], out=out, dtype=dtype, layout=layout,
                 requires_grad=requires_grad)


def full(heap, iris_device, size, fill_value, *, out=None, dtype=None, layout=torch.strided, device=None,
         requires_grad=False):
    return _made(heap, iris_device, device, "full", parse_size(size)[0], fill_value, out=out, dtype=dtype,
                 layout=layout, requires_grad=requires_grad)


def zeros_like(heap, iris_device, input: torch.Tensor, *, dtype=None, layout=None, device=None, requires_grad=False,
               memory_format=torch.preserve_format):
    return _made(heap, iris_device, device, "zeros_like", input, dtype=dtype, layout=layout,
                 requires_grad=requires_grad, memory_format=memory_format)


def empty(heap, iris_device, size, *, out=None, dtype=None, layout=torch.strided, device=None, requires_grad=False,
          memory_format=torch.contiguous_format):
    return _made(heap, iris_device, device, "empty", *parse_size(size)[0], out=out, dtype=dtype, layout=layout,
                 requires_grad=requires_grad, memory_format=memory_format)


def uniform(heap, iris_device, size, low=0.0, high=1.0, dtype=torch.float):
    return _made(heap, iris_device, None, "uniform", parse_size(size)[0], low=low, high=high, dtype=dtype)


def randn(heap, iris_device, size, *, generator=None, out=None, dtype=None, layout=torch.strided, device=None,
          requires_grad=False):
    return _made(heap, iris_device, device, "randn", *parse_size(size)[0], generator=generator, out=out, dtype=dtype,
                 layout=layout, requires_grad=requires_grad)


def rand(heap, iris_device, size, *, generator=None, out=None, dtype=None, layout=torch.strided, device=None,
         requires_grad=False):
    return _made(heap, iris_device, device, "rand", *parse_size(size)[0], generator=generator, out=out, dtype=dtype,
                 layout=layout, requires_grad=requires_grad)


def randint(heap, iris_device, low, high, size, *, generator=None, out=None, dtype=None, layout=torch.strided,
            device=None, requires_grad=False):
    return _made(heap, iris_device, device, "randint", low, high, parse_size(size)[0], generator=generator, out=out,
                 dtype=dtype, layout=layout, requires_grad=requires_grad)


def arange(heap, iris_device, start, end, step, *, out=None, dtype=None, layout=torch.strided, device=None,
           requires_grad=False):
    return _made(heap, iris_device, device, "arange", start, end, step, out=out, dtype=dtype, layout=layout,
                 requires_grad=requires_grad)


def linspace(heap, iris_device, start, end, steps, *, out=None, dtype=None, layout=torch.strided, device=None,
             requires_grad=False):
    return _made(heap, iris_device, device, "linspace", start, end, steps, out=out, dtype=dtype, layout=layout,
                 requires_grad=requires_grad)
