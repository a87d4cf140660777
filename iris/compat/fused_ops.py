"""``ctx.ops`` of contexts made with upstream iris's spelling: upstream's signatures and shapes,
run by the backend's operations (torch.distributed's conventions) and iris's collectives.

Upstream takes ``(output, A, B, bias=None, async_op=False, config=None, workspace=None)`` and
returns a :class:`FusedWorkspace`; without ``async_op=True`` a call ends with a host barrier.
Where the shapes differ from the torch-convention operations:

- ``all_gather_matmul``: ``A`` is sharded by columns (``M x K/world`` per rank, ``B`` is
  ``K x N``): the shards are all-gathered, laid side by side, and multiplied;
- ``matmul_reduce_scatter``: the output keeps the full ``(M, N)`` shape, summed over ranks on the
  tiles this rank owns (tiles of ``config``'s blocks numbered row by row, a contiguous run per
  rank, :func:`iris.compat.tiles.matmul_reduce_scatter_tiles`) and zero elsewhere.
"""

from __future__ import annotations

import attrs
import torch

from iris.compat.collectives import check_matrix
from iris.compat.tiles import matmul_reduce_scatter_tiles, reduce_scatter_owned, tile_elements

__all__ = ["FusedConfig", "FusedWorkspace", "UpstreamOps", "prepare", "upstream_ops"]

_VARIANTS = ("atomic", "ring", "one_shot", "two_shot", "spinlock")


@attrs.define
class FusedConfig:
    """Options of a fused operation, with upstream iris's fields and defaults. The block sizes
    decide which tiles a rank owns in ``matmul_reduce_scatter``; the other fields are checked
    (:meth:`validate`) and otherwise not used: the backend picks its kernels' shapes itself."""

    block_size_m: int = 256
    block_size_n: int = 64
    block_size_k: int = 64
    group_size_m: int = 1
    num_sms: int | None = None
    num_xcds: int = 1
    chunk_size: int = 1
    cache_modifier_a: str = ".ca"
    cache_modifier_b: str = ".ca"
    allow_tf32: bool = True
    all_reduce_variant: str = "two_shot"
    all_reduce_num_rings: int = 1

    def validate(self, world_size: int | None = None) -> None:
        """Raise ValueError for a value upstream refuses."""
        for name in ("block_size_m", "block_size_n", "block_size_k", "group_size_m", "num_xcds", "chunk_size",
                     "all_reduce_num_rings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"FusedConfig.{name} must be a positive int, got {value!r}")
        if self.num_sms is not None and self.num_sms <= 0:
            raise ValueError(f"FusedConfig.num_sms must be positive or None, got {self.num_sms!r}")
        if self.all_reduce_variant not in _VARIANTS:
            raise ValueError(f"FusedConfig.all_reduce_variant must be one of {', '.join(_VARIANTS)}, got "
                             f"{self.all_reduce_variant!r}")
        if self.all_reduce_variant == "ring" and world_size and self.block_size_n % world_size:
            raise ValueError(f"FusedConfig: the ring variant needs block_size_n ({self.block_size_n}) divisible by the "
                             f"world size {world_size}")


@attrs.define
class FusedWorkspace:
    """The call a fused operation was prepared for, as upstream's workspace records it. The
    backend keeps its buffers in the context's workspaces, so this holds no memory."""

    operation: str = ""
    shape: tuple = ()
    dtype: torch.dtype | None = None
    world_size: int = 1
    variant: str = ""
    prepared: bool = False

    def matches(self, operation: str, shape: tuple, dtype, world_size: int, variant: str = "") -> bool:
        return self.prepared and (self.operation, tuple(self.shape), self.dtype, self.world_size,
                                  self.variant) == (operation, tuple(shape), dtype, world_size, variant)

    def reset(self) -> None:
        self.prepared = False

    def clear(self) -> None:
        self.reset()


def prepare(name: str, world_size: int, config: FusedConfig | None, workspace: FusedWorkspace | None, shape: tuple,
            dtype) -> tuple[FusedConfig, FusedWorkspace]:
    """The checked configuration of a call of ``name`` (default: ``FusedConfig()``) and its workspace
    (``workspace``, or a new one), prepared for the call's ``(M, N, K)`` and dtype."""
    config = FusedConfig() if config is None else config
    if not isinstance(config, FusedConfig):
        raise TypeError(f"{name}: config must be an iris.ops.FusedConfig, got {type(config).__name__}")
    config.validate(world_size)
    workspace = FusedWorkspace() if workspace is None else workspace
    workspace.operation, workspace.shape, workspace.dtype = name, tuple(shape), dtype
    workspace.world_size, workspace.variant, workspace.prepared = world_size, config.all_reduce_variant, True
    return config, workspace


class UpstreamOps:
    """Upstream iris's ``ctx.ops``. Every method is a collective operation."""

    def __init__(self, context, ops):
        self._context = context
        #: The backend's operations, with torch.distributed's conventions.
        self._ops = ops

    def _prepare(self, name: str, config: FusedConfig | None, workspace: FusedWorkspace | None, shape: tuple,
                 dtype) -> tuple[FusedConfig, FusedWorkspace]:
        return prepare(name, self._context.world_size, config, workspace, shape, dtype)

    def _finish(self, workspace: FusedWorkspace, async_op: bool) -> FusedWorkspace:
        workspace.prepared = False
        if not async_op:
            self._context.barrier()
        return workspace

    @staticmethod
    def _no_bias(name: str, bias) -> None:
        if bias is not None:
            raise ValueError(f"{name}: bias is not taken by this operation (upstream's ignores it); add it to the "
                             f"result instead")

    @staticmethod
    def _row_bias(name: str, bias, rows: int, out: torch.Tensor) -> None:
        """Add ``bias`` (``rows`` values, one per row) to ``out``'s rows."""
        if bias is None:
            return
        if tuple(bias.shape) != (rows,):
            raise ValueError(f"{name}: bias has shape {tuple(bias.shape)}; expected ({rows},), one value per row")
        out += bias.to(out.dtype)[:, None]

    def matmul_all_reduce(self, output_tensor, A, B, bias=None, async_op: bool = False,
                          config: FusedConfig | None = None, workspace: FusedWorkspace | None = None) -> FusedWorkspace:
        """``output_tensor`` (``M x N``) := the sum over ranks of ``A @ B``."""
        self._no_bias("matmul_all_reduce", bias)
        check_matrix("matmul_all_reduce", "A", A)
        check_matrix("matmul_all_reduce", "B", B)
        _, workspace = self._prepare("matmul_all_reduce", config, workspace, (A.shape[0], B.shape[1], A.shape[1]),
                                     A.dtype)
        self._ops.matmul_all_reduce(output_tensor, A, B)
        return self._finish(workspace, async_op)

    def all_gather_matmul(self, output_tensor, A_sharded, B, bias=None, async_op: bool = False,
                          config: FusedConfig | None = None, workspace: FusedWorkspace | None = None) -> FusedWorkspace:
        """``output_tensor`` (``M x N``) := ``[A_0 | A_1 | ...] @ B``: rank r's ``A_sharded``
        (``M x K/world``) holds columns ``[r * K/world, (r + 1) * K/world)`` of ``A``."""
        name = "all_gather_matmul"
        check_matrix(name, "A_sharded", A_sharded)
        check_matrix(name, "B", B)
        world = self._context.world_size
        M, k = A_sharded.shape
        if B.shape[0] != world * k:
            raise ValueError(f"{name}: B has {B.shape[0]} rows; A_sharded's {k} columns on each of {world} ranks "
                             f"make K = {world * k}")
        if tuple(output_tensor.shape) != (M, B.shape[1]):
            raise ValueError(f"{name}: output_tensor has shape {tuple(output_tensor.shape)}; expected "
                             f"{(M, B.shape[1])}")
        _, workspace = self._prepare(name, config, workspace, (M, B.shape[1], world * k), A_sharded.dtype)
        shards = torch.empty(world, M, k, dtype=A_sharded.dtype, device=A_sharded.device)
        self._context._torch_ccl.all_gather(shards, A_sharded.contiguous())
        torch.matmul(shards.permute(1, 0, 2).reshape(M, world * k), B, out=output_tensor)
        self._row_bias(name, bias, M, output_tensor)
        return self._finish(workspace, async_op)

    def matmul_all_gather(self, output_tensor, A, B, bias=None, async_op: bool = False,
                          config: FusedConfig | None = None, workspace: FusedWorkspace | None = None) -> FusedWorkspace:
        """``output_tensor`` (``world * m x N``) := every rank's ``A @ B`` (``A``: ``m x K``), in rank
        order along the rows; ``bias`` (``m`` values) is added to each rank's rows first."""
        name = "matmul_all_gather"
        check_matrix(name, "A", A)
        check_matrix(name, "B", B)
        _, workspace = self._prepare(name, config, workspace, (A.shape[0], B.shape[1], A.shape[1]), A.dtype)
        if bias is None:
            self._ops.matmul_all_gather(output_tensor, A, B)
        else:
            local = torch.matmul(A, B)
            self._row_bias(name, bias, A.shape[0], local)
            self._context._torch_ccl.all_gather(output_tensor, local)
        return self._finish(workspace, async_op)

    def matmul_reduce_scatter(self, output_tensor, A, B, bias=None, async_op: bool = False,
                              config: FusedConfig | None = None,
                              workspace: FusedWorkspace | None = None) -> FusedWorkspace:
        """``output_tensor`` (``M x N``): on the tiles this rank owns, the sum over ranks of
        ``A @ B``; zero elsewhere."""
        name = "matmul_reduce_scatter"
        self._no_bias(name, bias)
        check_matrix(name, "A", A)
        check_matrix(name, "B", B)
        M, N = A.shape[0], B.shape[1]
        if tuple(output_tensor.shape) != (M, N):
            raise ValueError(f"{name}: output_tensor has shape {tuple(output_tensor.shape)}; expected {(M, N)} (the "
                             f"full product: this rank's tiles are filled in)")
        config, workspace = self._prepare(name, config, workspace, (M, N, A.shape[1]), A.dtype)
        ctx = self._context
        tiles = matmul_reduce_scatter_tiles(M, N, config.block_size_m, config.block_size_n, ctx.world_size)
        owned = [tile_elements(M, N, config.block_size_m, config.block_size_n, t, ctx.device) for t in tiles]
        output_tensor.zero_()
        reduce_scatter_owned(ctx, output_tensor, torch.matmul(A, B), owned, "sum")
        return self._finish(workspace, async_op)


def upstream_ops(ctx) -> UpstreamOps:
    """``ctx.ops`` with upstream's conventions: its own for an ``iris.iris()`` context, the backend's
    operations wrapped for an ``iris.create()`` one (whose ``ctx.ops`` stays torch.distributed's)."""
    ops = ctx.ops
    return ops if isinstance(ops, UpstreamOps) else UpstreamOps(ctx, ops)
