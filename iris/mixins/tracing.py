"""TracingMixin: the ``ctx.tracing`` service (:mod:`iris.tracing`)."""

from __future__ import annotations

from iris.tracing import Tracing

__all__ = ["TracingMixin"]


class TracingMixin:
    """Adds ``tracing``, made once the heap (and the device-context tensor it points into the
    trace buffer) exists; group views share it. Requires ``_device_context``, ``comm``,
    ``device`` and ``info``."""

    tracing: Tracing

    def _setup(self) -> None:
        super()._setup()
        self.tracing = Tracing(self)
        self.tracing.attach(self._device_context)
