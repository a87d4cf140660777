"""Host side of the uneven all-to-all collectives (``ctx.ccl.all_to_all_single`` and
``ctx.ccl.all_to_all_vdev``): the checks of their rows and split sizes, the device copies of host
split sizes, and what of such a call is the same on every rank.

Both move rows along dim 0 (a row is the product of a tensor's other dimensions), in numbers
that differ between ranks; so only the rows' shape, not the tensors', is the same on every rank,
and that is what the automatic choice of an algorithm and the debug mode's comparison of calls
see (:func:`same_on_every_rank`).

Host split sizes reach the kernel as a small int64 tensor on the device, one per distinct pair
of split tuples, kept (:class:`SplitTensors`): an eager call of the same splits reuses it, and a
call captured in a CUDA graph copies nothing from the host (its splits must have been seen by an
eager call before).
"""

from __future__ import annotations

import operator

import torch

import iris.collectives.workspaces as workspaces
from iris.errors import IrisError

__all__ = ["MAX_SPLIT_TENSORS", "SplitTensors", "check_apart", "check_counts", "check_rows", "same_on_every_rank",
           "split_sizes"]

#: Most device copies of split sizes kept before they are dropped (unless a graph may use them).
MAX_SPLIT_TENSORS = 1024


def check_rows(collective: str, output: torch.Tensor, input: torch.Tensor) -> int:
    """The elements of one row (the product of the dims after dim 0), the same for ``input`` and
    ``output``, each with at least one dimension."""
    for what, tensor in (("input", input), ("output", output)):
        if tensor.dim() == 0:
            raise IrisError(f"{collective}: {what} is a 0-dimensional tensor; it moves rows along dim 0, so pass "
                            f"at least one dimension (e.g. tensor.reshape(1))")
    row = input.shape[1:].numel()
    if output.shape[1:].numel() != row:
        raise IrisError(f"{collective}: a row of input (shape {tuple(input.shape)}) has {row} elements and a row of "
                        f"output (shape {tuple(output.shape)}) {output.shape[1:].numel()}; the dims after dim 0 must "
                        f"hold the same number of elements")
    return row


def split_sizes(collective: str, name: str, sizes, tensor: torch.Tensor, world: int) -> tuple[int, ...]:
    """``sizes`` (rows of ``tensor`` for each rank, in rank order; None: equal splits) as a
    tuple of ints, checked: ``world`` non-negative entries adding up to ``tensor``'s rows."""
    rows = tensor.shape[0]
    if sizes is None:
        if rows % world:
            raise IrisError(f"{collective}: {name}=None splits dim 0 equally, but it has {rows} rows, not divisible "
                            f"by the world size {world}; pass {name} or pad dim 0 to a multiple of {world}")
        return (rows // world,) * world
    if isinstance(sizes, torch.Tensor):
        sizes = sizes.tolist()
    try:
        counts = tuple(operator.index(size) for size in sizes)
    except TypeError as error:
        raise IrisError(f"{collective}: {name} must be a list of ints (rows along dim 0 for each rank), got "
                        f"{sizes!r}") from error
    if len(counts) != world:
        raise IrisError(f"{collective}: {name} has {len(counts)} entries; it needs one per rank ({world})")
    if min(counts) < 0:
        raise IrisError(f"{collective}: {name}={list(counts)} has a negative entry; split sizes are numbers of rows")
    if sum(counts) != rows:
        what = "input" if name.startswith("input") else "output"
        raise IrisError(f"{collective}: {name}={list(counts)} adds up to {sum(counts)} rows, but {what} has {rows} "
                        f"(dim 0 of shape {tuple(tensor.shape)}); they must match")
    return counts


def check_counts(collective: str, name: str, counts, device: torch.device, world: int) -> None:
    """``counts`` is an int64 tensor of ``world`` entries on ``device``, contiguous."""
    if not isinstance(counts, torch.Tensor):
        raise TypeError(f"{collective}: {name} must be a torch.Tensor (int64, [world_size], on the device), got "
                        f"{type(counts).__name__}")
    if counts.dtype != torch.int64:
        raise IrisError(f"{collective}: {name} has dtype {counts.dtype}; it must be torch.int64 (pass "
                        f"{name}.to(torch.int64))")
    if counts.device != device:
        raise IrisError(f"{collective}: {name} is on {counts.device}, but this context runs on {device}; move it with "
                        f".to({str(device)!r})")
    if tuple(counts.shape) != (world,):
        raise IrisError(f"{collective}: {name} has shape {tuple(counts.shape)}; it needs one entry per rank: "
                        f"({world},)")
    if not counts.is_contiguous():
        raise IrisError(f"{collective}: {name} is not contiguous; pass {name}.contiguous()")


def check_apart(collective: str, written: dict, read: dict) -> None:
    """No tensor of ``written`` (name: tensor) shares memory with another of ``written`` or
    ``read``: the kernel's programs write them while others may still read."""
    every = {**read, **written}
    for name, tensor in written.items():
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        for other, t in every.items():
            other_start = t.data_ptr()
            if other != name and start < other_start + t.numel() * t.element_size() and other_start < end:
                raise IrisError(f"{collective}: {name} and {other} overlap in memory; pass separate tensors")


def same_on_every_rank(collective: str, output: torch.Tensor, input: torch.Tensor) -> tuple:
    """Tensors of the shapes every rank's call has alike, for the automatic choice and the debug
    mode's comparison: no rows of either (their numbers differ), but ``all_to_all_vdev``'s whole
    output (its bound is the same on every rank)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in (output, input)):
        return output, input  # the call's checks say what is wrong with them
    return (output if collective == "all_to_all_vdev" else output[:0]), input[:0]


class SplitTensors:
    """The device copies of host split sizes, by their tuples: an int64 tensor ``[2, world]``
    (input sizes, output sizes) per distinct pair."""

    def __init__(self, context):
        self._context = context
        self._kept: dict[tuple, torch.Tensor] = {}

    def get(self, collective: str, input_sizes: tuple, output_sizes: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The device copies of ``input_sizes`` and ``output_sizes``, made the first time (an
        IrisError during a CUDA graph capture, which cannot copy from the host)."""
        key = (input_sizes, output_sizes)
        both = self._kept.get(key)
        if both is None:
            ctx = self._context
            if workspaces.capturing(ctx.device.type):
                raise IrisError(f"{collective}: input_split_sizes={list(input_sizes)} with "
                                f"output_split_sizes={list(output_sizes)} were not used by an eager call before this "
                                f"CUDA graph capture, and a capture cannot copy them to the device; make an eager call "
                                f"with these split sizes before capturing")
            if len(self._kept) >= MAX_SPLIT_TENSORS and not ctx.workspaces.graph_captured:
                self._kept.clear()  # none is in a graph: nothing launches with them again
            both = self._kept[key] = torch.tensor([input_sizes, output_sizes], dtype=torch.int64, device=ctx.device)
        return both[0], both[1]
