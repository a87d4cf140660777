"""The entry of a declared call, written for its declaration: a repeat found in the fewest steps.

A repeated eager call (:mod:`iris.calls.repeats`) should cost its launches and little else, so the
entry of every public ``ctx.ccl`` / ``ctx.ops`` method is a function generated from its
:class:`~iris.calls.declarations.Declaration` (as :mod:`dataclasses` writes ``__init__``): it has
the method's own parameters, so no ``*args`` / ``**kwargs`` are packed, and it builds the call's
key in one expression: the call's name, each tensor's address, each other value with its type
(True, 1 and 1.0 make different calls; a string needs none). The rest of what identifies a
tensor (shape, strides, dtype, device, and the dispatch state torch keys its kernels on) is
checked for all the call's tensors at once by a guard in C++
(``torch._C._dynamo.guards.TensorGuards``, torch.compile's own check of its inputs) kept beside
the repeat. Where this torch has no such guard, the shape, strides and dtype go into the key
instead. Either way a key never depends on a tensor's values,
only on what ``set_``, ``resize_``, ``as_strided_`` or ``.data =`` change.

Anything else (``group=``, ``async_op=``, keywords the declaration does not name, torch.compile,
no repeat, arguments that cannot be keyed) goes to the call made in full (``in_full``).
"""

from __future__ import annotations

import functools
import keyword
from typing import Any, Callable

import torch

from iris.calls.declarations import REQUIRED, Declaration

__all__ = ["entry", "guard", "keyer", "layout_guard"]


def _tensor_guards():
    """torch.compile's C++ check of tensors' metadata, or None where this torch lacks it (or it
    does not take the arguments this module passes)."""
    try:
        guards = torch._C._dynamo.guards.TensorGuards
        guards(torch.empty(0), dynamic_dims_sizes=None, dynamic_dims_strides=None).check(torch.empty(0))
    except Exception:  # noqa: BLE001 - any failure means: put the metadata into the key
        return None
    return guards


_TENSOR_GUARDS = _tensor_guards()


def _always(*tensors) -> bool:
    return True


def guard(tensors: tuple) -> Callable[..., bool]:
    """The check that tensors are (in metadata) ``tensors`` (what :func:`keyer` gives besides the
    key), called with the tensors of a later call of the same key; where the key holds their
    layouts (no C++ guard in this torch), nothing is left to check."""
    if _TENSOR_GUARDS is None or not tensors:
        return _always
    return layout_guard(tensors)


def layout_guard(tensors: tuple) -> Callable[..., bool]:
    """The check that tensors have ``tensors``' shapes, strides, dtypes and devices (for keys that
    hold none of it): torch's C++ guard, or where this torch has none a comparison in Python."""
    if _TENSOR_GUARDS is not None:
        return _TENSOR_GUARDS(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
    layouts = [_layout(tensor) for tensor in tensors]
    return lambda *others: [_layout(tensor) for tensor in others] == layouts


def _layout(tensor: torch.Tensor) -> tuple:
    return tensor.shape, tensor.stride(), tensor.dtype, tensor.device


#: Names the generated source uses besides the declared parameters: none may be declared.
_RESERVED = frozenset({"self", "group", "async_op", "_extra", "found", "_in_full", "_is_compiling", "keyed"})


def _pieces(declaration: Declaration) -> tuple[list[str], str, tuple[tuple[str, bool], ...], dict]:
    """``(parameters, key, tensors, defaults)``: the declared parameters as Python source, the key
    expression, the tensor parameters as ``(name, optional)`` in the declared order, and the
    defaults by the names the source uses.
    ValueError for a parameter the source could not take (a reserved name, a keyword, not an
    identifier)."""
    clashing = [p.name for p in declaration.params if p.name in _RESERVED or p.name.startswith("_default")
                or not p.name.isidentifier() or keyword.iskeyword(p.name)]
    if clashing:
        raise ValueError(f"declaration {declaration.name!r}: parameter(s) {clashing} cannot be taken by a generated "
                         f"entry (reserved: {sorted(_RESERVED)} and _default*); rename them")
    parameters, key, tensors, defaults = [], [repr(declaration.name)], [], {}
    starred = False
    for index, param in enumerate(declaration.params):
        if param.keyword_only and not starred:
            parameters.append("*")
            starred = True
        if param.default is REQUIRED:
            parameters.append(param.name)
        else:
            parameters.append(f"{param.name}=_default{index}")
            defaults[f"_default{index}"] = param.default
        name = param.name
        identity = f"{name}.data_ptr()" if _TENSOR_GUARDS is not None else \
            f"{name}.data_ptr(), {name}.shape, {name}.stride(), {name}.dtype"
        if param.type == "Tensor":
            key.append(identity)
            tensors.append((name, False))
        elif param.type == "Tensor?":
            key.append(f"None if {name} is None else ({identity},)")  # None is in the key: the guard takes fewer
            tensors.append((name, True))
        elif param.type == "str?":  # a string needs no type (ReduceOp.SUM == 0 == False does), nor does None
            key.append(f"{name} if {name} is None or {name}.__class__ is str else ({name}.__class__, {name})")
        elif param.type == "str":
            key.append(f"{name} if {name}.__class__ is str else ({name}.__class__, {name})")
        else:
            key.append(f"{name}.__class__, {name}")
    return parameters, f"({', '.join(key)},)", tuple(tensors), defaults


@functools.cache
def keyer(declaration: Declaration) -> Callable[..., tuple]:
    """``keyed(*args, **kwargs) -> (key, tensors)`` of a call of ``declaration``: raises
    TypeError or AttributeError for arguments that cannot be keyed (the call is then never
    repeated)."""
    parameters, key, tensors, defaults = _pieces(declaration)
    given = [f"*(() if {name} is None else ({name},))" if optional else name for name, optional in tensors]
    source = f"def keyed({', '.join(parameters)}):\n    return {key}, ({', '.join(given)}{',' if given else ''})\n"
    namespace = dict(defaults)
    exec(source, namespace)  # noqa: S102 - source written above from the declaration alone
    return namespace["keyed"]


def _guard_call(guard: str, tensors: tuple[tuple[str, bool], ...]) -> str:
    """``guard`` called with the tensors ``tensors`` (``(name, optional)`` in the declared order)
    but those optional ones that are None: a conditional per optional tensor, which costs less per
    call than unpacking a tuple built for it."""
    for index, (name, optional) in enumerate(tensors):
        if optional:
            before, after = tensors[:index], tensors[index + 1:]
            return (f"({_guard_call(guard, before + after)} if {name} is None "
                    f"else {_guard_call(guard, (*before, (name, False), *after))})")
    return f"{guard}({', '.join(name for name, _ in tensors)})"


def entry(declaration: Declaration, in_full: Callable[[Any, tuple, dict, Any, bool], Any]) -> Callable:
    """The entry of ``declaration``'s method: its repeat where one is kept for the call
    (``self._repeats.by_key``: :class:`iris.calls.repeats.Repeats`) and the guard lets it run
    (``self._context._run_repeat``), else ``in_full(self, args, kwargs, group, async_op)``."""
    parameters, key, tensors, defaults = _pieces(declaration)
    checked = _guard_call("found[2]", tensors)
    positional = [p.name for p in declaration.params if not p.keyword_only]
    keywords = [p.name for p in declaration.params if p.keyword_only]
    returned = declaration.returns or "None"
    starred = [] if keywords else ["*"]
    signature = ", ".join(["self", *parameters, *starred, "group=None", "async_op=False", "**_extra"])
    source = f"""def {declaration.name}({signature}):
    if group is None and not async_op and not _extra and not _is_compiling():
        try:
            found = self._repeats.by_key.get({key})
        except (TypeError, AttributeError, RuntimeError):  # a value that cannot be keyed (no storage, say)
            found = None
        if found is not None and {checked} and self._context._run_repeat(found[0], found[1]) is not None:
            return {returned}
    return _in_full(self, ({''.join(f'{name}, ' for name in positional)}),
                    {{{''.join(f'{name!r}: {name}, ' for name in keywords)}**_extra}}, group, async_op)
"""
    namespace = dict(defaults, _in_full=in_full, _is_compiling=torch.compiler.is_compiling)
    exec(source, namespace)  # noqa: S102 - source written above from the declaration alone
    return namespace[declaration.name]
