"""Upstream iris's ``iris.experimental.iris_gluon``: the Gluon backend under upstream's module name.

``iris(heap_size)`` makes a Gluon context with upstream's conventions and ``IrisDeviceCtx`` is the
device context of ``@gluon.jit`` kernels, both from the ``iris-gluon`` distribution.
"""

from iris.registry import get_backend

get_backend("gluon")  # BackendNotFoundError naming the distribution to install when it is missing

from iris_gluon import IrisDeviceCtx, iris  # noqa: E402

__all__ = ["IrisDeviceCtx", "iris"]
