"""Upstream iris's logging names (``iris.logging``): the ``iris`` logger, its levels and formatter.

``logger`` is the stdlib logger named ``"iris"``, the one every context logs to
(``ctx.info(...)`` and the others). ``DEBUG``, ``INFO``, ``WARNING`` and ``ERROR`` are the stdlib
levels, and ``set_logger_level(level)`` sets the logger's level.

**Importing this module configures the logger**, as upstream's does: when the ``iris`` logger has
no handler yet, it gets a :class:`logging.StreamHandler` (stderr) that formats with
:class:`IrisFormatter`, and when no level was set on it yet, level ``INFO``. Upstream programs
expect their contexts' ``info`` lines to show without any logging set-up of their own, and that is
what this gives them. Programs that configure logging themselves, or never import this module,
keep their own configuration: records then read ``[iris r/W] msg``, the prefix every context puts
in its messages.
"""

from __future__ import annotations

import logging

__all__ = ["DEBUG", "ERROR", "INFO", "WARNING", "IrisFormatter", "logger", "set_logger_level"]

DEBUG = logging.DEBUG
INFO = logging.INFO
WARNING = logging.WARNING
ERROR = logging.ERROR

#: The logger every iris context logs to.
logger = logging.getLogger("iris")


class IrisFormatter(logging.Formatter):
    """Formats a record as ``[Iris] [rank/num_ranks] message`` when it carries the logging rank
    (attributes ``iris_rank`` and ``iris_num_ranks``, which a context's records have), else as
    ``[Iris] message``. Exception and stack text follow as with :class:`logging.Formatter`.

    A context's records also have their ``[iris r/W]`` prefix in the message itself (so that any
    formatter shows the rank); this formatter drops that prefix (recorded as ``iris_prefix``)
    rather than show the rank twice.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = record.message
        prefix = getattr(record, "iris_prefix", None)
        if prefix and message.startswith(prefix):
            message = message[len(prefix):]
        rank, num_ranks = getattr(record, "iris_rank", None), getattr(record, "iris_num_ranks", None)
        if rank is not None and num_ranks is not None:
            return f"[Iris] [{rank}/{num_ranks}] {message}"
        return f"[Iris] {message}"


def set_logger_level(level: int | str) -> None:
    """Set the ``iris`` logger's level: ``DEBUG``, ``INFO``, ``WARNING``, ``ERROR`` (or a level
    name). Records below it, from every context of this process, are dropped."""
    logger.setLevel(level)


if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(IrisFormatter())
    logger.addHandler(_handler)
if logger.level == logging.NOTSET:
    logger.setLevel(INFO)
