"""TensorMixin: torch's tensor constructors, returning plain tensors that live on the heap.

Each constructor first asks torch itself for the result's shape, dtype and strides by running the
same call on the ``meta`` device. So size forms, dtype inference, ``memory_format`` and argument
errors are exactly torch's. The values are then produced by torch's own ``out=`` variant or
in-place op on heap memory, so random constructors give the values torch gives for the same
generator state.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from iris.errors import NotOnHeapError

__all__ = ["TensorMixin"]

Fill = Callable[[torch.Tensor], Any]


class TensorMixin:
    """Adds ``empty, zeros, ones, full, empty_like, zeros_like, ones_like, full_like, arange,
    linspace, rand, randn, randint, uniform`` and ``as_symmetric``.

    Requires ``heap`` (HeapMixin), ``device`` and ``rank``.
    """

    # -- shared machinery -------------------------------------------------------------------

    def _check_placement(self, device: Any, layout: Any, pin_memory: bool) -> None:
        if device is not None:
            wanted = torch.device(device)
            if wanted.type != self.device.type or (
                wanted.index is not None and wanted.index != self.device.index
            ):
                raise RuntimeError(
                    f"iris tensors live on the context's device {self.device}, got device={device!r}; "
                    f"omit device= or pass {str(self.device)!r}"
                )
        if layout is not None and layout != torch.strided:
            raise RuntimeError(
                f"iris tensors on the symmetric heap are strided, got layout={layout}; omit layout= "
                f"or pass torch.strided"
            )
        if pin_memory:
            raise RuntimeError(
                f"pin_memory=True does not apply to symmetric-heap tensors (context device {self.device})"
            )

    def _empty_strided(self, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialized heap tensor with exactly this shape, stride and dtype."""
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        span = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
        nbytes = span * itemsize
        with self._call("allocate"):
            offset = self.heap.allocate(nbytes, detail=f"{tuple(shape)} {dtype}")
        self.heap.allocated_as[offset] = (tuple(shape), tuple(stride), dtype)
        return self.heap.view(offset, nbytes).view(dtype).as_strided(shape, stride)

    def _target(self, meta_call: Callable[..., torch.Tensor], out: torch.Tensor | None,
                requires_grad: bool) -> torch.Tensor:
        """Where the result goes: a new heap tensor shaped as torch would make it, or ``out``.

        For ``out=`` torch's own rules apply, by running the call on a meta twin of ``out``: the
        result takes ``out``'s dtype unless ``dtype=`` is given (then they must match), and
        ``memory_format=`` cannot be combined with it. Torch would resize an ``out`` of another
        shape; heap tensors are never resized, so that is an error instead.
        """
        if out is None:
            meta = meta_call(requires_grad=requires_grad)
            return self._empty_strided(meta.shape, meta.stride(), meta.dtype)
        if not isinstance(out, torch.Tensor) or not self.is_symmetric(out):
            raise NotOnHeapError(
                f"out= must be a tensor on this context's symmetric heap ({self.device}); got one on "
                f"{getattr(out, 'device', type(out).__name__)} that is not: allocate it with the "
                f"context's constructors"
            )
        twin = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="meta")
        with warnings.catch_warnings():
            # torch warns that it resizes out=; the mismatch is raised below instead
            warnings.filterwarnings("ignore", message="An output with one or more elements was resized")
            meta = meta_call(requires_grad=requires_grad, out=twin)
        if meta.shape != out.shape:
            raise RuntimeError(
                f"out= has shape {tuple(out.shape)}, but the result has shape {tuple(meta.shape)}; heap "
                f"tensors are never resized, so pass an out= of the result's shape"
            )
        return out

    def _construct(
        self,
        meta_call: Callable[..., torch.Tensor],
        fill: Fill | None,
        *,
        out: torch.Tensor | None,
        device: Any,
        layout: Any,
        requires_grad: bool,
        pin_memory: bool = False,
    ) -> torch.Tensor:
        self._check_placement(device, layout, pin_memory)
        target = self._target(meta_call, out, requires_grad)
        if fill is not None:
            try:
                with torch.no_grad():
                    fill(target)
            except BaseException:
                if out is None:  # every rank fails alike, so the free stays symmetric
                    self.free(target)
                raise
        return target.requires_grad_(True) if requires_grad else target

    # -- from a size ------------------------------------------------------------------------

    def empty(self, *size: Any, out=None, dtype=None, layout=None, device=None, requires_grad=False,
              pin_memory=False, memory_format=None) -> torch.Tensor:
        """As :func:`torch.empty`, on the heap. Collective: every rank allocates alike."""
        return self._construct(
            lambda **kw: torch.empty(*size, dtype=dtype, device="meta", memory_format=memory_format, **kw),
            None, out=out, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
        )

    def zeros(self, *size: Any, out=None, dtype=None, layout=None, device=None, requires_grad=False,
              pin_memory=False) -> torch.Tensor:
        """As :func:`torch.zeros`, on the heap. Collective."""
        return self._construct(
            lambda **kw: torch.zeros(*size, dtype=dtype, device="meta", **kw),
            lambda t: t.zero_(), out=out, device=device, layout=layout, requires_grad=requires_grad,
            pin_memory=pin_memory,
        )

    def ones(self, *size: Any, out=None, dtype=None, layout=None, device=None, requires_grad=False,
             pin_memory=False) -> torch.Tensor:
        """As :func:`torch.ones`, on the heap. Collective."""
        return self._construct(
            lambda **kw: torch.ones(*size, dtype=dtype, device="meta", **kw),
            lambda t: t.fill_(1), out=out, device=device, layout=layout, requires_grad=requires_grad,
            pin_memory=pin_memory,
        )

    def full(self, size: Any, fill_value: Any, *, out=None, dtype=None, layout=None, device=None,
             requires_grad=False, pin_memory=False) -> torch.Tensor:
        """As :func:`torch.full` (dtype inferred from ``fill_value`` as torch does), on the heap."""
        return self._construct(
            lambda **kw: torch.full(size, fill_value, dtype=dtype, device="meta", **kw),
            lambda t: torch.full(size, fill_value, dtype=t.dtype, out=t),
            out=out, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
        )

    # -- like another tensor ----------------------------------------------------------------

    def _like(self, input: torch.Tensor, fill: Fill | None, *, dtype, layout, device, requires_grad,
              pin_memory, memory_format) -> torch.Tensor:
        return self._construct(
            lambda **kw: torch.empty_like(input, dtype=dtype, device="meta", memory_format=memory_format, **kw),
            fill, out=None, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
        )

    def empty_like(self, input: torch.Tensor, *, dtype=None, layout=None, device=None, requires_grad=False,
                   pin_memory=False, memory_format=torch.preserve_format) -> torch.Tensor:
        """As :func:`torch.empty_like`, on the heap. Collective."""
        return self._like(input, None, dtype=dtype, layout=layout, device=device,
                          requires_grad=requires_grad, pin_memory=pin_memory, memory_format=memory_format)

    def zeros_like(self, input: torch.Tensor, *, dtype=None, layout=None, device=None, requires_grad=False,
                   pin_memory=False, memory_format=torch.preserve_format) -> torch.Tensor:
        """As :func:`torch.zeros_like`, on the heap. Collective."""
        return self._like(input, lambda t: t.zero_(), dtype=dtype, layout=layout, device=device,
                          requires_grad=requires_grad, pin_memory=pin_memory, memory_format=memory_format)

    def ones_like(self, input: torch.Tensor, *, dtype=None, layout=None, device=None, requires_grad=False,
                  pin_memory=False, memory_format=torch.preserve_format) -> torch.Tensor:
        """As :func:`torch.ones_like`, on the heap. Collective."""
        return self._like(input, lambda t: t.fill_(1), dtype=dtype, layout=layout, device=device,
                          requires_grad=requires_grad, pin_memory=pin_memory, memory_format=memory_format)

    def full_like(self, input: torch.Tensor, fill_value: Any, *, dtype=None, layout=None, device=None,
                  requires_grad=False, pin_memory=False, memory_format=torch.preserve_format) -> torch.Tensor:
        """As :func:`torch.full_like`, on the heap. Collective."""
        return self._like(input, lambda t: t.fill_(fill_value), dtype=dtype, layout=layout, device=device,
                          requires_grad=requires_grad, pin_memory=pin_memory, memory_format=memory_format)

    # -- ranges -----------------------------------------------------------------------------

    def arange(self, *args: Any, out=None, dtype=None, layout=None, device=None, requires_grad=False,
               pin_memory=False, **kwargs: Any) -> torch.Tensor:
        """As :func:`torch.arange` (``arange(end)``, ``arange(start, end, step)``), on the heap."""
        return self._construct(
            lambda **kw: torch.arange(*args, dtype=dtype, device="meta", **kwargs, **kw),
            lambda t: torch.arange(*args, dtype=t.dtype, out=t, **kwargs),
            out=out, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
        )

    def linspace(self, start: Any, end: Any, steps: int, *, out=None, dtype=None, layout=None, device=None,
                 requires_grad=False, pin_memory=False) -> torch.Tensor:
        """As :func:`torch.linspace`, on the heap. Collective."""
        return self._construct(
            lambda **kw: torch.linspace(start, end, steps, dtype=dtype, device="meta", **kw),
            lambda t: torch.linspace(start, end, steps, dtype=t.dtype, out=t),
            out=out, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
        )

    # -- random -----------------------------------------------------------------------------

    def rand(self, *size: Any, generator=None, out=None, dtype=None, layout=None, device=None,
             requires_grad=False, pin_memory=False) -> torch.Tensor:
        """As :func:`torch.rand`: the same values for the same ``generator`` state, on the heap."""
        return self._construct(
            lambda **kw: torch.rand(*size, dtype=dtype, device="meta", **kw),
            lambda t: torch.rand(*size, generator=generator, dtype=t.dtype, out=t),
            out=out, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
        )

    def randn(self, *size: Any, generator=None, out=None, dtype=None, layout=None, device=None,
              requires_grad=False, pin_memory=False) -> torch.Tensor:
        """As :func:`torch.randn`: the same values for the same ``generator`` state, on the heap."""
        return self._construct(
            lambda **kw: torch.randn(*size, dtype=dtype, device="meta", **kw),
            lambda t: torch.randn(*size, generator=generator, dtype=t.dtype, out=t),
            out=out, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
        )

    def randint(self, *args: Any, generator=None, out=None, dtype=None, layout=None, device=None,
                requires_grad=False, pin_memory=False, **kwargs: Any) -> torch.Tensor:
        """As :func:`torch.randint` (``randint(high, size)``, ``randint(low, high, size)``), on the heap."""
        return self._construct(
            lambda **kw: torch.randint(*args, dtype=dtype, device="meta", **kwargs, **kw),
            lambda t: torch.randint(*args, generator=generator, dtype=t.dtype, out=t, **kwargs),
            out=out, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
        )

    def uniform(self, *size: Any, low: float = 0.0, high: float = 1.0, generator=None, out=None, dtype=None,
                layout=None, device=None, requires_grad=False, pin_memory=False) -> torch.Tensor:
        """Values drawn uniformly from ``[low, high)``, as ``torch.empty(size).uniform_(low, high)``."""
        return self._construct(
            lambda **kw: torch.empty(*size, dtype=dtype, device="meta", **kw),
            lambda t: t.uniform_(low, high, generator=generator),
            out=out, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
        )

    # -- copies -----------------------------------------------------------------------------

    def as_symmetric(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` on the heap (same shape, dtype and strides where dense).
        Collective: every rank passes a tensor of the same shape and dtype."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"as_symmetric expects a torch.Tensor, got {type(tensor).__name__}")
        copy = self.empty_like(tensor, device=self.device)
        with torch.no_grad():
            copy.copy_(tensor)
        return copy.requires_grad_(tensor.requires_grad)
