"""The custom operators of every declared call (``torch.ops.iris.*``), made from the declarations,
so that programs using iris compile with ``torch.compile(fullgraph=True)`` and replay in CUDA
graphs.

Dynamo cannot trace the methods' own code (their fail-stop guard takes a lock, the algorithms'
launch records are attrs classes, kernels launch through Triton's Python), so while
``torch.compiler.is_compiling()`` a method calls its operator instead (:func:`compiled_call`,
through :func:`iris.calls.routing.declared`), which the graph records as one opaque call with a
fake implementation for shapes. Each call of :data:`~iris.calls.declarations.DECLARATIONS` has
two operators, as torch's ``_functional_collectives``:

- an in-place one named with a trailing underscore (``torch.ops.iris.all_reduce_``), which
  mutates the call's outputs and returns nothing: the method, run on the object its ``handle``
  names (:mod:`iris.calls.handles`);
- a functional one (``torch.ops.iris.all_reduce``) that makes new outputs (as the declaration
  says: a copy of the argument, a tensor like it, or one made from the other arguments), runs the
  in-place operator on them and returns them. It carries an ordered effect, so a compiled graph
  keeps every iris call in program order: each is collective, and graphs may differ between
  ranks (a root's call, send on one rank and recv on another), so an order the compiler chose
  could differ between ranks. What the methods compile to, and :mod:`iris.functional`.

A call that writes nothing (``send``, ``barrier``) has one operator, without the underscore,
with the ordered effect. An operator's arguments are the method's, in order, with the handle
after the leading tensors; a functional operator has none for an output it makes from the other
arguments, and ``keep_<name>`` (bool) for an optional one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

from iris.calls.declarations import COPY, DECLARATIONS, LIKE, REQUIRED, Declaration, Made, dense
from iris.calls.handles import lookup

__all__ = ["NAMESPACE", "compiled_call", "functional_params", "in_place_name", "keep_in_program_order"]

NAMESPACE = "iris"


def in_place_name(declaration: Declaration) -> str:
    """The name of the operator that runs the call itself: ``<name>_``, or ``<name>`` for a call
    that writes nothing."""
    return f"{declaration.name}_" if declaration.outputs else declaration.name


def _with_handle(params: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``params`` with ``("handle", "int")`` after the leading tensors."""
    leading = next((i for i, (_, kind) in enumerate(params) if not kind.startswith("Tensor")), len(params))
    return [*params[:leading], ("handle", "int"), *params[leading:]]


def _in_place_params(declaration: Declaration) -> list[tuple[str, str]]:
    return _with_handle([(param.name, param.type) for param in declaration.params])


def functional_params(declaration: Declaration) -> list[tuple[str, str]]:
    """(name, schema type) of the functional operator's arguments."""
    made = {output.name: output.fresh for output in declaration.outputs if isinstance(output.fresh, Made)}
    params = []
    for param in declaration.params:
        if param.name not in made:
            params.append((param.name, param.type))
        elif made[param.name].optional:
            params.append((f"keep_{param.name}", "bool"))
    return _with_handle(params)


def _schema(params: list[tuple[str, str]], returns: str, mutated: tuple[str, ...] = ()) -> str:
    """An operator schema: ``(Tensor(a!) tensor, int handle, str op, str? algorithm) -> ()``."""
    arguments = []
    for name, kind in params:
        if name in mutated:
            alias = f"({chr(ord('a') + mutated.index(name))}!)"
            kind = kind.replace("Tensor", f"Tensor{alias}", 1)
        arguments.append(f"{kind} {name}")
    return f"({', '.join(arguments)}) -> {returns}"


def _run_method(declaration: Declaration, values: Mapping[str, Any]) -> None:
    """Run the undecorated method of the call on the object ``values["handle"]`` names."""
    target = lookup(values["handle"])
    method = getattr(type(target), declaration.name).__wrapped__.__get__(target)
    positional = [values[param.name] for param in declaration.params if not param.keyword_only]
    keywords = {param.name: values[param.name] for param in declaration.params if param.keyword_only}
    method(*positional, **keywords)


def _fresh_outputs(declaration: Declaration, values: Mapping[str, Any], *, fake: bool) -> list[torch.Tensor]:
    """The new outputs of a functional call (``fake``: their shapes only, nothing copied)."""
    target = lookup(values["handle"])
    fresh = []
    for output in declaration.outputs:
        how = output.fresh
        if how == COPY:
            argument = values[output.name]
            fresh.append(dense(argument) if fake else dense(argument).copy_(argument))
        elif how == LIKE:
            fresh.append(dense(values[output.name]))
        elif how.optional and not values[f"keep_{output.name}"]:
            first = next(value for value in values.values() if isinstance(value, torch.Tensor))
            fresh.append(first.new_empty((0,)))
        else:
            fresh.append(how.make(values, target))
    return fresh


def _result(fresh: list[torch.Tensor]):
    return fresh[0] if len(fresh) == 1 else tuple(fresh)


def _register(declaration: Declaration) -> None:
    """Register the operators of ``declaration``, their fakes and the functional one's effect."""
    in_place = _in_place_params(declaration)
    in_place_names = [name for name, _ in in_place]
    optional = {param.name for param in declaration.params if param.type == "Tensor?"}

    def run_in_place(*arguments) -> None:
        _run_method(declaration, dict(zip(in_place_names, arguments)))

    op = torch.library.custom_op(f"{NAMESPACE}::{in_place_name(declaration)}", run_in_place,
                                 mutates_args=declaration.mutated,
                                 schema=_schema(in_place, "()", declaration.mutated))
    op.register_fake(lambda *arguments: None)
    if not declaration.outputs:
        keep_in_program_order(declaration.name)
        return

    functional = functional_params(declaration)
    functional_names = [name for name, _ in functional]

    def run_functional(*arguments):
        values = dict(zip(functional_names, arguments))
        fresh = _fresh_outputs(declaration, values, fake=False)
        in_place_values = dict(values)
        for output, tensor in zip(declaration.outputs, fresh):
            empty_optional = output.name in optional and not tensor.numel() and isinstance(output.fresh, Made)
            in_place_values[output.name] = None if empty_optional else tensor
        _run_method(declaration, in_place_values)
        return _result(fresh)

    def fake_functional(*arguments):
        return _result(_fresh_outputs(declaration, dict(zip(functional_names, arguments)), fake=True))

    returns = "Tensor" if len(declaration.outputs) == 1 else f"({', '.join(['Tensor'] * len(declaration.outputs))})"
    op = torch.library.custom_op(f"{NAMESPACE}::{declaration.name}", run_functional, mutates_args=(),
                                 schema=_schema(functional, returns))
    op.register_fake(fake_functional)
    keep_in_program_order(declaration.name)


def keep_in_program_order(name: str) -> None:
    """Give the operator ``torch.ops.iris.<name>`` an ordered effect: compiled graphs keep it in
    program order (a backend's own operators too)."""
    torch.library._register_effectful_op(getattr(torch.ops.iris, name).default,
                                         torch._library.effects.EffectType.ORDERED)


def compiled_call(declaration: Declaration) -> Callable[[Any, tuple, dict], Any]:
    """What the method of ``declaration`` does under ``torch.compile``: ``run(target, args,
    kwargs)`` calls the functional operator with the method's arguments (converted; a tensor in
    :attr:`~Declaration.flattened` flattened), copies each result into the output the method was
    given (reshaped to it; an empty result, or an output of None, copies nothing), and returns
    what the method returns. Plain Python over dicts and tuples, so that Dynamo traces it."""
    positional = [param.name for param in declaration.params if not param.keyword_only]
    defaults = {param.name: param.default for param in declaration.params if param.default is not REQUIRED}
    converts = {param.name: param.convert for param in declaration.params if param.convert is not None}
    operator_names = [name for name, _ in (functional_params(declaration) if declaration.outputs
                                           else _in_place_params(declaration))]
    operator = getattr(torch.ops.iris, declaration.name)

    def run(target, args: tuple, kwargs: dict):
        values = dict(defaults)
        values.update(zip(positional, args))
        values.update(kwargs)
        for name, convert in converts.items():
            values[name] = convert(values[name])
        arguments = []
        for name in operator_names:
            if name == "handle":
                arguments.append(target._iris_handle)
            elif name.startswith("keep_") and name not in values:
                arguments.append(values[name.removeprefix("keep_")] is not None)
            elif name in declaration.flattened:
                arguments.append(values[name].reshape(-1))
            else:
                arguments.append(values[name])
        results = operator(*arguments)
        if not declaration.outputs:
            return None
        if len(declaration.outputs) == 1:
            results = (results,)
        for output, result in zip(declaration.outputs, results):
            destination = values[output.name]
            if destination is not None and result.numel():
                destination.copy_(result.reshape(destination.shape))
        return values[declaration.returns] if declaration.returns else None

    return run


for _declaration in DECLARATIONS.values():
    _register(_declaration)
