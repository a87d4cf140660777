"""Upstream iris's ``iris.ops.config``: :class:`FusedConfig`."""

from iris.compat.fused_ops import FusedConfig

__all__ = ["FusedConfig"]
