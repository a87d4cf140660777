"""Context configuration: one frozen value object built from arguments and the environment.

Precedence for every field: explicit argument, then the environment variable, then the default.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from typing import Any

import attrs

__all__ = ["ContextConfig", "DEFAULT_BACKEND", "DEFAULT_HEAP_SIZE", "parse_size"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")

#: Heap size per rank when none is given: one device allocation on GPUs, and a
#: /dev/shm segment per rank on CPU ranks (kept small so several ranks fit a default /dev/shm).
DEFAULT_HEAP_SIZE = {"cuda": 1 << 30, "cpu": 128 << 20}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"1GiB"``, ``"512 MiB"``, ``"2G"`` or ``"1e9"``.

    Binary units (KiB, MiB, GiB, TiB, and the bare K, M, G, T) are powers of 1024; KB, MB, GB
    and TB are powers of 1000.
    """
    if isinstance(value, bool):
        raise TypeError(f"size must be an int or a string like '1GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is None or match.group(2).lower() not in _UNITS:
            try:
                n = int(float(value))
            except (ValueError, OverflowError):
                raise ValueError(
                    f"cannot read size {value!r}: use bytes or a number with a unit, e.g. '1GiB', '512MiB'"
                ) from None
        else:
            n = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    else:
        raise TypeError(f"size must be an int or a string like '1GiB', got {type(value).__name__}")
    if n <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return n


def _optional_size(value: int | str | None) -> int | None:
    return None if value is None else parse_size(value)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def debug_from_environment() -> bool:
    """Whether ``IRIS_DEBUG`` asks for debug mode (read by code compiled at import time)."""
    return _env_flag("IRIS_DEBUG")


#: Seconds any wait on peers may take, unless ``create(timeout=...)`` or ``IRIS_TIMEOUT`` says otherwise.
DEFAULT_TIMEOUT = 300.0


def timeout_from_environment(default: float = DEFAULT_TIMEOUT) -> float:
    """The timeout ``IRIS_TIMEOUT`` asks for (seconds), else ``default``: for what runs before a
    context exists (a rank joining its process group)."""
    value = os.environ.get("IRIS_TIMEOUT")
    return default if value is None else _timeout(value)


def _timeout(value: float | str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"timeout (IRIS_TIMEOUT) must be a number of seconds, got {value!r}") from None
    if not seconds > 0:
        raise ValueError(f"timeout (IRIS_TIMEOUT) must be positive, got {value!r}")
    return seconds


def _log_level(value: int | str | None) -> int | None:
    if value is None or isinstance(value, int):
        return value
    level = logging.getLevelName(value.strip().upper())
    if not isinstance(level, int):
        raise ValueError(f"unknown log level {value!r}: use DEBUG, INFO, WARNING or ERROR")
    return level


#: What a device-side wait that gives up does besides recording the failure: ``"raise"`` (the call
#: or the next iris call raises) or ``"trap"`` (the kernel traps, which ends the process).
ON_TIMEOUT = ("raise", "trap")


def _on_timeout(value: str) -> str:
    choice = str(value).strip().lower()
    if choice not in ON_TIMEOUT:
        raise ValueError(f"on_timeout (IRIS_ON_TIMEOUT) must be one of {', '.join(ON_TIMEOUT)}, got {value!r}")
    return choice


#: The backend of a context when neither ``create(backend=...)`` nor ``IRIS_BACKEND`` names one.
DEFAULT_BACKEND = "triton"


@attrs.frozen(kw_only=True)
class ContextConfig:
    """Everything that shapes a context, resolved before the context is built."""

    backend: str = DEFAULT_BACKEND
    """Backend name, looked up in :mod:`iris.registry`."""
    device: str = "cpu"
    """Device type of the ranks: ``"cuda"`` or ``"cpu"``."""
    heap_size: int = attrs.field(converter=parse_size)
    """Bytes of symmetric heap per rank."""
    heap_provider: str | None = None
    """Heap provider name (``"shm"``, ``"cuda-ipc"``, ``"cuda-vmm"``); None picks the device's default."""
    debug: bool = False
    """Check allocations for symmetry across ranks (``IRIS_DEBUG=1``)."""
    log_level: int | None = attrs.field(default=None, converter=_log_level)
    """Level of the context's logger; None leaves it to the logging configuration."""
    timeout: float = attrs.field(default=DEFAULT_TIMEOUT, converter=_timeout)
    """Seconds of wall-clock time any wait on peers, device-side or host-side, may take before it
    gives up (``IRIS_TIMEOUT``)."""
    node_size: int | None = None
    """Ranks per node (machine) when the world spans several: the heap is shared within a node and
    world collectives run hierarchically (:mod:`iris.context.nodes`). None: from
    ``IRIS_LOCAL_WORLD_SIZE``, torchrun's ``LOCAL_WORLD_SIZE`` or the host names."""
    on_timeout: str = attrs.field(default="raise", converter=_on_timeout)
    """``"raise"``: a device-side wait that gives up fails the call (``IrisTimeoutError``, outputs
    filled with NaN); ``"trap"``: the kernel also traps, ending the process (``IRIS_ON_TIMEOUT``)."""

    @heap_size.default
    def _default_heap_size(self) -> int:
        return DEFAULT_HEAP_SIZE.get(self.device, DEFAULT_HEAP_SIZE["cpu"])

    @classmethod
    def from_env(cls, **overrides: Any) -> "ContextConfig":
        """Resolve a config: keyword overrides (None means unset), then IRIS_* variables. An
        override that names no option is a TypeError that lists the options."""
        _check_option_names(cls, overrides)
        env = {
            "backend": os.environ.get("IRIS_BACKEND"),
            "heap_size": os.environ.get("IRIS_HEAP_SIZE"),
            "log_level": os.environ.get("IRIS_LOG_LEVEL"),
            "timeout": os.environ.get("IRIS_TIMEOUT"),
            "on_timeout": os.environ.get("IRIS_ON_TIMEOUT"),
            "debug": True if _env_flag("IRIS_DEBUG") else None,
        }
        values = {k: v for k, v in env.items() if v not in (None, "")}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _check_option_names(cls: type, overrides: dict[str, Any]) -> None:
    known = sorted(field.name for field in attrs.fields(cls))
    for name in overrides:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"iris.create() got an unknown option {name!r}{hint}; the options are "
                            f"{', '.join(known)}")
