"""How the optimized module takes its inputs: the signature a plan was made for (``input_signature``) and the form
the example call passed them in (``CallForm``), so that a step passing the same values another way keeps the plan."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """What a plan was made for: input structure, tensor shapes/dtypes/devices, other argument values."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    described = tuple(
        (tuple(leaf.shape), leaf.dtype, leaf.device) if isinstance(leaf, torch.Tensor) else repr(leaf) for leaf in leaves
    )
    return (str(spec), described)


class CallForm:
    """How the example call passed its inputs, so that a step passing the same values another way (``input_ids`` by
    keyword instead of positionally, keywords in another order, an explicit default such as ``attention_mask=None``)
    is put back into that form and keeps the plan: the captured graph takes its inputs exactly as the example did."""

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        self.signature = input_signature(args, kwargs)
        self.positional_names: tuple[str, ...] | None = None  # None: calls are taken only in the example's form
        self.keyword_names = tuple(kwargs)
        self.forward_signature = inspect.Signature()
        try:
            self.forward_signature = inspect.signature(model.forward)
            bound = self.forward_signature.bind(*args, **kwargs)
        except (TypeError, ValueError):  # no introspectable signature, or the example does not bind to it
            return
        names = []
        for name in bound.arguments:
            kind = self.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                return  # *args: positions do not map to names
            if kind is not inspect.Parameter.VAR_KEYWORD and name not in kwargs:
                names.append(name)
        self.positional_names = tuple(names)

    @property
    def parameters(self) -> Mapping[str, inspect.Parameter]:
        return self.forward_signature.parameters

    def matches(self, args: tuple, kwargs: dict) -> bool:
        return input_signature(args, kwargs) == self.signature

    def arranged(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The call's values in the example's form, or None when it passes other values (not only another way)."""
        rearranged = self.rearranged(args, kwargs)
        return rearranged if rearranged is not None and self.matches(*rearranged) else None

    def rearranged(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The call's values passed as the example passed its own (each argument positionally or by keyword, left-out
        ones at their defaults), whatever the values are; None when the call passes an argument the example did not
        (other than at its default) or leaves out one without a default."""
        values = self.named_values(args, kwargs)
        if values is None:
            return None
        wanted = set(self.positional_names) | set(self.keyword_names)
        for name, value in values.items():
            if name not in wanted and not self.is_default(name, value):
                return None  # a value the example did not pass: the graph has no input for it
        for name in wanted - values.keys():
            if name not in self.parameters or self.parameters[name].default is inspect.Parameter.empty:
                return None
            values[name] = self.parameters[name].default
        return tuple(values[n] for n in self.positional_names), {n: values[n] for n in self.keyword_names}

    def named_values(self, args: tuple, kwargs: dict) -> dict[str, Any] | None:
        """Every value the call passes, by parameter name (``**kwargs`` entries by their own names); None when calls
        are taken only in the example's form or this one does not bind to the signature."""
        if self.positional_names is None:
            return None
        try:
            bound = self.forward_signature.bind(*args, **kwargs)
        except TypeError:
            return None
        values: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = self.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                return None
            if kind is inspect.Parameter.VAR_KEYWORD:
                values.update(value)
            else:
                values[name] = value
        return values

    def is_default(self, name: str, value: Any) -> bool:
        """``value`` is ``name``'s default, so passing it or leaving it out is the same call."""
        parameter = self.parameters.get(name)
        if parameter is None or parameter.default is inspect.Parameter.empty:
            return False
        default = parameter.default
        return value is default or (not isinstance(value, torch.Tensor) and type(value) is type(default) and value == default)
