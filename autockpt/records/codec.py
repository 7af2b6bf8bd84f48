"""Plan files: one codec for every kind of plan (``Plan``, ``PipelinePlan``, ``FSDPPlan``).

A plan file is plain JSON, never pickle::

    {"schema": "autockpt.plan" | "autockpt.pipeline_plan" | "autockpt.fsdp_plan", "schema_version": 9, "plan": {...}}

``plan`` holds the record's dataclass fields as they are (enums by value, tuples as lists); a reader builds the
record back from its type hints and refuses a field the type does not have. One version number covers every kind:
a change to any record's fields is a new ``SCHEMA_VERSION``, and every older file still loads:

* single-device plans: 1 regions and one checkpoint kind (read as a policy on one stage); 2 a policy and per-action
  prices; 3 integer inputs' value ranges; 4 the training loop the budget covers; 5 provenance and memory breakdowns.
  Versions 2 to 5 read without what they lack;
* pipeline plans (from version 4): the same numbers (their stage plans are single-device plans);
* FSDP plans, before 0.3: their own layout, ``{"schema": "autockpt.fsdp_plan", "version": 1 to 4, <fields>}``
  (1 whole units only; 2 selective units; 3 offloaded units; 4 checkpointed parts), with a 32-hex digest of the
  parameters and units instead of a ``ModelFingerprint`` (kept as ``FSDPPlan.parameter_digest``);
* 6 (0.3): every kind in this layout, FSDP plans with a ``ModelFingerprint``;
* 7: a plan's ``floor_breakdown`` (what its floor's peak holds) and each breakdown's ``moment`` (where in the step).
  Versions 2 to 6 read as 7 without them.
* 8: a plan's ``loss_chunk_tokens`` (the loss computed in chunks of tokens; 0 in older files: not chunked).
* 9: a pipeline stage's ``with_loss`` (the last stage planned with its loss function; False in older files) and
  an FSDP plan's ``loss_projection`` and ``loss_chunk_tokens`` (the root's loss in chunks; "" and 0 before).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any

from autockpt.errors import PlanFileError

SCHEMA_VERSION = 9
PLAN_SCHEMA = "autockpt.plan"
PIPELINE_SCHEMA = "autockpt.pipeline_plan"
FSDP_SCHEMA = "autockpt.fsdp_plan"
RecordT = typing.TypeVar("RecordT")


@dataclasses.dataclass(frozen=True, slots=True)
class RecordKind:
    """One kind of plan file: what its ``schema`` key says, how a person calls it, what writes and reads it, and
    which versions load (fields a version lacks take their defaults; the two older layouts, single-device plans of
    version 1 and FSDP plans of 0.2, are brought to the current one as they are read)."""

    schema: str
    called: str  # "a single-device plan"
    writer: str  # "Plan.save"
    loader: str  # "autockpt.load_plan"
    versions: tuple[int, ...]


KINDS = {
    kind.schema: kind for kind in (
        RecordKind(PLAN_SCHEMA, "a single-device plan", "Plan.save", "autockpt.load_plan",
                   (1, 2, 3, 4, 5, 6, 7, 8, SCHEMA_VERSION)),
        # pipeline plans came with version 4
        RecordKind(PIPELINE_SCHEMA, "a pipeline plan", "PipelinePlan.save", "autockpt.load_pipeline_plan",
                   (4, 5, 6, 7, 8, SCHEMA_VERSION)),
        RecordKind(FSDP_SCHEMA, "an FSDP plan", "FSDPPlan.save", "autockpt.load_fsdp_plan", (6, 7, 8, SCHEMA_VERSION)),
    )
}
LEGACY_FSDP_VERSIONS = (1, 2, 3, 4)  # FSDP plans of 0.2: key "version", fields at the top level


def save_record(record: Any, path: str | os.PathLike[str], schema: str) -> Path:
    """Write ``record`` (a plan dataclass) as a plan file of kind ``schema``."""
    document = {"schema": KINDS[schema].schema, "schema_version": SCHEMA_VERSION, "plan": encode(record)}
    path = Path(path)
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def read_record(path: str | os.PathLike[str], record_type: type[RecordT], schema: str) -> RecordT:
    """Read a plan file of kind ``schema`` as ``record_type``, from any version this autockpt reads."""
    kind = KINDS[schema]
    document = _document(path, kind)
    version, data = _versioned_data(path, document, kind)
    try:
        if kind.schema == PLAN_SCHEMA and version == 1:  # regions and one kind: as the policy of version 2
            data = _version_1_as_2(data)
        return decode(record_type, data)
    except (KeyError, TypeError, ValueError) as error:
        raise PlanFileError(
            f"{str(path)!r} is not a valid autockpt plan ({kind.called}): {type(error).__name__}: {error}; make the "
            "plan again with this version of autockpt"
        ) from error


def _document(path: str | os.PathLike[str], kind: RecordKind) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise PlanFileError(f"cannot read the plan file {str(path)!r}: {error.strerror or error}") from error
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanFileError(
            f"{str(path)!r} is not JSON ({error}); give a file written by {kind.writer}"
        ) from error
    found = document.get("schema") if isinstance(document, dict) else None
    if found != kind.schema:
        other = KINDS.get(found) if isinstance(found, str) else None
        raise PlanFileError(
            f"{str(path)!r} is JSON but not {kind.called}: its \"schema\" is {found!r}, expected {kind.schema!r}"
            + (f" ({other.called}: {other.loader} reads it)" if other is not None else "")
        )
    return document


def _versioned_data(path: str | os.PathLike[str], document: dict[str, Any], kind: RecordKind) -> tuple[int, Any]:
    """The file's version and its record's data, a 0.2 FSDP file brought to the one layout."""
    if kind.schema == FSDP_SCHEMA and "schema_version" not in document and "version" in document:
        version = document["version"]
        if version not in LEGACY_FSDP_VERSIONS:
            raise PlanFileError(
                f"{str(path)!r} has FSDP plan version {version!r}; this autockpt reads FSDP plans of versions "
                f"{', '.join(map(str, LEGACY_FSDP_VERSIONS))} (0.2) and schema versions {', '.join(map(str, kind.versions))}: "
                "plan again"
            )
        return SCHEMA_VERSION, _legacy_fsdp_as_current(path, document)
    version = document.get("schema_version")
    if version not in kind.versions:
        raise PlanFileError(
            f"{str(path)!r} has plan schema version {version!r}; this autockpt reads {kind.called} of versions "
            f"{', '.join(map(str, kind.versions))}. Make the plan again with this version of autockpt."
        )
    if "plan" not in document:
        raise PlanFileError(f"{str(path)!r} is not a valid autockpt plan ({kind.called}): it has no \"plan\" field")
    return version, document["plan"]


def _legacy_fsdp_as_current(path: str | os.PathLike[str], document: dict[str, Any]) -> dict[str, Any]:
    """A 0.2 FSDP plan's fields in the current layout: breakdowns as (category, bytes) pairs, its parameter digest
    kept (``FSDPPlan.parameter_digest``) where it had no ``ModelFingerprint``; fields a version lacked take their
    defaults (nothing selective, offloaded or in parts)."""
    data = {key: value for key, value in document.items() if key not in ("schema", "version")}
    try:
        data["parameter_digest"] = data.pop("fingerprint")
        data["ranks"] = [
            {**rank, "breakdown": _pairs(rank["breakdown"]),
             "timeline": [{**point, "breakdown": _pairs(point["breakdown"])} for point in rank.get("timeline", ())]}
            for rank in data["ranks"]
        ]
    except (KeyError, AttributeError, TypeError) as error:
        raise PlanFileError(
            f"{str(path)!r} is an FSDP plan of 0.2 with a missing or wrong field ({type(error).__name__}: {error}): "
            "plan again"
        ) from error
    return data


def _pairs(breakdown: dict[str, int]) -> list[list[Any]]:
    return [[category, nbytes] for category, nbytes in breakdown.items()]


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


def encode(value: Any) -> Any:
    """A record as JSON values: dataclasses as objects of their fields, enums by value, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [encode(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"cannot save the non-finite number {value} in a plan")
    return value


def decode(annotation: Any, data: Any) -> Any:
    """Build a value of the annotated type from JSON data (dataclasses, enums, tuples, optionals, scalars)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if data is None and type(None) in options:
            return None
        (inner,) = [a for a in options if a is not type(None)]
        return decode(inner, data)
    if origin is tuple:
        arguments = typing.get_args(annotation)
        if not isinstance(data, list):
            raise TypeError(f"expected a list for {annotation}, got {type(data).__name__}")
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            return tuple(decode(arguments[0], item) for item in data)
        return tuple(decode(a, item) for a, item in zip(arguments, data))
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
        return annotation(**{name: decode(hints[name], value) for name, value in data.items()})
    if annotation is float:
        if not isinstance(data, (int, float)) or isinstance(data, bool):
            raise TypeError(f"expected a number, got {data!r}")
        return float(data)
    if annotation in (int, str, bool):
        if type(data) is not annotation:
            raise TypeError(f"expected {annotation.__name__}, got {data!r}")
        return data
    raise TypeError(f"cannot read a value of type {annotation}")
