"""``ctx.ccl`` of contexts made with upstream iris's spelling (``iris.iris(...)``): upstream's
signatures and shapes, run by iris's own collectives.

Upstream takes ``(output, input)``, a :class:`iris.ccl.Config`, ``group``, ``async_op`` and, for
all_reduce, a ``workspace``; without ``async_op=True`` a call ends with a host barrier, as
upstream's does. Where upstream's shapes differ from torch.distributed's, the call is rearranged
around the same kernels: ``all_to_all`` of ``(M, N * world)`` matrices exchanges column blocks,
and ``reduce_scatter`` keeps the full ``(M, N)`` output, summed on the tiles this rank owns
(:mod:`iris.compat.tiles`).
"""

from __future__ import annotations

import attrs
import torch

from iris.compat.ccl import Config, ReduceOp
from iris.compat.tiles import reduce_scatter_owned, reduce_scatter_tiles, tile_elements

__all__ = ["AllReduceWorkspace", "UpstreamCollectives", "check_matrix"]

#: Upstream's all_reduce variants that name an algorithm of iris; the others run the automatic choice.
_ALGORITHM_OF_VARIANT = {"one_shot": "one_shot", "two_shot": "two_shot"}
_REDUCTIONS = {ReduceOp.SUM: "sum", ReduceOp.MIN: "min", ReduceOp.MAX: "max"}


@attrs.define
class AllReduceWorkspace:
    """What ``all_reduce_preamble`` prepares and ``all_reduce`` returns, as upstream's: the call it
    was prepared for. iris's collectives keep their buffers in the context's workspaces, so this
    holds no memory; a workspace prepared for another shape is prepared again."""

    variant: str = ""
    shape: tuple = ()
    dtype: torch.dtype | None = None
    prepared: bool = False


def _reduction(name: str, op) -> str:
    op = ReduceOp.SUM if op is None else op
    try:
        return _REDUCTIONS[ReduceOp(op)]
    except (ValueError, KeyError):
        raise ValueError(f"{name}: op={op!r} is not supported; use ReduceOp.SUM, ReduceOp.MIN or ReduceOp.MAX "
                         f"(from iris.ccl)") from None


def check_matrix(name: str, what: str, tensor) -> None:
    """Raise unless ``tensor`` is a 2-D torch tensor (upstream's collectives and operations take matrices)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 2:
        raise ValueError(f"{name}: {what} must be a matrix (2-D), got shape {tuple(tensor.shape)}")


class UpstreamCollectives:
    """Upstream iris's ``ctx.ccl``. Every method is a collective operation."""

    def __init__(self, context):
        self._context = context

    # -- shared ---------------------------------------------------------------------------------

    def _config(self, name: str, config: Config | None, gluon: bool = True) -> Config:
        """``config`` checked (default ``Config()``); ``gluon=False``: the collective refuses
        ``use_gluon=True``, as upstream's does."""
        if config is None:
            return Config()
        if not isinstance(config, Config):
            raise TypeError(f"{name}: config must be an iris.ccl.Config, got {type(config).__name__}")
        if config.use_gluon and not gluon:
            raise ValueError(f"{name}: config.use_gluon=True is not supported by {name} (upstream's rule); the "
                             f"kernels are compiled in the context's language either way")
        if config.use_gluon and self._context.kernel_language != "gluon":
            raise ValueError(f"{name}: config.use_gluon=True needs a Gluon context; create it with "
                             f"iris.experimental.iris_gluon.iris(...) or iris_gluon.iris(...)")
        return config

    def _check_group(self, name: str, group) -> None:
        if group is None:
            return
        ranks = torch.distributed.get_process_group_ranks(group)
        if sorted(ranks) != list(range(self._context.world_size)):
            raise ValueError(f"{name}: group= names ranks {ranks}, a part of this context's world of "
                             f"{self._context.world_size}; collectives over a part of the ranks are not supported: "
                             f"pass group=None or create a context over those ranks")

    def _finish(self, async_op: bool) -> None:
        """Upstream's completion rule: a host barrier unless ``async_op``."""
        if not async_op:
            self._context.barrier()

    # -- the collectives ------------------------------------------------------------------------

    def all_reduce_preamble(self, output_tensor, input_tensor, config: Config | None = None,
                            workspace: AllReduceWorkspace | None = None) -> AllReduceWorkspace:
        """The workspace of an all_reduce of these tensors (checked here)."""
        config = self._config("all_reduce_preamble", config)
        check_matrix("all_reduce", "output_tensor", output_tensor)
        if tuple(output_tensor.shape) != tuple(input_tensor.shape):
            raise ValueError(f"all_reduce: output_tensor has shape {tuple(output_tensor.shape)}, input_tensor "
                             f"{tuple(input_tensor.shape)}; they must match")
        workspace = AllReduceWorkspace() if workspace is None else workspace
        workspace.variant = config.all_reduce_variant.lower()
        workspace.shape = tuple(input_tensor.shape)
        workspace.dtype = input_tensor.dtype
        workspace.prepared = True
        return workspace

    def all_reduce(self, output_tensor, input_tensor, op=None, group=None, async_op: bool = False,
                   config: Config | None = None, workspace: AllReduceWorkspace | None = None) -> AllReduceWorkspace:
        """``output_tensor`` := the sum (or min, max) over ranks of ``input_tensor``, both ``(M, N)``."""
        reduction = _reduction("all_reduce", op)
        self._check_group("all_reduce", group)
        config = self._config("all_reduce", config, gluon=False)
        workspace = self.all_reduce_preamble(output_tensor, input_tensor, config, workspace)
        if output_tensor.data_ptr() != input_tensor.data_ptr():
            output_tensor.copy_(input_tensor)
        collectives = self._context._torch_ccl
        algorithm = _ALGORITHM_OF_VARIANT.get(workspace.variant)
        if algorithm not in collectives.algorithms("all_reduce", applying_to=output_tensor):
            algorithm = None  # the automatic choice: same result
        collectives.all_reduce(output_tensor, reduction, algorithm=algorithm)
        workspace.prepared = False
        self._finish(async_op)
        return workspace

    def all_gather(self, output_tensor, input_tensor, group=None, async_op: bool = False,
                   config: Config | None = None) -> None:
        """``output_tensor`` ``(world * M, N)`` := every rank's ``input_tensor`` ``(M, N)``, in rank order."""
        self._check_group("all_gather", group)
        config = self._config("all_gather", config)
        check_matrix("all_gather", "input_tensor", input_tensor)
        M, N = input_tensor.shape
        world = self._context.world_size
        if tuple(output_tensor.shape[:2]) != (world * M, N):
            raise ValueError(f"all_gather: output_tensor has shape {tuple(output_tensor.shape)}; expected "
                             f"(world_size * M, N) = ({world * M}, {N})")
        if config.all_gather_variant == "partitioned" and config.comm_sms % world:
            raise ValueError(f"all_gather: the partitioned variant needs comm_sms ({config.comm_sms}) divisible by "
                             f"the world size {world}")
        self._context._torch_ccl.all_gather(output_tensor, input_tensor.contiguous())
        self._finish(async_op)

    def all_to_all(self, output_tensor, input_tensor, group=None, async_op: bool = False,
                   config: Config | None = None) -> None:
        """``(M, N * world)`` matrices: column block ``r`` of this rank's ``output_tensor`` := column
        block ``rank`` of rank ``r``'s ``input_tensor``."""
        self._check_group("all_to_all", group)
        self._config("all_to_all", config)
        check_matrix("all_to_all", "input_tensor", input_tensor)
        world = self._context.world_size
        M, columns = input_tensor.shape
        if columns % world:
            raise ValueError(f"all_to_all: input_tensor has {columns} columns, not divisible by the world size "
                             f"{world}")
        if tuple(output_tensor.shape) != (M, columns):
            raise ValueError(f"all_to_all: output_tensor has shape {tuple(output_tensor.shape)}; expected "
                             f"{(M, columns)}")
        N = columns // world
        # Column block j of every row, contiguous, is the segment for rank j.
        segments = input_tensor.reshape(M, world, N).transpose(0, 1).contiguous()
        received = torch.empty_like(segments)
        self._context._torch_ccl.all_to_all(received, segments)
        output_tensor.copy_(received.transpose(0, 1).reshape(M, columns))
        self._finish(async_op)

    def reduce_scatter(self, output_tensor, input_tensor, op=None, group=None, async_op: bool = False,
                       config: Config | None = None) -> None:
        """``output_tensor`` ``(M, N)``, on the tiles this rank owns (``config``'s blocks, swizzle and
        ``all_reduce_distribution``), := the sum over ranks of ``input_tensor`` there; its other
        tiles are left as they were."""
        reduction = _reduction("reduce_scatter", op)
        self._check_group("reduce_scatter", group)
        config = self._config("reduce_scatter", config, gluon=False)
        check_matrix("reduce_scatter", "input_tensor", input_tensor)
        if tuple(output_tensor.shape[:2]) != tuple(input_tensor.shape[:2]):
            raise ValueError(f"reduce_scatter: output_tensor has shape {tuple(output_tensor.shape)}; for "
                             f"reduce-scatter, output should have the same shape as input "
                             f"{tuple(input_tensor.shape)}")
        M, N = input_tensor.shape
        ctx = self._context
        tiles = reduce_scatter_tiles(M, N, config.block_size_m, config.block_size_n, config.swizzle_size,
                                     config.all_reduce_distribution, ctx.world_size)
        owned = [tile_elements(M, N, config.block_size_m, config.block_size_n, t, ctx.device) for t in tiles]
        reduce_scatter_owned(ctx, output_tensor, input_tensor, owned, reduction)
        self._finish(async_op)

    def broadcast(self, tensor, src: int = 0, group=None, async_op: bool = False, config: Config | None = None):
        """Every rank's ``tensor`` := rank ``src``'s, in place."""
        self._check_group("broadcast", group)
        self._config("broadcast", config)
        if not isinstance(src, int) or not 0 <= src < self._context.world_size:
            raise ValueError(f"broadcast: src={src!r} is not a rank of this world (0..{self._context.world_size - 1})")
        self._context._torch_ccl.broadcast(tensor, src)
        self._finish(async_op)
        return tensor

    def barrier(self, group=None) -> None:
        """Every rank's earlier device work is complete and every rank arrived."""
        self._check_group("barrier", group)
        self._context.barrier()
