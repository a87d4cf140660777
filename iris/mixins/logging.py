"""LoggingMixin: rank-aware log records through stdlib :mod:`logging`."""

from __future__ import annotations

import logging
from functools import cached_property
from typing import Any, MutableMapping, Protocol

__all__ = ["LoggingMixin", "RankAdapter"]

LOGGER_NAME = "iris"


class RankAdapter(logging.LoggerAdapter):
    """Prefixes every message with ``[iris r/W]`` and records ``rank`` and ``world_size``.

    Records also carry upstream iris's names for the same, ``iris_rank`` and ``iris_num_ranks``,
    and the prefix as ``iris_prefix``: :class:`iris.logging.IrisFormatter` shows the rank its own
    way (``[Iris] [r/W] msg``) and drops the prefix rather than show it twice.
    """

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        rank, world_size = self.extra["rank"], self.extra["world_size"]
        prefix = f"[iris {rank}/{world_size}] "
        kwargs.setdefault("extra", {}).update(self.extra, iris_rank=rank, iris_num_ranks=world_size,
                                              iris_prefix=prefix)
        return f"{prefix}{msg}", kwargs


def _ensure_visible(logger: logging.Logger) -> None:
    """Give an explicitly requested level somewhere to go when the application set up none."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logger.addHandler(handler)


class LoggingHost(Protocol):
    """What LoggingMixin needs from the context it is part of (checked when a context is made)."""

    rank: int
    world_size: int
    config: Any


class LoggingMixin:
    """Adds ``debug``, ``info``, ``warning``, ``error`` and ``logger``.

    Records go to the ``iris`` logger, prefixed ``[iris r/W]``. The level comes from
    ``create(log_level=...)`` or ``IRIS_LOG_LEVEL``; without either, logging's own
    configuration decides.
    """

    needs = LoggingHost

    @cached_property
    def logger(self) -> RankAdapter:
        logger = logging.getLogger(LOGGER_NAME)
        if self.config.log_level is not None:
            logger.setLevel(self.config.log_level)
            _ensure_visible(logger)
        return RankAdapter(logger, {"rank": self.rank, "world_size": self.world_size})

    def debug(self, msg: str, *args: Any) -> None:
        self.logger.debug(msg, *args)

    def info(self, msg: str, *args: Any) -> None:
        self.logger.info(msg, *args)

    def warning(self, msg: str, *args: Any) -> None:
        self.logger.warning(msg, *args)

    def error(self, msg: str, *args: Any) -> None:
        self.logger.error(msg, *args)
