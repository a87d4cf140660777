"""Launch sites in the backends' sources that the check's calls never reached.

A launch site is a kernel launched by name: ``kernel[grid](...)`` or ``LaunchCache(kernel)`` where
``kernel`` is a module's ``triton.jit`` or ``gluon.jit`` kernel, or ``frontend.launch(source, ...)``
/ ``frontend.kernel(source)`` where ``source`` is a module's kernel source. Each is found in the
source of every module of each backend's distribution package; one whose kernel no recorded
launch compiled is a site the check does not cover.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from collections.abc import Iterable, Iterator

__all__ = ["launch_sites", "uncovered_launch_sites"]


def uncovered_launch_sites(backends: Iterable[str], launched: set[str]) -> list[str]:
    """``"module:line kernel"`` of every launch site of ``backends`` whose kernel is not among
    ``launched`` (kernel function names)."""
    return [f"{module}:{line} {name}" for module, line, name in launch_sites(backends) if name not in launched]


def launch_sites(backends: Iterable[str]) -> Iterator[tuple[str, int, str]]:
    """(module, line, kernel name) of every launch site in the backends' packages. A name launched
    is a kernel if some module of the package defines a kernel of that name (launch sites often
    import their kernel inside the function)."""
    from iris.registry import get_backend

    packages = {get_backend(name).device_ops.__module__.partition(".")[0] for name in backends}
    for package in sorted(packages):
        root = importlib.import_module(package)
        names = [root.__name__] + [info.name for info in pkgutil.walk_packages(root.__path__, f"{root.__name__}.")]
        modules = [importlib.import_module(name) for name in names]
        kernels = {name for module in modules for name, obj in vars(module).items()
                   if _is_kernel(obj) and _defined_in(obj) == module.__name__}
        for module in modules:
            with open(module.__file__, encoding="utf-8") as file:
                tree = ast.parse(file.read(), module.__file__)
            for node in ast.walk(tree):
                kernel = _launched(node)
                if kernel in kernels:
                    yield module.__name__, node.lineno, kernel


def _launched(node: ast.AST) -> str | None:
    """The name of the kernel ``node`` launches, if it is a launch by name."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Subscript) and isinstance(func.value, ast.Name):  # kernel[grid](...)
        return func.value.id
    if isinstance(func, ast.Name) and func.id == "LaunchCache" and node.args and isinstance(node.args[0], ast.Name):
        return node.args[0].id  # LaunchCache(kernel): its launches
    if (isinstance(func, ast.Attribute) and func.attr in ("launch", "kernel") and node.args
            and isinstance(node.args[0], ast.Name)):  # frontend.launch(source, ...), frontend.kernel(source)
        return node.args[0].id
    return None


def _is_kernel(obj) -> bool:
    """A jitted kernel, or a kernel source (a plain function taking ``CTX``)."""
    from triton.runtime.jit import JITFunction

    if isinstance(obj, JITFunction):
        return True
    code = getattr(obj, "__code__", None)
    return code is not None and "CTX" in code.co_varnames[:code.co_argcount]


def _defined_in(kernel) -> str:
    """The module that defines ``kernel`` (not one that imports it)."""
    return getattr(kernel, "fn", kernel).__module__
