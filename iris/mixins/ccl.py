"""CCLMixin: the ``ctx.ccl`` namespace of collectives."""

from __future__ import annotations

from functools import cached_property

__all__ = ["CCLMixin", "Collectives"]


class Collectives:
    """Host-launched collectives of one context (``ctx.ccl``), with torch.distributed semantics.

    Every method is a collective operation: all ranks call it with matching arguments.
    """

    def __init__(self, context):
        self._context = context

    def barrier(self) -> None:
        """Wait until every rank's earlier device work is complete and every rank arrived."""
        self._context.barrier()


class CCLMixin:
    """Adds ``ccl``, the :class:`Collectives` namespace bound to this context. Requires
    ``barrier()`` (ContextBase)."""

    @cached_property
    def ccl(self) -> Collectives:
        return Collectives(self)
