"""The fingerprint that decides whether a plan fits a model: one rule for every kind of plan.

Every plan (``Plan``, ``PipelinePlan``, ``FSDPPlan``) carries a ``ModelFingerprint``: the captured graph (ops and module
paths of every unit, in order), parameter names/shapes/dtypes and input shapes/dtypes. A plan made on one machine
(say, the CLI on a laptop) applies on another without profiling or solving again, as long as the fingerprint matches;
otherwise ``PlanMismatchError`` says what differs. The device is not part of the fingerprint. What is compared is what
the applier can know: a plan applied with inputs compares all three (``check_fingerprint``); ``apply_fsdp``, given a
model and no inputs, compares the parameters (``check_parameters``), by the same comparison. Integer and bool inputs
also record the range of their values, so that ``plan_inputs.py`` can rebuild example inputs from the plan alone;
the range is not part of what must match.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from autockpt.errors import PlanMismatchError
from autockpt.record_types import ModelFingerprint, PlanRecord, TensorSpec
from autockpt.types import Graph, Unit

_MAX_LISTED = 5  # differences listed per kind in a mismatch message


# ------------------------------------------------------------------------------------------------- fingerprint


def model_fingerprint(model: nn.Module, graph: Graph, args: tuple, kwargs: dict) -> ModelFingerprint:
    return ModelFingerprint(
        model_class=model_class(model),
        graph_digest=graph_digest(graph.kind.value, graph.units),
        num_units=len(graph.units),
        parameters=parameter_specs(model),
        inputs=input_specs(args, kwargs),
    )


def model_class(model: nn.Module) -> str:
    return f"{type(model).__module__}.{type(model).__qualname__}"


def parameter_specs(model: nn.Module) -> tuple[TensorSpec, ...]:
    """Names, shapes and dtypes of the parameters (no values, no devices: a meta model's are its real self's)."""
    return tuple(TensorSpec(name=name, shape=tuple(p.shape), dtype=str(p.dtype)) for name, p in model.named_parameters())


def graph_digest(capture_kind: str, units: Sequence[Unit]) -> str:
    text = "\n".join([capture_kind, *(f"{u.op}\t{u.module_path}" for u in units)])
    return hashlib.sha256(text.encode()).hexdigest()


def input_specs(args: tuple, kwargs: dict) -> tuple[TensorSpec, ...]:
    """One spec per input leaf, named by its path: ``args[0]``, ``kwargs['input_ids']``; integer and bool tensors with
    the range of their values."""
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    specs = []
    for path, leaf in leaves:
        name = pytree.keystr(path)
        name = "args" + name[3:] if name.startswith("[0]") else "kwargs" + name[3:]
        if isinstance(leaf, torch.Tensor):
            specs.append(TensorSpec(
                name=name, shape=tuple(leaf.shape), dtype=str(leaf.dtype), value_range=_value_range(leaf),
            ))
        else:
            text = repr(leaf)
            specs.append(TensorSpec(name=name, shape=(), dtype="python", value=text[:200]))
    return tuple(specs)


def is_integral(dtype: torch.dtype) -> bool:
    """Integer and bool dtypes (not quantized ones): the inputs whose values are recorded as a range."""
    return not (dtype.is_floating_point or dtype.is_complex or str(dtype).startswith(("torch.qint", "torch.quint")))


def _value_range(tensor: torch.Tensor) -> tuple[int, int] | None:
    if not is_integral(tensor.dtype) or tensor.numel() == 0 or tensor.device.type == "meta":
        return None
    if isinstance(tensor, FakeTensor):  # a fake has no values to record (inputs given as fakes, for a fake trace)
        return None
    return int(tensor.min()), int(tensor.max())


def check_fingerprint(plan: PlanRecord, actual: ModelFingerprint, units: Sequence[Unit]) -> None:
    """Raise PlanMismatchError listing what differs between the plan's fingerprint and the model's."""
    expected = plan.fingerprint
    if expected is None:
        raise PlanMismatchError(
            "this plan carries no model fingerprint, so autockpt cannot tell whether it fits the model; make the plan "
            "with autockpt.records.plan / autockpt.Planner (or the autockpt CLI) and apply that one"
        )
    differences = _spec_differences("parameter", expected.parameters, actual.parameters)
    differences += _spec_differences("input", expected.inputs, actual.inputs)
    if expected.graph_digest != actual.graph_digest:
        differences.append(_graph_difference(plan, expected, actual, units))
    if differences:
        listed = "\n  ".join(differences)
        raise PlanMismatchError(
            f"the plan was made for another model or other inputs ({expected.model_class}, {expected.num_units} units; "
            f"given {actual.model_class}, {actual.num_units} units):\n  {listed}\n"
            "Make a new plan for this model and inputs (autockpt.records.plan or `autockpt plan`), or pass example inputs "
            "with the shapes and dtypes the plan was made for."
        )


def check_parameters(expected: ModelFingerprint, model: nn.Module, remedy: str) -> None:
    """Raise PlanMismatchError listing the parameters of ``model`` that differ from the plan's (names, shapes,
    dtypes): the part of the fingerprint an applier without inputs can check. ``remedy`` says what to do."""
    differences = _spec_differences("parameter", expected.parameters, parameter_specs(model))
    if differences:
        listed = "\n  ".join(differences)
        raise PlanMismatchError(
            f"the plan was made for another model ({expected.model_class}; given {model_class(model)}):\n  {listed}\n"
            + remedy
        )


def _spec_differences(kind: str, expected: Sequence[TensorSpec], actual: Sequence[TensorSpec]) -> list[str]:
    plan_specs = {s.name: s for s in expected}
    model_specs = {s.name: s for s in actual}
    found = []
    missing = [name for name in plan_specs if name not in model_specs]
    extra = [name for name in model_specs if name not in plan_specs]
    if missing:
        found.append(f"{kind}s in the plan but not given: {', '.join(missing[:_MAX_LISTED])}"
                     + (f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""))
    if extra:
        found.append(f"{kind}s given but not in the plan: {', '.join(extra[:_MAX_LISTED])}"
                     + (f" and {len(extra) - _MAX_LISTED} more" if len(extra) > _MAX_LISTED else ""))
    changed = [
        f"{kind} {name}: plan {describe_spec(plan_specs[name])}, given {describe_spec(model_specs[name])}"
        for name in plan_specs
        if name in model_specs and _must_match(plan_specs[name]) != _must_match(model_specs[name])
    ]
    found += changed[:_MAX_LISTED]
    if len(changed) > _MAX_LISTED:
        found.append(f"... and {len(changed) - _MAX_LISTED} more {kind}s with other shapes or dtypes")
    return found


def _must_match(spec: TensorSpec) -> TensorSpec:
    """The spec without its value range: inputs with other values (other token ids) fit the plan."""
    return dataclasses.replace(spec, value_range=None)


def describe_spec(spec: TensorSpec) -> str:
    """``int64[4, 64]``, or ``value 'mean'`` for a non-tensor input."""
    if spec.dtype == "python":
        return f"value {spec.value}"
    return f"{spec.dtype.removeprefix('torch.')}{list(spec.shape)}"


def _graph_difference(plan: PlanRecord, expected: ModelFingerprint, actual: ModelFingerprint, units: Sequence[Unit]) -> str:
    for node, unit in zip(plan.nodes, units):
        if (node.op, node.module_path) != (unit.op, unit.module_path):
            return (
                f"captured graph: {expected.num_units} units in the plan, {actual.num_units} here; first difference "
                f"at unit {node.index}: plan {node.op} in '{node.module_path}', here {unit.op} in '{unit.module_path}'"
            )
    if expected.num_units != actual.num_units:
        return f"captured graph: {expected.num_units} units in the plan, {actual.num_units} here (same up to unit {min(expected.num_units, actual.num_units)})"
    return f"captured graph: same ops, but captured another way (plan: {plan.capture.value})"
