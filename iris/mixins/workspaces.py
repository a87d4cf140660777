"""WorkspacesMixin: the ``ctx.workspaces`` service (:mod:`iris.workspaces`)."""

from __future__ import annotations

from functools import cached_property

from iris.workspaces import Workspaces

__all__ = ["WorkspacesMixin"]


class WorkspacesMixin:
    """Adds ``workspaces``, the named heap buffers the context's device protocols share
    (collectives, fused operations, a backend's own). Requires ``barrier()``, ``comm``, ``free``,
    ``info`` and the heap's constructors."""

    @cached_property
    def workspaces(self) -> Workspaces:
        return Workspaces(self)
