"""What the GPU heap providers share of cuda-bindings: the module, with the install hint where
it is missing, and a call's result checked, its error named."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from iris.errors import IrisError

__all__ = ["checked", "module"]


def module(name: str, provider: str):
    """``cuda.bindings.<name>`` (``"runtime"`` or ``"driver"``); where cuda-bindings is missing,
    an error that says how to install it for ``provider``."""
    try:
        return importlib.import_module(f"cuda.bindings.{name}")
    except ImportError as exc:
        raise IrisError(f"the {provider} heap needs the cuda-bindings package: pip install 'iris[cuda]' "
                        f"(or pip install cuda-bindings)") from exc


def checked(result: tuple, what: str, success: Any, describe: Callable) -> Any:
    """The values of a cuda-bindings call's ``result`` (``(error, *values)``): the one value, or
    the list of them; an :class:`IrisError` naming ``what`` and the error (``describe(error)``
    gives ``(error, message)``) where it is not ``success``."""
    err, *values = result
    if err != success:
        _, message = describe(err)
        raise IrisError(f"{what} failed: {err.name} ({message.decode() if message else 'no description'})")
    return values[0] if len(values) == 1 else values
