"""Example inputs for applying a saved plan: rebuilt from the inputs the plan records, or the given ones passed as the
plan recorded them.

A plan's fingerprint names every input leaf by its path (``args[0]``, ``kwargs['input_ids']``, ``args[1]['mask']``)
with its shape and dtype, integer and bool tensors with the range of their values (plan files of schema version 3),
other values by their repr. That is enough to run the model once for capturing: floating tensors are drawn from a
normal distribution, integer tensors uniformly in the recorded range (token ids stay below the vocabulary size),
values read back with ``ast.literal_eval``. Nested containers are rebuilt as tuples (integer keys) and dicts.

Given inputs are rearranged by the model's forward signature into the plan's form (``call_form.CallForm``): the same
tensors apply positionally or by keyword, as the optimized module takes them.
"""

from __future__ import annotations

import ast
import logging
import re
from typing import Any

import torch
from torch import nn

from autockpt.errors import PlanMismatchError
from autockpt.measure.trace import device_of
from autockpt.record_types import PlanRecord, TensorSpec
from autockpt.records.fingerprint import describe_spec, is_integral
from autockpt.runtime.call_form import CallForm

logger = logging.getLogger(__name__)

_SEED = 0  # rebuilt inputs are the same on every call, and the caller's RNG is left as it was
_REPR_LIMIT = 200  # input_specs keeps this many characters of a value's repr: a longer one may be cut off
_ROOT = re.compile(r"(args|kwargs)")
_NOT_READ = object()
_KEY = re.compile(r"\[(\d+|'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\]")  # one pytree.keystr step: [0], ['ids']


def recorded_inputs(model: nn.Module, plan: PlanRecord, *, unranged_as_zeros: bool = False) -> tuple[tuple, dict]:
    """Positional and keyword example inputs with the shapes, dtypes and values the plan records, on the device of
    the model's parameters. Raises ``ValueError`` naming every input that cannot be rebuilt. ``unranged_as_zeros``:
    integer inputs the plan records no range of values for (traced on fakes) are zeros, for a caller that only
    captures on them (a fingerprint compares no ranges)."""
    if plan.fingerprint is None:
        raise PlanMismatchError(
            "this plan carries no model fingerprint, so it records no inputs to rebuild and autockpt cannot tell "
            "whether it fits the model; make the plan with autockpt.records.plan / autockpt.Planner (or the autockpt CLI)"
        )
    # a model that is no module gets inputs on the CPU, and apply_plan's check of its arguments then refuses it
    device = device_of(model, (), {}) if isinstance(model, nn.Module) else torch.device("cpu")
    generator = torch.Generator().manual_seed(_SEED)
    leaves: list[tuple[tuple[Any, ...], Any]] = []
    problems = []
    for spec in plan.fingerprint.inputs:
        path = _path(spec.name)
        try:
            if path is None:
                raise ValueError("its path is not one autockpt can rebuild (an attribute of an object?)")
            leaves.append((path, _value(spec, generator, device, unranged_as_zeros)))
        except ValueError as error:
            problems.append(f"{spec.name} ({describe_spec(spec)}): {error}")
    if not problems:
        try:
            return _assembled(leaves)
        except ValueError as error:
            problems.append(str(error))
    listed = "\n  ".join(problems)
    raise ValueError(
        f"apply_plan was given no example inputs, and the plan's recorded inputs cannot all be rebuilt:\n  {listed}\n"
        "Pass the inputs the plan was made for: autockpt.apply_plan(model, plan, example_inputs=(...), "
        "example_kwargs={...})."
    )


def in_recorded_form(model: nn.Module, plan: PlanRecord, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` passed as the plan recorded its inputs (each argument positionally or by keyword, by
    the model's forward signature); as given when they do not fit that form (the fingerprint check then says what
    differs) or the plan records none."""
    if plan.fingerprint is None:
        return args, kwargs
    paths = [_path(spec.name) for spec in plan.fingerprint.inputs]
    if any(path is None for path in paths):
        return args, kwargs
    positions = {path[1] for path in paths if path[0] == "args"}
    keywords = dict.fromkeys(path[1] for path in paths if path[0] == "kwargs")
    if positions != set(range(len(positions))):
        return args, kwargs
    # the values do not matter: the form is which arguments are passed, and how
    form = CallForm(model, (None,) * len(positions), keywords)
    rearranged = form.rearranged(args, kwargs)
    if rearranged is None:
        return args, kwargs
    if len(rearranged[0]) != len(args) or list(rearranged[1]) != list(kwargs):
        logger.info(
            "apply_plan: example inputs passed as the plan recorded them (%d positional, keywords %s)",
            len(rearranged[0]), list(rearranged[1]),
        )
    return rearranged


def _path(name: str) -> tuple[Any, ...] | None:
    """``kwargs['x'][0]`` -> ``("kwargs", "x", 0)``; None for a path of other steps (``.attribute``)."""
    root = _ROOT.match(name)
    if root is None:
        return None
    path: list[Any] = [root.group(1)]
    position = root.end()
    while position < len(name):
        step = _KEY.match(name, position)
        if step is None:
            return None
        path.append(ast.literal_eval(step.group(1)))
        position = step.end()
    return tuple(path) if len(path) > 1 else None


def _value(spec: TensorSpec, generator: torch.Generator, device: torch.device, unranged_as_zeros: bool) -> Any:
    if spec.dtype == "python":
        return _literal(spec.value)
    dtype = _dtype(spec.dtype)
    if dtype is None:
        raise ValueError(f"unknown dtype {spec.dtype!r}")
    if dtype.is_complex:
        return torch.randn(spec.shape, generator=generator, dtype=dtype).to(device)
    if dtype.is_floating_point:
        return torch.randn(spec.shape, generator=generator).to(device=device, dtype=dtype)
    if not is_integral(dtype):
        raise ValueError(f"autockpt does not rebuild {spec.dtype} tensors")
    if spec.value_range is None:
        if 0 in spec.shape or unranged_as_zeros:
            return torch.zeros(spec.shape, dtype=dtype, device=device)
        raise ValueError(
            "the plan records no range of its values (a plan file of schema version 2 or older); make the plan again "
            "with this autockpt to record it"
        )
    low, high = spec.value_range
    # randint's upper bound is exclusive and an int64
    drawn = torch.randint(low, min(high + 1, torch.iinfo(torch.int64).max), spec.shape, generator=generator)
    return drawn.to(device=device, dtype=dtype)


def _dtype(text: str) -> torch.dtype | None:
    """``"torch.int64"`` -> ``torch.int64``; None for a name torch does not have."""
    found = getattr(torch, text.removeprefix("torch."), None)
    return found if isinstance(found, torch.dtype) else None


def _literal(text: str) -> Any:
    """The value whose repr the plan recorded, when the repr reads back as that value (None, numbers, strings, ...)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        value = _NOT_READ
    if value is _NOT_READ or len(text) >= _REPR_LIMIT or repr(value) != text:  # a repr cut short may still read
        raise ValueError(
            "its recorded repr is not a Python literal that reads back as the same value (only None, numbers, "
            "strings and tuples of them are rebuilt)"
        )
    return value


def _assembled(leaves: list[tuple[tuple[Any, ...], Any]]) -> tuple[tuple, dict]:
    """Positional and keyword arguments holding each leaf at its path."""
    root: dict[Any, Any] = {"args": {}, "kwargs": {}}
    for path, value in leaves:
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    args = _container(root["args"], "args")
    kwargs = _container(root["kwargs"], "kwargs")
    assert isinstance(args, tuple) and isinstance(kwargs, dict)
    return args, kwargs


def _container(node: dict[Any, Any], where: str) -> tuple | dict:
    """A node of ``_assembled``'s tree as a tuple (keys 0..n-1) or a dict (string keys)."""
    built = {key: _container(child, f"{where}[{key!r}]") if isinstance(child, dict) else child
             for key, child in node.items()}
    if where == "kwargs":
        return built
    if all(isinstance(key, int) for key in built):
        if sorted(built) != list(range(len(built))):
            raise ValueError(
                f"{where}: the plan records items {sorted(built)} only (an empty container in between has no leaf to "
                "record), so their positions cannot be rebuilt"
            )
        return tuple(built[i] for i in range(len(built)))
    return built
