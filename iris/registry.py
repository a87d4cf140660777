"""Plugin registries: discovery through entry points plus in-process registration.

One :class:`PluginRegistry` serves each kind of plugin: backends (entry-point group
``iris.backends``), heap providers (``iris.heap_providers``) and, beside them, collective
algorithms. Entry-point metadata is read eagerly when a registry is made (cheap: no plugin code
runs); a plugin's module is imported only when the plugin is first used, and the loaded object
is cached.

Set ``IRIS_DISABLE_PLUGIN_AUTOLOAD=1`` for hermetic runs: then only what is registered in
process (including the built-ins) exists.

There is no way to unregister one name (on purpose: a plugin in use must not vanish), but code
that registers plugins for a while, tests above all, can put a whole registry back as it was:
:meth:`PluginRegistry.snapshot` returns a :class:`RegistrySnapshot` (what is registered and
what is loaded), :meth:`PluginRegistry.restore` puts it back, and
:meth:`PluginRegistry.restored` does both around a ``with`` block::

    with iris.registry.backends.restored():
        iris.register_backend("mine", MyBackend)
        ...                                   # "mine" is gone after the block, whatever happened
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any

import attrs

from iris.calls.repeats import invalidate as invalidate_repeats
from iris.errors import BackendNotFoundError

__all__ = [
    "AUTOLOAD_OPT_OUT_ENV",
    "PluginEntry",
    "PluginRegistry",
    "RegistrySnapshot",
    "available_backends",
    "backends",
    "get_backend",
    "heap_providers",
    "is_backend_available",
    "register_backend",
    "registry",
]

AUTOLOAD_OPT_OUT_ENV = "IRIS_DISABLE_PLUGIN_AUTOLOAD"

_MISSING = object()


@attrs.frozen(kw_only=True)
class PluginEntry:
    """Where a plugin comes from; the plugin itself is imported on first use."""

    name: str
    """The name users select it by."""
    target: Any
    """The plugin object, or an import path ``"pkg.module:Attribute"`` to load lazily."""
    distribution: str | None = None
    """The distribution whose entry point declared it; None when registered in process."""
    conflicting_distributions: tuple[str, ...] = ()
    """Other distributions that claim the same name (using the name is then an error)."""

    def describe(self) -> str:
        return f"distribution {self.distribution!r}" if self.distribution else "in-process registration"


def _read_only(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping))


@attrs.frozen
class RegistrySnapshot:
    """What one :class:`PluginRegistry` held at one moment (from :meth:`PluginRegistry.snapshot`),
    for :meth:`PluginRegistry.restore` to put back."""

    registry: PluginRegistry = attrs.field(repr=lambda r: f"<{r.kind} registry>")
    """The registry it was taken from (the only one it restores; compared by identity)."""
    entries: Mapping[str, PluginEntry] = attrs.field(converter=_read_only)
    """Name -> :class:`PluginEntry`, as registered then (read-only)."""
    loaded: Mapping[str, Any] = attrs.field(converter=_read_only, repr=lambda m: repr(sorted(m)))
    """Name -> plugin object, for the plugins loaded then (read-only)."""


def _autoload_disabled() -> bool:
    return os.environ.get(AUTOLOAD_OPT_OUT_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _imported_target(target: str) -> Any:
    """The object ``"pkg.module:Attribute"`` names if its module is already imported, else a
    sentinel; never imports anything."""
    module_name, _, attribute = target.partition(":")
    obj = sys.modules.get(module_name, _MISSING)
    for part in filter(None, attribute.split(".")):
        obj = getattr(obj, part, _MISSING)
    return obj


def _same_plugin(target: Any, loaded: Any, plugin: Any) -> bool:
    """Whether registering ``plugin`` over an entry with ``target`` (and ``loaded``, the object
    it loaded, if any) changes nothing. An import path and the object it names are the same
    plugin, whether or not the path was loaded yet: the answer must not depend on what ran
    first."""
    if target is plugin or target == plugin or (loaded is not _MISSING and loaded is plugin):
        return True
    if isinstance(target, str) and not isinstance(plugin, str):
        return _imported_target(target) is plugin
    if isinstance(plugin, str) and not isinstance(target, str):
        return _imported_target(plugin) is target
    return False


def _import_target(target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in filter(None, attribute.split(".")):
        obj = getattr(obj, part)
    return obj


class PluginRegistry:
    """Named plugins of one kind, from entry points and from in-process registration.

    ``error`` is the exception type raised for a missing or broken plugin; ``known`` maps names
    of plugins shipped in separate distributions to those distributions, so that a missing one
    is reported with the ``pip install`` that provides it.
    """

    #: How many times the contents of any registry changed (registrations, restores): what caches
    #: a choice made from registered plugins compares, to drop it when the plugins change.
    changes = 0

    def __init__(
        self,
        kind: str,
        group: str | None,
        *,
        error: type[Exception] = LookupError,
        known: Mapping[str, str] | None = None,
        builtins: Mapping[str, Any] | None = None,
    ):
        self.kind = kind
        self.group = group
        self.error = error
        self.known = MappingProxyType(dict(known or {}))
        self._lock = threading.RLock()
        self._entries: dict[str, PluginEntry] = {}
        self._loaded: dict[str, Any] = {}
        #: Read-only view: name -> :class:`PluginEntry`.
        self.entries: Mapping[str, PluginEntry] = MappingProxyType(self._entries)
        for name, target in (builtins or {}).items():
            self.register(name, target)
        if group is not None and not _autoload_disabled():
            self._discover(group)

    def _discover(self, group: str) -> None:
        seen: set[tuple[str, str, str]] = set()
        for ep in entry_points(group=group):
            dist = ep.dist.name if ep.dist is not None else "<unknown distribution>"
            key = (ep.name, ep.value, dist)
            if key in seen:  # one distribution visible twice on sys.path (editable installs)
                continue
            seen.add(key)
            existing = self._entries.get(ep.name)
            if existing is None:
                self._entries[ep.name] = PluginEntry(name=ep.name, target=ep.value, distribution=dist)
            elif existing.distribution is None and isinstance(existing.target, str) and existing.target == ep.value:
                continue  # a built-in that a distribution also declares: one plugin, no conflict
            elif existing.distribution != dist and dist not in existing.conflicting_distributions:
                self._entries[ep.name] = attrs.evolve(
                    existing, conflicting_distributions=(*existing.conflicting_distributions, dist)
                )

    def register(self, name: str, plugin: Any, *, clobber: bool = False) -> None:
        """Register ``plugin`` (an object, or ``"pkg.module:Attribute"``) under ``name``.

        Registering the same target twice is a no-op; a different target under a taken name
        is an error unless ``clobber=True``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        with self._lock:
            existing = self._entries.get(name)
            if existing is not None and not clobber:
                if _same_plugin(existing.target, self._loaded.get(name, _MISSING), plugin):
                    return
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (from {existing.describe()}); "
                    f"pass clobber=True to replace it"
                )
            self._entries[name] = PluginEntry(name=name, target=plugin)
            self._loaded.pop(name, None)
            PluginRegistry.changes += 1
            invalidate_repeats()  # an automatic choice they made may now be another

    def get(self, name: str) -> Any:
        """The plugin registered under ``name``, importing it on first use."""
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
            entry = self._entries.get(name)
            if entry is None:
                if name in self.known:
                    dist = self.known[name]
                    raise self.error(
                        f"{self.kind} {name!r} is provided by the {dist!r} distribution, which is "
                        f"not installed: pip install {dist} (installed: {self.names()})"
                    )
                raise self.error(f"unknown {self.kind} {name!r}; installed: {self.names()}")
            if entry.conflicting_distributions:
                # The first claimant may be a built-in (no distribution): describe, never "None".
                claimants = ", ".join(
                    [entry.describe(), *(f"distribution {d!r}" for d in entry.conflicting_distributions)]
                )
                raise self.error(
                    f"{self.kind} {name!r} is claimed by several sources ({claimants}); "
                    f"uninstall all but one, or register the one you want in process with clobber=True"
                )
            plugin = entry.target
            if isinstance(plugin, str):
                try:
                    plugin = _import_target(plugin)
                except Exception as exc:
                    raise self.error(
                        f"{self.kind} {name!r} from {entry.describe()} failed to import "
                        f"({entry.target}): {type(exc).__name__}: {exc}; reinstall or fix that "
                        f"distribution, or choose another of {self.names()}"
                    ) from exc
            self._loaded[name] = plugin
            return plugin

    def names(self) -> list[str]:
        """Registered names, sorted."""
        with self._lock:
            return sorted(self._entries)

    def is_available(self, name: str) -> bool:
        """True when ``name`` is registered and loads without error; never raises."""
        try:
            self.get(name)
        except self.error:
            return False
        return True

    def snapshot(self) -> RegistrySnapshot:
        """What is registered and loaded now, for :meth:`restore` to put back."""
        with self._lock:
            return RegistrySnapshot(self, self._entries, self._loaded)

    def restore(self, snapshot: RegistrySnapshot) -> None:
        """Put back what ``snapshot`` (taken from this registry) holds: names registered since are
        gone, names replaced since (``clobber=True``) are the old plugins again, and plugins first
        loaded since load again on next use. :attr:`entries` (and views of it, like
        :data:`registry`) stay the same live objects."""
        if not isinstance(snapshot, RegistrySnapshot):
            raise TypeError(f"restore() takes a RegistrySnapshot from snapshot(), got {type(snapshot).__name__}")
        if snapshot.registry is not self:
            raise ValueError(f"this snapshot is of another registry ({snapshot.registry.kind!r} plugins); "
                             f"it cannot restore this {self.kind!r} registry")
        with self._lock:
            self._entries.clear()
            self._entries.update(snapshot.entries)
            self._loaded.clear()
            self._loaded.update(snapshot.loaded)
            PluginRegistry.changes += 1
            invalidate_repeats()

    @contextmanager
    def restored(self) -> Iterator[PluginRegistry]:
        """A ``with`` block (yielding this registry) after which the registry is as it was before,
        even when the block raised: :meth:`snapshot` on entry, :meth:`restore` on exit."""
        snapshot = self.snapshot()
        try:
            yield self
        finally:
            self.restore(snapshot)


#: The backends: entry-point group ``iris.backends``.
backends = PluginRegistry(
    "backend",
    "iris.backends",
    error=BackendNotFoundError,
    known={"triton": "iris-triton", "gluon": "iris-gluon"},
)

#: Read-only view of the registered backends: name -> :class:`PluginEntry`.
registry: Mapping[str, PluginEntry] = backends.entries


def register_backend(name: str, backend: Any, *, clobber: bool = False) -> None:
    """Register ``backend`` (an :class:`iris.Backend` or ``"pkg.module:Attribute"``) as ``name``."""
    backends.register(name, backend, clobber=clobber)


def get_backend(name: str) -> Any:
    """The backend registered as ``name``, imported on first use."""
    return backends.get(name)


def available_backends() -> list[str]:
    """Names of the registered backends (installed distributions and in-process ones)."""
    return backends.names()


def is_backend_available(name: str) -> bool:
    """True when backend ``name`` is registered and imports; never raises."""
    return backends.is_available(name)


#: Heap providers: entry-point group ``iris.heap_providers``; each is an
#: :class:`iris.heap.HeapProvider`.
heap_providers = PluginRegistry(
    "heap provider",
    "iris.heap_providers",
    builtins={"shm": "iris.heap.shm:provider", "cuda-ipc": "iris.heap.cuda_ipc:provider",
              "cuda-vmm": "iris.heap.cuda_vmm:provider"},
)
