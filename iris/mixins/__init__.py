"""The user-facing API families every context is assembled from (see :func:`iris.create`): logging,
the heap, tensors on it, and the collectives (``ctx.ccl``)."""

from iris.mixins.ccl import CCLMixin
from iris.mixins.heap import HeapMixin
from iris.mixins.logging import LoggingMixin
from iris.mixins.tensors import TensorMixin

__all__ = ["CCLMixin", "HeapMixin", "LoggingMixin", "TensorMixin"]
