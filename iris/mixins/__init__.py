"""The mixins a context class is assembled from (see :func:`iris.create`)."""

from iris.mixins.ccl import CCLMixin
from iris.mixins.failstop import FailStopMixin
from iris.mixins.groups import GroupsMixin
from iris.mixins.heap import HeapMixin
from iris.mixins.logging import LoggingMixin
from iris.mixins.nodes import NodesMixin
from iris.mixins.tensors import TensorMixin
from iris.mixins.tracing import TracingMixin
from iris.mixins.workspaces import WorkspacesMixin

__all__ = ["CCLMixin", "FailStopMixin", "GroupsMixin", "HeapMixin", "LoggingMixin", "NodesMixin", "TensorMixin",
           "TracingMixin", "WorkspacesMixin"]
