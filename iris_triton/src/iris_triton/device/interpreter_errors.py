"""IrisErrors raised inside kernels that Triton's interpreter runs (CPU ranks), as their own type.

The interpreter runs a kernel as Python and wraps any exception raised inside it in an
``InterpreterError`` whose message is the exception's ``repr``: once per device-function call
level and once more at the launch. A debug check's IrisError raised three device functions deep
(``iris.store`` -> ``translate`` -> the check) thus reached the launching code as an
InterpreterError of four nested, escaped reprs. :func:`unwrap_iris_errors` wraps the
interpreter's launch so that such an error reaches the caller as the IrisError itself: its own
class and message, and its traceback into the device function that raised it. Every other
exception is left to Triton as it is.
"""

from __future__ import annotations

import functools

from triton.runtime.errors import InterpreterError
from triton.runtime.interpreter import InterpretedFunction

from iris.errors import IrisError

__all__ = ["iris_error_in", "unwrap_iris_errors"]


def iris_error_in(error: BaseException | None) -> IrisError | None:
    """The IrisError that ``error`` is or wraps (along its chain of causes), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, IrisError):
            return error
        seen.add(id(error))
        error = error.__cause__
    return None


def unwrap_iris_errors() -> None:
    """Make every interpreted launch (``kernel[grid](...)``, an autotuner's run) raise the
    IrisError an InterpreterError wraps, rather than the InterpreterError. Idempotent."""
    run = InterpretedFunction.run
    if getattr(run, "raises_iris_errors", False):
        return

    @functools.wraps(run)
    def run_raising_iris_errors(self, *args, **kwargs):
        try:
            return run(self, *args, **kwargs)
        except InterpreterError as error:
            cause = iris_error_in(error)
            if cause is None:
                raise
            raise cause from None  # the wrappers only repeat its repr

    run_raising_iris_errors.raises_iris_errors = True
    InterpretedFunction.run = run_raising_iris_errors
