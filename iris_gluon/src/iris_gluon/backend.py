"""The Gluon backend's registration and host side."""

from __future__ import annotations

import iris as _iris
from iris.backend import Backend
from iris.context import Context
from iris_gluon.frontend import GLUON
from iris_triton.backend import TritonDeviceOps

__all__ = ["GluonBackend", "GluonContext", "GluonDeviceOps", "iris"]


class GluonDeviceOps(TritonDeviceOps):
    """Host side of the Gluon backend: the Triton backend's (device barrier, timeouts), with
    iris's kernels compiled by Gluon. GPUs only: Gluon has no interpreter."""

    frontend = GLUON
    kernel_language = GLUON.name


class GluonContext(GluonDeviceOps, Context):
    """iris context of the ``"gluon"`` backend."""


GluonBackend = Backend(
    name="gluon",
    device_ops=GluonDeviceOps,
    context_class=GluonContext,
    device_modules={"experimental.iris_gluon": "iris_gluon"},
    device_types={"cuda"},
    unsupported_device_hint=(
        "Gluon kernels compile only for GPUs and Gluon has no interpreter; on CPU ranks use "
        "backend='triton', which runs kernels in Triton's interpreter."
    ),
)


def iris(heap_size: int | str | None = None, **options) -> Context:
    """Upstream iris's spelling: ``iris_gluon.iris(heap_size)`` is ``iris.iris(heap_size,
    backend="gluon")``, a Gluon context with upstream iris's conventions."""
    return _iris.iris(heap_size, backend="gluon", **options)
