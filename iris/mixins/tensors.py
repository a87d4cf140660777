"""TensorMixin: torch's tensor constructors, returning plain tensors that live on the heap.

Each constructor first asks torch itself for the result's shape, dtype and strides by running the
same call on the ``meta`` device. So size forms, dtype inference, ``memory_format`` and argument
errors are exactly torch's. The values are then produced by torch's own ``out=`` variant or
in-place op on heap memory, so random constructors give the values torch gives for the same
generator state.

Beyond torch, the call forms and exception types of upstream iris's constructors:

- sizes nested in singletons are unwrapped: ``zeros(((2, 3),))`` is ``zeros((2, 3))``, and
  ``linspace``'s ``steps`` may be ``(5,)``, ``[5]`` or ``((5,),)``;
- ``uniform(size, low, high)``, the bounds positional (see :meth:`TensorMixin.uniform`);
- errors that torch raises as one type and upstream as another are of both types:
  :class:`InvalidArgumentError` (ValueError and RuntimeError) for a layout other than strided and
  for ``arange``'s step, :class:`ArgumentCountError` (ValueError and TypeError) for ``randint``
  without a size or with too many arguments, :class:`OutNotOnHeapError` (NotOnHeapError and
  RuntimeError) for an ``out=`` off the heap;
- an ``out=`` of another shape but as many elements, contiguous, receives the result through a
  view of the result's shape (which is returned); torch would resize ``out`` itself (a behaviour
  it deprecates), but heap tensors keep the shape they were allocated with.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Protocol

import torch

from iris.errors import IrisError, NotOnHeapError

__all__ = ["ArgumentCountError", "InvalidArgumentError", "OutNotOnHeapError", "TensorMixin"]

Fill = Callable[[torch.Tensor], Any]


class InvalidArgumentError(IrisError, ValueError, RuntimeError):
    """An argument a constructor refuses (a layout other than strided, ``arange``'s zero step or
    bounds that disagree with its sign): a RuntimeError as torch raises it, and a ValueError as
    upstream iris does."""


class ArgumentCountError(IrisError, ValueError, TypeError):
    """``randint`` without a size, or with more than low, high and size: a TypeError as torch
    raises it, and a ValueError as upstream iris does."""


class OutNotOnHeapError(NotOnHeapError, RuntimeError):
    """``out=`` is not on the context's symmetric heap (a RuntimeError, as upstream iris raises)."""


def _unnest_sizes(size: tuple) -> tuple:
    """Varargs sizes with singleton nesting removed: ``(((2, 3),),)`` becomes ``((2, 3),)``."""
    while (len(size) == 1 and isinstance(size[0], (list, tuple)) and len(size[0]) == 1
           and isinstance(size[0][0], (list, tuple))):
        size = (size[0][0],)
    return size


def _unnest_size(size: Any) -> Any:
    """One size argument with singleton nesting removed: ``((2, 3),)`` becomes ``(2, 3)``."""
    while isinstance(size, (list, tuple)) and len(size) == 1 and isinstance(size[0], (list, tuple)):
        size = size[0]
    return size


def _scalar_steps(steps: Any) -> Any:
    """``linspace``'s steps given as ``(5,)``, ``[5]`` or ``((5,),)``: the number inside."""
    while isinstance(steps, (list, tuple)) and len(steps) == 1:
        steps = steps[0]
    return steps


def _meta_bound(value: Any) -> Any:
    """A 0-d tensor bound of ``linspace`` as a number, for the meta call: torch infers the dtype
    from the value on real devices (complex bounds give a complex result) but not on ``meta``."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    return value


class TensorHost(Protocol):
    """What TensorMixin needs from the context it is part of (checked when a context is made)."""

    heap: Any
    device: torch.device
    rank: int


class TensorMixin:
    """Adds ``empty, zeros, ones, full, empty_like, zeros_like, ones_like, full_like, arange,
    linspace, rand, randn, randint, uniform`` and ``as_symmetric``.
    """

    needs = TensorHost

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
            raise InvalidArgumentError(
                f"iris tensors on the symmetric heap are strided, got layout={layout}; omit layout= "
                f"or pass torch.strided"
            )
        if pin_memory:
            raise RuntimeError(
                f"pin_memory=True does not apply to symmetric-heap tensors (context device {self.device})"
            )

    def _empty_strided(self, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialized heap tensor with exactly this shape, stride and dtype."""
        with self._call("allocate"):
            return self.heap.allocate_strided(tuple(shape), tuple(stride), dtype)

    def _target(self, meta_call: Callable[..., torch.Tensor], out: torch.Tensor | None,
                requires_grad: bool, dtype: torch.dtype | None) -> torch.Tensor:
        """Where the result goes: a new heap tensor shaped as torch would make it, or ``out``.

        For ``out=`` torch's own rules apply, by running the call on a meta twin of ``out``: the
        result takes ``out``'s dtype unless ``dtype=`` is given (then they must match), and
        ``memory_format=`` cannot be combined with it. Torch would resize an ``out`` of another
        shape; heap tensors are never resized, so an ``out`` with another number of elements is an
        error, and a contiguous one with as many elements receives the result through a view of
        the result's shape.
        """
        if out is None:
            meta = meta_call(requires_grad=requires_grad)
            return self._empty_strided(meta.shape, meta.stride(), meta.dtype)
        if not isinstance(out, torch.Tensor) or not self.is_symmetric(out):
            raise OutNotOnHeapError(
                f"The output tensor is not on the symmetric heap: out= must be a tensor on this context's "
                f"symmetric heap ({self.device}); got one on {getattr(out, 'device', type(out).__name__)} "
                f"that is not: allocate it with the context's constructors"
            )
        if isinstance(dtype, torch.dtype) and out.dtype != dtype:  # torch refuses this combination too
            raise RuntimeError(
                f"The output tensor has dtype {out.dtype}, but {dtype} is required: out= must have the "
                f"dtype= given, or omit dtype= to write in out's dtype"
            )
        twin = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="meta")
        with warnings.catch_warnings():
            # torch warns that it resizes out=; heap tensors are not resized (below)
            warnings.filterwarnings("ignore", message="An output with one or more elements was resized")
            meta = meta_call(requires_grad=requires_grad, out=twin)
        if meta.shape == out.shape:
            return out
        if meta.numel() != out.numel():
            raise RuntimeError(
                f"The output tensor has {out.numel()} elements, but {meta.numel()} are required: out= has "
                f"shape {tuple(out.shape)} and the result has shape {tuple(meta.shape)}; heap tensors are "
                f"never resized, so pass an out= with as many elements as the result"
            )
        if not out.is_contiguous():
            raise RuntimeError(
                f"out= has shape {tuple(out.shape)} and is not contiguous, so it cannot take the result's "
                f"shape {tuple(meta.shape)} (heap tensors are never resized); pass an out= of the result's "
                f"shape, or a contiguous one"
            )
        return out.view(meta.shape)

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
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        self._check_placement(device, layout, pin_memory)
        target = self._target(meta_call, out, requires_grad, dtype)
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
        size = _unnest_sizes(size)
        return self._construct(
            lambda **kw: torch.empty(*size, dtype=dtype, device="meta", memory_format=memory_format, **kw),
            None, out=out, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
            dtype=dtype,
        )

    def zeros(self, *size: Any, out=None, dtype=None, layout=None, device=None, requires_grad=False,
              pin_memory=False) -> torch.Tensor:
        """As :func:`torch.zeros`, on the heap. Collective."""
        size = _unnest_sizes(size)
        return self._construct(
            lambda **kw: torch.zeros(*size, dtype=dtype, device="meta", **kw),
            lambda t: t.zero_(), out=out, device=device, layout=layout, requires_grad=requires_grad,
            pin_memory=pin_memory, dtype=dtype,
        )

    def ones(self, *size: Any, out=None, dtype=None, layout=None, device=None, requires_grad=False,
             pin_memory=False) -> torch.Tensor:
        """As :func:`torch.ones`, on the heap. Collective."""
        size = _unnest_sizes(size)
        return self._construct(
            lambda **kw: torch.ones(*size, dtype=dtype, device="meta", **kw),
            lambda t: t.fill_(1), out=out, device=device, layout=layout, requires_grad=requires_grad,
            pin_memory=pin_memory, dtype=dtype,
        )

    def full(self, size: Any, fill_value: Any, *, out=None, dtype=None, layout=None, device=None,
             requires_grad=False, pin_memory=False) -> torch.Tensor:
        """As :func:`torch.full` (dtype inferred from ``fill_value`` as torch does), on the heap."""
        size = _unnest_size(size)
        return self._construct(
            lambda **kw: torch.full(size, fill_value, dtype=dtype, device="meta", **kw),
            lambda t: torch.full(t.shape, fill_value, dtype=t.dtype, out=t),
            out=out, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
            dtype=dtype,
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
        """As :func:`torch.arange` (``arange(end)``, ``arange(start, end, step)``), on the heap.

        A zero step, or bounds that disagree with the step's sign, raise
        :class:`InvalidArgumentError` (torch's RuntimeError, upstream iris's ValueError)."""

        def meta_call(**kw: Any) -> torch.Tensor:
            try:
                return torch.arange(*args, dtype=dtype, device="meta", **kwargs, **kw)
            except RuntimeError as error:
                text = str(error)
                call = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
                if "step must be nonzero" in text:
                    raise InvalidArgumentError(f"arange({call}): step must be non-zero") from error
                if "inconsistent with step sign" in text:
                    raise InvalidArgumentError(
                        f"arange({call}): {text}: with a positive step end must not be below start, with a "
                        f"negative one not above it"
                    ) from error
                raise

        return self._construct(
            meta_call,
            lambda t: torch.arange(*args, dtype=t.dtype, out=t, **kwargs),
            out=out, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
            dtype=dtype,
        )

    def linspace(self, start: Any, end: Any, steps: Any, *, out=None, dtype=None, layout=None, device=None,
                 requires_grad=False, pin_memory=False) -> torch.Tensor:
        """As :func:`torch.linspace`, on the heap (``steps`` may also be ``(5,)`` or ``[5]``). Collective."""
        steps = _scalar_steps(steps)
        return self._construct(
            lambda **kw: torch.linspace(_meta_bound(start), _meta_bound(end), steps, dtype=dtype, device="meta",
                                        **kw),
            lambda t: torch.linspace(start, end, steps, dtype=t.dtype, out=t),
            out=out, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
            dtype=dtype,
        )

    # -- random -----------------------------------------------------------------------------

    def rand(self, *size: Any, generator=None, out=None, dtype=None, layout=None, device=None,
             requires_grad=False, pin_memory=False) -> torch.Tensor:
        """As :func:`torch.rand`: the same values for the same ``generator`` state, on the heap."""
        size = _unnest_sizes(size)
        return self._construct(
            lambda **kw: torch.rand(*size, dtype=dtype, device="meta", **kw),
            lambda t: torch.rand(t.shape, generator=generator, dtype=t.dtype, out=t),
            out=out, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
            dtype=dtype,
        )

    def randn(self, *size: Any, generator=None, out=None, dtype=None, layout=None, device=None,
              requires_grad=False, pin_memory=False) -> torch.Tensor:
        """As :func:`torch.randn`: the same values for the same ``generator`` state, on the heap."""
        size = _unnest_sizes(size)
        return self._construct(
            lambda **kw: torch.randn(*size, dtype=dtype, device="meta", **kw),
            lambda t: torch.randn(t.shape, generator=generator, dtype=t.dtype, out=t),
            out=out, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
            dtype=dtype,
        )

    def randint(self, *args: Any, generator=None, out=None, dtype=None, layout=None, device=None,
                requires_grad=False, pin_memory=False, **kwargs: Any) -> torch.Tensor:
        """As :func:`torch.randint` (``randint(high, size)``, ``randint(low, high, size)``), on the heap.

        Without a size, or with more than low, high and size, it raises
        :class:`ArgumentCountError` (torch's TypeError, upstream iris's ValueError)."""
        given = len(args) + sum(name in kwargs for name in ("low", "high", "size"))
        if given not in (2, 3) or (len(args) < 2 and "size" not in kwargs):
            raise ArgumentCountError(
                f"randint takes (high, size) or (low, high, size), got {len(args)} positional argument(s) "
                f"{args} and keywords {sorted(kwargs)}"
            )
        if "size" in kwargs:
            kwargs = {**kwargs, "size": _unnest_size(kwargs["size"])}
        else:
            args = (*args[:-1], _unnest_size(args[-1]))
        return self._construct(
            lambda **kw: torch.randint(*args, dtype=dtype, device="meta", **kwargs, **kw),
            lambda t: torch.randint(*args, generator=generator, dtype=t.dtype, out=t, **kwargs),
            out=out, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
            dtype=dtype,
        )

    def uniform(self, *args: Any, low: float | None = None, high: float | None = None, generator=None, out=None,
                dtype=None, layout=None, device=None, requires_grad=False, pin_memory=False) -> torch.Tensor:
        """Values drawn uniformly from ``[low, high)`` (default ``[0, 1)``), as
        ``torch.empty(size).uniform_(low, high)``, on the heap. Two call forms:

        - torch's: the size as varargs or one sequence, the bounds as keywords:
          ``uniform(4, 5, low=-1.0)``, ``uniform((4, 5), high=2.0)``;
        - upstream iris's: ``uniform(size, low, high)``, the bounds positional after the size:
          ``uniform((4, 5), -1.0, 1.0)``, ``uniform(1024, -1.0)``.

        The call is upstream's form when two or three positional arguments are no size in torch's
        convention: the first is a sequence (tuple, list or ``torch.Size``) and more follow, or the
        first is an int and a float follows (sizes are ints). Otherwise every positional is the
        size, as in torch: ``uniform(4, 5)`` is a 4 x 5 tensor, so upstream's form with int bounds
        needs the size as a sequence (``uniform((4,), 0, 5)``).
        """
        first = args[0] if args else None
        upstream_form = len(args) in (2, 3) and (
            isinstance(first, (list, tuple))
            or (isinstance(first, int) and not isinstance(first, bool) and any(isinstance(a, float) for a in args[1:]))
        )
        if upstream_form:
            size: tuple = (_unnest_size(first),)
            bounds = args[1:]
            for name, keyword in zip(("low", "high"), (low, high)[:len(bounds)]):
                if keyword is not None:
                    raise TypeError(f"uniform() got multiple values for argument {name!r}")
            low = bounds[0]
            if len(bounds) == 2:
                high = bounds[1]
        else:
            size = _unnest_sizes(args)
        low = 0.0 if low is None else low
        high = 1.0 if high is None else high
        return self._construct(
            lambda **kw: torch.empty(*size, dtype=dtype, device="meta", **kw),
            lambda t: t.uniform_(low, high, generator=generator),
            out=out, device=device, layout=layout, requires_grad=requires_grad, pin_memory=pin_memory,
            dtype=dtype,
        )

    # -- copies -----------------------------------------------------------------------------

    def as_symmetric(self, tensor: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
        """``tensor`` on the heap: by default a copy (same shape, dtype and strides where dense).

        With ``in_place=True``, ``tensor``'s own memory is mapped into every rank's heap where the
        heap's provider can map it (``shm`` on CPU ranks, moving the storage to shared memory as
        ``Tensor.share_memory_()`` does once every rank can map its tensor; ``cuda-vmm`` on GPUs,
        for memory from torch's expandable segments): the result and ``tensor`` then share writes,
        and peers reach the result as any heap tensor. Where any rank cannot map its tensor so,
        every rank copies instead, with a warning that says why. A tensor already on the heap comes
        back as it is.

        Collective: every rank passes a tensor of the same shape and dtype. ``ctx.free`` takes the
        result back (unmapping memory mapped in place; the original tensor stays as it is)."""
        return self._as_symmetric(tensor, in_place, warn_at=3)

    def _as_symmetric(self, tensor: torch.Tensor, in_place: bool, warn_at: int) -> torch.Tensor:
        """:meth:`as_symmetric`; a warning names the caller ``warn_at`` frames up."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"as_symmetric expects a torch.Tensor, got {type(tensor).__name__}")
        if in_place:
            if self.is_symmetric(tensor):
                return tensor
            with self._call("as_symmetric"):
                mapped = self.heap.map_in_place(tensor)
            if isinstance(mapped, torch.Tensor):
                return mapped.requires_grad_(tensor.requires_grad)
            warnings.warn(
                f"as_symmetric copies the tensor (shape {tuple(tensor.shape)}, {tensor.dtype}) onto the symmetric "
                f"heap instead of mapping its memory there, so writes to the original and to the copy are not seen "
                f"by the other ({mapped})", UserWarning, stacklevel=warn_at)
        copy = self.empty_like(tensor, device=self.device)
        with torch.no_grad():
            copy.copy_(tensor)
        return copy.requires_grad_(tensor.requires_grad)
