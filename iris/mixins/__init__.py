"""The mixins a context class is assembled from (see :func:`iris.create`)."""

from iris.mixins.ccl import CCLMixin
from iris.mixins.heap import HeapMixin
from iris.mixins.logging import LoggingMixin
from iris.mixins.tensors import TensorMixin

__all__ = ["CCLMixin", "HeapMixin", "LoggingMixin", "TensorMixin"]
