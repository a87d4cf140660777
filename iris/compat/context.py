"""Contexts with upstream iris's conventions: what ``iris.iris(...)`` returns.

:class:`Iris` is put in front of a backend's context class (:func:`upstream_class`). It changes
only what upstream iris spells or behaves differently, and always by the kind of context, never
by guessing from a call's arguments:

- ``ctx.device`` is a string (``"cuda:0"``, ``"cpu"``), as upstream code expects
  (``ctx.device.startswith("cuda")``), that also compares equal to the ``torch.device`` it names;
- ``broadcast(value, source_rank=0)`` returns NumPy arrays for tensors and arrays, and the value
  itself for other objects; the other ranks may pass None;
- ``barrier(stream=None, group=None)``;
- tensor constructors synchronise the ranks, as upstream's allocations do (a kernel launched
  right after may access the peers' new tensors), take no size for a 0-d tensor, and ignore
  ``pin_memory`` and a memory format that does not fit the size;
- ``ctx.ccl`` and ``ctx.ops`` take upstream's ``(output, input, ...)`` signatures and shapes
  (:mod:`iris.compat.collectives`, :mod:`iris.compat.fused_ops`), on the same kernels.

Everything else is the context of :func:`iris.create`.
"""

from __future__ import annotations

import functools
from numbers import Number
from typing import Any

import numpy as np
import torch

from iris.compat.tensor_creation import is_valid_device

__all__ = ["DeviceName", "Iris", "upstream_class"]


class DeviceName(str):
    """A device as upstream iris names it: the string ``"cuda:0"`` (or ``"cpu"``), with the
    ``type`` and ``index`` of the ``torch.device`` it names, and equal to that device."""

    def __new__(cls, device) -> "DeviceName":
        self = super().__new__(cls, str(torch.device(device)))
        self.torch_device = torch.device(device)
        return self

    @property
    def type(self) -> str:
        return self.torch_device.type

    @property
    def index(self) -> int | None:
        return self.torch_device.index

    def __eq__(self, other) -> bool:
        if isinstance(other, torch.device):
            return self.torch_device == other
        return str.__eq__(self, other)

    def __ne__(self, other) -> bool:
        return not self == other

    __hash__ = str.__hash__

    def __reduce__(self):
        return DeviceName, (str(self),)


def _tensor_like(value) -> bool:
    """What upstream's broadcast sends as an array: tensors, arrays, NumPy numbers and sequences
    of numbers (not bools, strings or mappings)."""
    if isinstance(value, (torch.Tensor, np.ndarray, np.number)):
        return True
    if isinstance(value, (list, tuple)) and value:
        return all(isinstance(v, Number) and not isinstance(v, bool) for v in value)
    return False


#: The tensor rank each channels-last memory format needs.
_FORMAT_RANKS = {torch.channels_last: 4, torch.channels_last_3d: 5}


class Iris:
    """Upstream iris's conventions for a context (see the module's docstring). Requires a context
    class behind it (:func:`upstream_class`); holds no state of its own but the device's name."""

    @property
    def device(self) -> DeviceName:
        return self._device_name

    @device.setter
    def device(self, device) -> None:
        self._device_name = DeviceName(device)

    def get_device(self) -> torch.device:
        return self._device_name.torch_device

    @property
    def gpu_id(self) -> int | None:
        """The index of this rank's GPU (None on CPU ranks)."""
        return self._device_name.index

    def broadcast(self, value: Any, source_rank: int = 0, *, src_rank: int | None = None) -> Any:
        """Rank ``source_rank``'s ``value`` on every rank (the others pass anything, None
        typically): tensors, arrays and sequences of numbers as a NumPy array, other values as
        they are. ``src_rank`` is the Gluon context's spelling of ``source_rank``. Collective."""
        source = source_rank if src_rank is None else src_rank
        if not isinstance(source, int) or not 0 <= source < self.world_size:
            raise ValueError(f"broadcast: source_rank={source!r} is not a rank of this world "
                             f"(0..{self.world_size - 1})")
        if self.rank == source:
            if value is None:
                payload = ("missing", None)
            elif _tensor_like(value):
                array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
                payload = ("array", array)
            else:
                payload = ("object", value)
        else:
            payload = None
        kind, result = self.comm.broadcast_object(payload, source)
        if kind == "missing":
            raise ValueError(f"broadcast: rank {source} (source_rank) passed None; the source must provide a value")
        return result

    def barrier(self, stream=None, group=None) -> None:
        """Wait for ``stream`` (default: all of this rank's device work), then for every rank of
        ``group`` (default: all of them, with the heap's symmetry check). Collective."""
        if stream is not None:
            stream.synchronize()
        if group is None or sorted(torch.distributed.get_process_group_ranks(group)) == list(range(self.world_size)):
            super().barrier()
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with self._call("barrier"):
            torch.distributed.barrier(group=group)

    # -- tensor constructors: upstream's synchronising allocations and size forms ----------------

    def _construct(self, meta_call, fill, *, pin_memory: bool = False, **options) -> torch.Tensor:
        """Upstream's allocations synchronise the ranks: when a constructor returns on one rank,
        the tensor is allocated and filled on every rank, so a kernel launched next may access the
        peers' twins at once. ``pin_memory`` is accepted and ignored (heap memory is the device's)."""
        tensor = super()._construct(meta_call, fill, **options)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with self._call("allocate"):
            self.comm.barrier()
        return tensor

    def empty(self, *size, memory_format=None, **options) -> torch.Tensor:
        """``memory_format`` applies where the size has its rank (4 for ``channels_last``, 5 for
        ``channels_last_3d``) and is ignored elsewhere, as upstream's; no size is a 0-d tensor."""
        size = size or ((),)
        rank = len(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else len(size)
        if _FORMAT_RANKS.get(memory_format, rank) != rank:
            memory_format = None
        return super().empty(*size, memory_format=memory_format, **options)

    def zeros(self, *size, **options) -> torch.Tensor:
        return super().zeros(*(size or ((),)), **options)

    def ones(self, *size, **options) -> torch.Tensor:
        return super().ones(*(size or ((),)), **options)

    def rand(self, *size, **options) -> torch.Tensor:
        return super().rand(*(size or ((),)), **options)

    def randn(self, *size, **options) -> torch.Tensor:
        return super().randn(*(size or ((),)), **options)

    def _ccl_namespace(self):
        from iris.compat.collectives import UpstreamCollectives

        return UpstreamCollectives(self)

    def _ops_namespace(self, ops):
        from iris.compat.fused_ops import UpstreamOps

        return UpstreamOps(self, ops)

    def as_symmetric(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the heap, its own memory mapped in place as upstream maps it
        (:meth:`iris.mixins.tensors.TensorsMixin.as_symmetric` with ``in_place=True``: where the
        memory cannot be mapped, a copy with a warning that says why). A tensor on another kind of
        device than the heap's is refused, as upstream refuses one that is not on its GPU."""
        if isinstance(tensor, torch.Tensor) and tensor.device.type != self.device.type:
            kind = "a CUDA device" if self.device.type == "cuda" else f"the {self.device.type} device"
            raise RuntimeError(f"as_symmetric takes a tensor on the heap's device ({self.device}: {kind}), got one on "
                               f"{tensor.device}; move it there first (tensor.to(ctx.get_device()))")
        return self._as_symmetric(tensor, in_place=True, warn_at=3)

    # Upstream's private helpers that its tests call (``ctx._Iris__allocate(...)``).
    def __allocate(self, num_elements: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.empty(num_elements, dtype=dtype)

    def __is_valid_device(self, device) -> bool:
        return is_valid_device(device, self.get_device())

    def __on_symmetric_heap(self, tensor: torch.Tensor) -> bool:
        return self.is_symmetric(tensor)


@functools.cache
def upstream_class(context_class: type) -> type:
    """``context_class`` with upstream iris's conventions in front of it (cached): ``TritonContext``
    becomes ``TritonIris``."""
    name = context_class.__name__.removesuffix("Context") + "Iris"
    return type(name, (Iris, context_class), {"__module__": context_class.__module__,
                                              "__doc__": f"{context_class.__name__} with upstream iris's conventions."})
