"""Saved plans: Plan <-> JSON, and the fingerprint that decides whether a plan fits a model.

A plan file is plain JSON (never pickle) with a schema version. It carries the model's fingerprint: the captured
graph (ops and module paths of every unit, in order), parameter names/shapes/dtypes and input shapes/dtypes. A plan
made on one machine (say, the CLI on a laptop) applies on another without profiling or solving again, as long as the
fingerprint matches; otherwise ``PlanMismatchError`` says what differs. The device is not part of the fingerprint.
Integer and bool inputs also record the range of their values (schema version 3), so that ``plan_inputs.py`` can
rebuild example inputs from the plan alone; the range is not part of what must match. Version 5 adds the plan's
provenance (trace, timing, device) and its memory breakdowns; a file of an older version reads with them None.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import os
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from autockpt.errors import PlanFileError, PlanMismatchError
from autockpt.record_types import ModelFingerprint, PlanRecord, TensorSpec
from autockpt.types import Graph, Unit

SCHEMA = "autockpt.plan"
# 5: the provenance (which trace and timing made the plan, for which device) and the memory breakdowns at the peaks;
# 4: the training loop the budget covers (optimizer step, gradient accumulation); 3: integer inputs' value ranges;
# 2: a policy (per-region actions, placement) and per-action prices; 1: regions and one kind. Versions 2 to 4 read
# as 5 without what they lack (provenance and breakdowns None).
SCHEMA_VERSION = 5
READABLE_VERSIONS = (1, 2, 3, 4, 5)
PlanT = typing.TypeVar("PlanT", bound=PlanRecord)
_MAX_LISTED = 5  # differences listed per kind in a mismatch message


# ------------------------------------------------------------------------------------------------- fingerprint


def model_fingerprint(model: nn.Module, graph: Graph, args: tuple, kwargs: dict) -> ModelFingerprint:
    return ModelFingerprint(
        model_class=f"{type(model).__module__}.{type(model).__qualname__}",
        graph_digest=graph_digest(graph.kind.value, graph.units),
        num_units=len(graph.units),
        parameters=tuple(
            TensorSpec(name=name, shape=tuple(p.shape), dtype=str(p.dtype)) for name, p in model.named_parameters()
        ),
        inputs=input_specs(args, kwargs),
    )


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


# ------------------------------------------------------------------------------------------------------- JSON


def save_plan(plan: Any, path: str | os.PathLike[str], *, schema: str = SCHEMA) -> None:
    """Write a plan record (or another record of plan values: a pipeline plan, ``schema`` says which) as JSON."""
    document = {"schema": schema, "schema_version": SCHEMA_VERSION, "plan": _encode(plan)}
    Path(path).write_text(json.dumps(document, indent=1) + "\n")


def read_plan(path: str | os.PathLike[str], plan_type: type[PlanT], *, schema: str = SCHEMA) -> PlanT:
    """Read a plan file written by ``save_plan`` (``Plan.save``, ``autockpt plan --out``) as ``plan_type``; files of
    schema version 1 (regions and one checkpoint kind) are read as version 2, and versions 2 to 4 as 5 without what
    they lack (the value ranges of integer inputs, the training loop, the provenance and the memory breakdowns)."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise PlanFileError(f"cannot read the plan file {str(path)!r}: {error.strerror or error}") from error
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanFileError(f"{str(path)!r} is not JSON ({error}); give a file written by Plan.save or `autockpt plan --out`") from error
    if not isinstance(document, dict) or document.get("schema") != schema:
        found = document.get("schema") if isinstance(document, dict) else None
        raise PlanFileError(
            f"{str(path)!r} is JSON but not an autockpt plan of this kind: its \"schema\" is {found!r}, expected {schema!r}"
            + (" (a pipeline plan: autockpt.load_pipeline_plan reads it)" if found == "autockpt.pipeline_plan" else "")
            + (" (a single-device plan: autockpt.load_plan reads it)" if found == SCHEMA else "")
        )
    version = document.get("schema_version")
    if version not in READABLE_VERSIONS:
        raise PlanFileError(
            f"{str(path)!r} has plan schema version {version!r}; this autockpt reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}. Make the plan again with this version of autockpt."
        )
    try:
        data = document["plan"]
        return _decode(plan_type, _version_1_as_2(data) if version == 1 else data)
    except (KeyError, TypeError, ValueError) as error:
        raise PlanFileError(f"{str(path)!r} is not a valid autockpt plan: {type(error).__name__}: {error}") from error


def _version_1_as_2(data: Any) -> dict[str, Any]:
    """A version-1 plan's fields in version 2: its regions and single checkpoint kind become a policy on one stage
    (device not recorded in version 1), its machinery costs the kind's price."""
    if not isinstance(data, dict):
        raise TypeError(f"expected an object for the plan, got {type(data).__name__}")
    data = dict(data)
    kind = data.pop("checkpoint_kind", "torch_non_reentrant")
    regions = data.pop("regions")
    data["policy"] = {
        "region_actions": [{"region": region, "action": kind} for region in regions],
        "placement": {"stages": [{"first_unit": 0, "last_unit": len(data.get("nodes", ())) - 1, "device": ""}]},
    }
    data["planned_action"] = kind
    data["prices"] = [{
        "action": kind,
        "region_ms": data.pop("region_overhead_ms", 0.0),
        "saved_tensor_ms": data.pop("saved_tensor_overhead_ms", 0.0),
    }]
    data["nodes"] = [
        {**node, "action": kind} if isinstance(node, dict) and node.get("region") is not None else node
        for node in data.get("nodes", ())
    ]
    return data


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"cannot save the non-finite number {value} in a plan")
    return value


def _decode(annotation: Any, data: Any) -> Any:
    """Build a value of the annotated type from JSON data (dataclasses, enums, tuples, optionals, scalars)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if data is None and type(None) in options:
            return None
        (inner,) = [a for a in options if a is not type(None)]
        return _decode(inner, data)
    if origin is tuple:
        arguments = typing.get_args(annotation)
        if not isinstance(data, list):
            raise TypeError(f"expected a list for {annotation}, got {type(data).__name__}")
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            return tuple(_decode(arguments[0], item) for item in data)
        return tuple(_decode(a, item) for a, item in zip(arguments, data))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation(data)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(data, dict):
            raise TypeError(f"expected an object for {annotation.__name__}, got {type(data).__name__}")
        hints = typing.get_type_hints(annotation)
        known = {f.name for f in dataclasses.fields(annotation)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown fields for {annotation.__name__}: {sorted(unknown)}")
        return annotation(**{name: _decode(hints[name], value) for name, value in data.items()})
    if annotation is float:
        if not isinstance(data, (int, float)) or isinstance(data, bool):
            raise TypeError(f"expected a number, got {data!r}")
        return float(data)
    if annotation in (int, str, bool):
        if type(data) is not annotation:
            raise TypeError(f"expected {annotation.__name__}, got {data!r}")
        return data
    raise TypeError(f"cannot read a value of type {annotation}")
