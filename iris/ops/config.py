"""Upstream iris's ``iris.ops.config``: :class:`FusedConfig`."""

from iris.upstream.ops import FusedConfig

__all__ = ["FusedConfig"]
