"""Upstream iris's conventions and module names, all in this package.

Two things make upstream iris's programs run unchanged:

- **Contexts of upstream's spelling.** ``iris.iris(...)`` makes a context whose ``ccl``, ``ops``,
  ``device``, ``broadcast`` and ``barrier`` follow upstream's signatures (:mod:`~iris.compat.context`,
  with :mod:`~iris.compat.collectives`, :mod:`~iris.compat.fused_ops` and
  :mod:`~iris.compat.tiles`), on the same kernels as every other context. That class is the one
  place the core tells the two kinds of context apart.
- **Upstream's module names.** ``iris.ccl``, ``iris.hip``, ``iris.logging``, ``iris.timing``,
  ``iris.ops``, ``iris.iris``, ``iris.experimental``, ``iris.tensor_creation`` and
  ``iris.allocators`` are modules of this package under a second name (:data:`ALIASES`);
  ``iris.x``, ``iris.device_utils`` and ``iris.experimental.iris_gluon`` are modules of a
  backend, which declares them (``Backend.device_modules``), so the core imports no backend. An
  alias is the same module object as its target (``iris.ops.config is iris.compat.ops.config``),
  imported on first use.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

__all__ = ["ALIASES", "install_aliases"]

#: Upstream's module names under ``iris`` and what implements each: a module of this package, or
#: ``(backend, name)``, the module the backend declares under that name (``Backend.device_modules``).
#: Submodules follow their package (``iris.ops.config`` is ``iris.compat.ops.config``).
ALIASES: dict[str, str | tuple[str, str]] = {
    "iris.ccl": "iris.compat.ccl",
    "iris.hip": "iris.compat.hip",
    "iris.logging": "iris.compat.logging",
    "iris.timing": "iris.compat.timing",
    "iris.iris": "iris.compat.iris_module",
    "iris.ops": "iris.compat.ops",
    "iris.experimental": "iris.compat.experimental",
    "iris.tensor_creation": "iris.compat.tensor_creation",
    "iris.allocators": "iris.compat.allocators",
    "iris.experimental.iris_gluon": ("gluon", "experimental.iris_gluon"),
    "iris.x": ("triton", "x"),
    "iris.device_utils": ("triton", "device_utils"),
}


def _target(fullname: str) -> str | None:
    """The real name of the module imported as ``fullname``, or None when it is no alias."""
    if fullname in ALIASES:
        target = ALIASES[fullname]
        if isinstance(target, tuple):
            from iris.registry import get_backend

            backend, name = target
            return get_backend(backend).device_modules[name]  # BackendNotFoundError: what to install
        return target
    package = fullname.rpartition(".")[0]
    while package:
        if isinstance(ALIASES.get(package), str):
            return f"{ALIASES[package]}{fullname[len(package):]}"
        package = package.rpartition(".")[0]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias as the module it names: imports that module and hands it over as it is."""

    def __init__(self, target: str):
        self.target = target
        self.own_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.own_spec  # the import system gave it the alias's spec: keep its own


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`ALIASES` (first on ``sys.meta_path``, for ``iris.*`` names only)."""

    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith("iris."):
            return None
        real = _target(fullname)
        if real is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real))


def install_aliases() -> None:
    """Make upstream's module names importable (once per process; ``import iris`` calls it)."""
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
