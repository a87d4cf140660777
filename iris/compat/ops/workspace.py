"""Upstream iris's ``iris.ops.workspace``: :class:`FusedWorkspace`."""

from iris.compat.fused_ops import FusedWorkspace

__all__ = ["FusedWorkspace"]
