"""Upstream iris's ``iris.ops`` package: fused matrix products with communication, called as
``iris.ops.<name>(ctx, output, ...)``, their configuration (``iris.ops.config``) and workspace
(``iris.ops.workspace``), one module per operation as upstream lays them out.

Each function runs ``ctx.ops.<name>`` with upstream's conventions (:mod:`iris.compat.fused_ops`); a
context made with :func:`iris.create` is taken too, and keeps its own ``ctx.ops``
(torch.distributed's conventions) for direct calls. The ``*_preamble`` functions check a call and
return the :class:`FusedWorkspace` it is prepared with.
"""

from iris.compat.ops.all_gather_matmul import all_gather_matmul, all_gather_matmul_preamble
from iris.compat.ops.config import FusedConfig
from iris.compat.ops.matmul_all_gather import matmul_all_gather, matmul_all_gather_preamble
from iris.compat.ops.matmul_all_reduce import matmul_all_reduce, matmul_all_reduce_preamble
from iris.compat.ops.matmul_reduce_scatter import matmul_reduce_scatter, matmul_reduce_scatter_preamble
from iris.compat.ops.workspace import FusedWorkspace

__all__ = [
    "FusedConfig",
    "FusedWorkspace",
    "all_gather_matmul",
    "all_gather_matmul_preamble",
    "matmul_all_gather",
    "matmul_all_gather_preamble",
    "matmul_all_reduce",
    "matmul_all_reduce_preamble",
    "matmul_reduce_scatter",
    "matmul_reduce_scatter_preamble",
]
