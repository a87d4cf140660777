"""Upstream iris's ``iris.ops.workspace``: :class:`FusedWorkspace`."""

from iris.upstream.ops import FusedWorkspace

__all__ = ["FusedWorkspace"]
