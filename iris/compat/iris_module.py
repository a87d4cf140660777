"""Upstream iris's module ``iris.iris`` (``from iris.iris import DeviceContext, Iris``).

As upstream's package does, ``iris.iris`` the attribute is the function that makes a context, and
``iris.iris`` the module (this one, in ``sys.modules``) holds the names upstream's module holds:
the factory, the context class and the device context, the last resolved on first use so that
importing iris imports no backend.
"""

from __future__ import annotations

from typing import Any

from iris.context import iris
from iris.compat.context import Iris

__all__ = ["DeviceContext", "Iris", "iris"]  # noqa: F822 (DeviceContext: resolved by __getattr__)


def __getattr__(name: str) -> Any:
    if name == "DeviceContext":
        import iris as package

        return package.DeviceContext
    raise AttributeError(f"module 'iris.iris' has no attribute {name!r}")
