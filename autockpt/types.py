"""Values passed between the pipeline stages: capture -> profile -> solve -> simulate -> rewrite.

This module is the only contract between stages. Sizes are ``int`` bytes, times are milliseconds or seconds as the
field name says, and positions in the step are *units* (one fx node, or one stretch of a module-level run) and
*events* (one window of the measured memory timeline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd
    import torch
    from torch import nn

# A unit index used for work that happens outside the captured graph (the loss function, autograd's start).
OUTSIDE_GRAPH_UNIT = -1


class CaptureKind(str, Enum):
    """How the model was turned into a sequence of units."""

    FX = "fx"  # torch.fx.symbolic_trace: one unit per torch-level fx node
    EXPORT = "export"  # torch.export.export(strict=False): one unit per aten-level fx node
    MODULE = "module"  # hooks on submodules: one unit per stretch of a module's forward; checkpoint whole modules


class CheckpointKind(str, Enum):
    """Which activation checkpoint runs the planned regions (``rewrite.py``); the simulator follows its semantics."""

    # torch.utils.checkpoint(use_reentrant=False): the recomputation stops at the region's last saved tensor, and
    # the region's backward interleaves with the rest of the graph
    TORCH_NON_REENTRANT = "torch_non_reentrant"
    # autockpt's own (``recompute.py``): nothing passes Python hooks per saved tensor, so it costs less time; the
    # region is re-run whole, and its output gradients stay alive until its backward is done (a little more memory)
    RECOMPUTE_FUNCTION = "recompute_function"


class Decision(str, Enum):
    """What happens to the activations a unit saves for backward."""

    KEEP = "keep"  # saved in forward, held until backward
    RECOMPUTE = "recompute"  # dropped after forward, recomputed in backward inside its checkpoint region


class PlanStatus(str, Enum):
    """How the plan was obtained."""

    IDENTITY = "identity"  # budget at or above the unmodified peak: nothing recomputed
    OPTIMAL = "optimal"  # the solver proved its model optimal and the simulator confirmed the budget
    FEASIBLE = "feasible"  # within budget per the simulator, optimality not proven (time limit or refinement)
    GIVEN = "given"  # regions chosen by the caller (a baseline policy), scored by the simulator, not solved


class Phase(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True, kw_only=True, slots=True)
class Unit:
    """One schedulable step of the forward pass."""

    index: int
    name: str
    op: str
    module_path: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ModuleSpan:
    """The units one call of a submodule covers (inclusive range), for module-level checkpointing."""

    path: str
    first_unit: int
    last_unit: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Graph:
    """Output of capture: something that runs the model as a sequence of units."""

    kind: CaptureKind
    model: nn.Module  # the user's model, never modified
    executable: nn.Module  # fx/export: an fx.GraphModule sharing the model's parameters; module: the model itself
    units: tuple[Unit, ...]
    module_spans: tuple[ModuleSpan, ...]
    notes: tuple[str, ...] = ()  # why earlier capture paths were not used, outputs that had to be dropped
    # the train/eval flag of every submodule (``model.modules()`` order) when captured: fx and export bake the
    # branches that read them (dropout on or off, BatchNorm batch or running statistics) into the graph
    training_modes: tuple[bool, ...] = ()
    # per device type, whether autocast was on and to which dtype: export bakes the casts it made into the graph
    autocast: tuple[tuple[str, bool, torch.dtype], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitCost:
    """Measured cost of one unit in the unmodified step."""

    index: int
    forward_ms: float
    flops: int
    output_bytes: int
    saved_bytes: int  # bytes autograd saves for backward while this unit runs, counted once per storage
    # tensors autograd packs for backward while this unit runs, parameters and repeats included: under checkpoint
    # each one passes the checkpoint's saved-tensor hooks, which is most of what a large region's machinery costs
    saved_tensors: int = 0
    # None: ``forward_ms`` was measured at this unit; else the same unit of an identical block instance, where it was
    forward_ms_timed_at: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class StorageLife:
    """One storage allocated during the forward pass and how it lived in the measured unmodified step."""

    index: int
    nbytes: int
    producer_unit: int
    alloc_event: int
    last_forward_use_event: int
    free_event: int | None  # None: still alive after backward (e.g. part of the model's output)
    user_units: tuple[int, ...]  # units whose ops read this storage in forward
    saver_units: tuple[int, ...]  # units that saved it for backward
    saver_release_events: tuple[int, ...]  # per saver: the last backward event that unpacked it
    mutator_units: tuple[int, ...] = ()  # units whose ops wrote into it in place
    # the event after which the gradients computed for tensors on this storage were gone; None: none was computed,
    # or not recorded (``Profile.gradient_lifetimes``: only the simulation of autockpt's own checkpoint reads it)
    gradient_free_event: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEvent:
    """One window of the measured timeline: a unit's forward, or the backward work after one unpack."""

    index: int
    phase: Phase
    unit: int
    start_bytes: int
    peak_bytes: int
    # forward events: the peak from the event's start up to its last pack of a tensor for backward. A recomputation
    # under checkpoint stops at the pack of the region's last saved tensor, so a region's last saver only gets this
    # far when it re-runs. None: nothing was packed (or a backward event).
    pack_peak_bytes: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """Output of profile: what the unmodified training step costs, per unit and over time."""

    units: tuple[UnitCost, ...]
    storages: tuple[StorageLife, ...]
    events: tuple[MemoryEvent, ...]
    parameter_bytes: int
    buffer_bytes: int
    input_bytes: int
    gradient_bytes: int  # bytes of the parameter gradients one step creates
    baseline_peak_bytes: int  # measured peak of the unmodified step (same definition as autockpt.measure)
    forward_ms: float
    step_ms: float  # forward + backward, median of repeats
    gradient_bytes_by_event: tuple[int, ...] = ()  # per event: bytes of parameter gradients allocated so far
    # the checkpoint machinery on this device, on top of the recomputed kernels (``simulate.machinery_ms``): a fixed
    # cost per region (RNG state, frame and recomputation set-up) plus a cost per tensor the region's units save
    # (non-reentrant torch: a holder in forward, a repack in the recomputation, an unpack in backward)
    region_overhead_ms: float = 0.0
    saved_tensor_overhead_ms: float = 0.0
    checkpoint_kind: CheckpointKind = CheckpointKind.TORCH_NON_REENTRANT  # what the costs above were calibrated on
    # whether ``StorageLife.gradient_free_event`` was recorded (the simulation of autockpt's checkpoint needs it)
    gradient_lifetimes: bool = False

    @property
    def static_bytes(self) -> int:
        """Parameters, buffers, inputs and parameter gradients: memory no plan can remove."""
        return self.parameter_bytes + self.buffer_bytes + self.input_bytes + self.gradient_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class Region:
    """A contiguous run of units executed under one ``torch.utils.checkpoint`` call (inclusive range)."""

    first_unit: int
    last_unit: int

    def __post_init__(self) -> None:
        if self.first_unit < 0 or self.last_unit < self.first_unit:
            raise ValueError(f"Region needs 0 <= first_unit <= last_unit, got {self.first_unit}..{self.last_unit}")

    def __contains__(self, unit: int) -> bool:
        return self.first_unit <= unit <= self.last_unit

    def overlaps(self, other: Region) -> bool:
        return self.first_unit <= other.last_unit and other.first_unit <= self.last_unit


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    """Output of simulate: predicted memory of one training step under a plan."""

    event_bytes: tuple[int, ...]  # predicted peak within each event of the profile's timeline
    burst_bytes: tuple[int, ...]  # per region: predicted peak while it recomputes
    peak_bytes: int
    peak_event: int
    recompute_ms: float
    rerun_units: tuple[int, ...] = ()  # units whose kernels run again in backward (early stop skips a region's tail)
    overhead_ms: float  # predicted added step time: recompute_ms + machinery_ms; what solvers minimise
    machinery_ms: float = 0.0  # the checkpoint machinery's share of overhead_ms (``simulate.machinery_ms``)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryCurve:
    """Predicted bytes of one training step per event, stacked by category; the categories add up to the event's
    predicted peak (``total_bytes``), so ``max(total_bytes)`` is the plan's predicted peak."""

    phases: tuple[Phase, ...]
    parameter_bytes: tuple[int, ...]  # parameters, buffers and inputs
    gradient_bytes: tuple[int, ...]  # parameter gradients made so far in backward
    activation_bytes: tuple[int, ...]  # tensors made in forward still alive (kept for backward, or not yet freed)
    recomputed_bytes: tuple[int, ...]  # copies made by recomputation, and the recomputation's own temporaries
    temporary_bytes: tuple[int, ...]  # everything else: backward temporaries, activation gradients, workspaces

    @property
    def total_bytes(self) -> tuple[int, ...]:
        return tuple(map(sum, zip(self.parameter_bytes, self.gradient_bytes, self.activation_bytes,
                                  self.recomputed_bytes, self.temporary_bytes)))


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorSpec:
    """Name, shape and dtype of a parameter or an input: what a saved plan must match to apply."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "torch.float32"; for a non-tensor input, "python" and ``value`` holds its repr
    value: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFingerprint:
    """What a plan was made for. Applying a plan to a model or inputs with another fingerprint is refused."""

    model_class: str
    graph_digest: str  # sha256 of the captured units' ops and module paths, in order
    num_units: int
    parameters: tuple[TensorSpec, ...]
    inputs: tuple[TensorSpec, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverStats:
    """How the MILP went (the last program solved); zeros when no program was needed."""

    status: str  # PuLP's word for the last program's solution: "Optimal Solution Found", "Solution Found" (not proven
    # optimal, e.g. time limit), "No Solution Found" (time limit, no incumbent), "No Solution Exists" (infeasible)
    relative_gap: float | None  # proven gap of the last program (None when the solver did not say)
    variables: int
    constraints: int
    programs: int  # programs solved: min-peak floor, first solve and budget refinements


@dataclass(frozen=True, kw_only=True, slots=True)
class ParetoPoint:
    """One budget of a sweep: what the plan for it predicts."""

    budget_bytes: int
    predicted_peak_bytes: int | None  # None: infeasible
    predicted_overhead: float | None
    regions: int


@dataclass(frozen=True, kw_only=True, slots=True)
class NodePlan:
    """One row of the plan: a unit, what it costs and what was decided."""

    index: int
    name: str
    op: str
    module_path: str
    saved_bytes: int
    output_bytes: int
    forward_ms: float
    flops: int
    decision: Decision
    region: int | None  # index into Plan.regions, None when not checkpointed
    recompute_ms: float = 0.0  # forward ms run again in backward (0 for the tail a region's early stop skips)
    saved_tensors: int = 0  # tensors autograd saves for this unit (each passes the checkpoint's hooks when recomputed)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What autockpt decided for one model, inputs and budget, with its predictions.

    Bytes are exact integers; ``summary()`` prints them in GB (10^9 bytes) and GiB (2^30 bytes).
    """

    budget_bytes: int
    predicted_peak_bytes: int
    baseline_peak_bytes: int  # predicted (= measured in profiling) peak with nothing recomputed
    min_feasible_bytes: int
    static_bytes: int
    predicted_overhead: float  # (recompute time + checkpoint machinery) / unmodified step time
    recompute_ms: float
    baseline_step_ms: float
    capture: CaptureKind
    status: PlanStatus
    solver: str
    solve_time_s: float
    capture_time_s: float
    profile_time_s: float
    regions: tuple[Region, ...]
    nodes: tuple[NodePlan, ...]
    measured_peak_bytes: int | None = None  # optimize() runs one real step on the example inputs to check the budget
    notes: tuple[str, ...] = field(default=())
    strategy: str = "autockpt"  # "autockpt" for solved plans; a baseline policy's name otherwise
    fingerprint: ModelFingerprint | None = None
    solver_stats: SolverStats | None = None
    memory_before: MemoryCurve | None = None  # predicted step with nothing recomputed
    memory_after: MemoryCurve | None = None  # predicted step under this plan
    pareto: tuple[ParetoPoint, ...] = ()  # other budgets, when the planner was asked for them
    region_overhead_ms: float = 0.0  # measured fixed cost of one checkpointed region (Profile.region_overhead_ms)
    saved_tensor_overhead_ms: float = 0.0  # measured machinery cost per saved tensor (Profile.saved_tensor_overhead_ms)
    machinery_ms: float = 0.0  # predicted checkpoint machinery of all regions: part of predicted_overhead
    checkpoint_kind: CheckpointKind = CheckpointKind.TORCH_NON_REENTRANT  # the checkpoint the rewriter applies

    @property
    def recomputed_units(self) -> tuple[int, ...]:
        return tuple(n.index for n in self.nodes if n.decision is Decision.RECOMPUTE)

    def summary(self) -> str:
        from autockpt.report import plan_summary

        return plan_summary(self)

    def to_dataframe(self) -> pd.DataFrame:
        from autockpt.report import plan_dataframe

        return plan_dataframe(self)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON (schema-versioned, no pickle); ``autockpt.load_plan`` reads it back."""
        from autockpt.plan_io import save_plan

        save_plan(self, path)

    def report(self, path: str | os.PathLike[str], *, depth: int = 2) -> None:
        """Write a self-contained report: HTML when ``path`` ends in .html/.htm, markdown otherwise."""
        from autockpt.report import write_report

        write_report(self, path, depth=depth)

    def __repr__(self) -> str:
        return (
            f"Plan(capture={self.capture.value}, status={self.status.value}, budget_bytes={self.budget_bytes}, "
            f"predicted_peak_bytes={self.predicted_peak_bytes}, baseline_peak_bytes={self.baseline_peak_bytes}, "
            f"regions={len(self.regions)}, predicted_overhead={self.predicted_overhead:.3f})"
        )


def describe_value(value: Any) -> str:
    """Short description of a user-supplied value for error messages."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
