"""Values passed between the pipeline stages: capture -> trace -> costs -> simulate -> solve -> policy -> rewrite.

This module is the only contract between stages. Sizes are ``int`` bytes, times are milliseconds or seconds as the
field name says, and positions in the step are *units* (one fx node, or one stretch of a module-level run) and
*events* (one window of the measured memory timeline). What a plan records of them (``PlanRecord`` and its parts,
the pipeline plan's stage records) is in ``record_types.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

# A unit index used for work that happens outside the captured graph (the loss function, autograd's start).
OUTSIDE_GRAPH_UNIT = -1


class CaptureKind(str, Enum):
    """How the model was turned into a sequence of units."""

    FX = "fx"  # torch.fx.symbolic_trace: one unit per torch-level fx node
    EXPORT = "export"  # torch.export.export(strict=False): one unit per aten-level fx node
    MODULE = "module"  # hooks on submodules: one unit per stretch of a module's forward; checkpoint whole modules


class Action(str, Enum):
    """What happens to the tensors one region saves for backward (in the spirit of
    ``torch.utils.checkpoint.CheckpointPolicy``). A unit in no region keeps them (autograd holds them until backward).

    Each action has a runtime (``recompute.py``), a price in the cost model (``costs.py``) and a storage-lifetime rule
    in the simulator (``simulate.py``).
    """

    # torch.utils.checkpoint(use_reentrant=False): the recomputation stops at the region's last saved tensor, and
    # the region's backward interleaves with the rest of the graph
    RECOMPUTE_TORCH = "torch_non_reentrant"
    # autockpt's own (``recompute.py``): nothing passes Python hooks per saved tensor, so it costs less time; the
    # region is re-run whole, and its output gradients stay alive until its backward is done (a little more memory)
    RECOMPUTE_OWN = "recompute_function"
    # what the region saves is copied into a bounded host pool after it is packed and brought back before the
    # region's backward (``offload.py``): link time instead of recompute time, host memory instead of device memory
    OFFLOAD = "offload"

    @property
    def recomputes(self) -> bool:
        return self in (Action.RECOMPUTE_TORCH, Action.RECOMPUTE_OWN)


class Decision(str, Enum):
    """What happens to the activations a unit saves for backward."""

    KEEP = "keep"  # saved in forward, held until backward
    RECOMPUTE = "recompute"  # dropped after forward, recomputed in backward inside its checkpoint region
    OFFLOAD = "offload"  # moved to the host pool after forward, brought back before backward


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
class GradientVersion:
    """The gradient backward computed for one version of a forward storage: the version a unit wrote (made it, or
    changed it in place: an in-place ReLU's output shares its input's storage, and each has its own gradient)."""

    writer_unit: int
    free_event: int  # the event after which it was gone (the last event: alive to the end)
    # the highest live bytes of ``free_event`` after it was freed (the rest of the event, without it): a checkpoint
    # that holds it longer raises the event to this plus its bytes. None: never freed
    late_peak_bytes: int | None


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
    # or not recorded (``StepTrace.gradient_lifetimes``: only the simulation of autockpt's own checkpoint reads it)
    gradient_free_event: int | None = None
    gradient_versions: tuple[GradientVersion, ...] = ()  # per version written (recorded with gradient_free_event)


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
class OptimizerStepCost:
    """What ``optimizer.step()`` holds on the device, measured on the model's own parameter shapes (``loop.py``).

    The ``*_extra_bytes`` are above the parameters and gradients at that step's peak: the states (made during the
    first step, kept after) and the temporaries of the implementation that ran (for-loop, foreach or fused).
    """

    optimizer: str  # its class and implementation, e.g. "AdamW (foreach)"
    state_bytes: int  # kept on the device between steps once the first step made them
    first_step_extra_bytes: int
    later_step_extra_bytes: int

    @property
    def step_extra_bytes(self) -> int:
        """The larger of the first and a later step's extra bytes: what the step needs at most."""
        return max(self.first_step_extra_bytes, self.later_step_extra_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingLoop:
    """The loop around forward and backward that a plan keeps its budget in (``loop.py`` raises the trace for it).

    ``gradient_accumulation_steps`` > 1: every micro-step after a window's first starts with the gradients of the
    ones before it alive (as does a loop that zeroes gradients in place instead of setting them to None).
    """

    optimizer: OptimizerStepCost | None = None  # None: no optimizer step in the budget
    gradient_accumulation_steps: int = 1
    # False: the loop drops the model's output before backward (Hugging Face's Trainer, torchtitan's ``del pred``,
    # ``model(**batch).loss.backward()``); True: it holds it through backward and the optimizer step
    output_held: bool = True

    @property
    def gradients_at_start(self) -> bool:
        return self.gradient_accumulation_steps > 1

    def describe(self) -> str:
        parts = []
        if self.optimizer is not None:
            parts.append(
                f"optimizer.step() of {self.optimizer.optimizer} ({self.optimizer.state_bytes} bytes of states, "
                f"{self.optimizer.step_extra_bytes} bytes above parameters and gradients at its peak)"
            )
        if not self.output_held:
            parts.append("the model's output dropped before backward")
        if self.gradients_at_start:
            parts.append(
                f"gradients alive when a step starts (gradient accumulation over {self.gradient_accumulation_steps} "
                "micro-steps)"
            )
        return "the budget covers " + " and ".join(parts) if parts else "the budget covers forward and backward"


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTrace:
    """Output of trace: what the unmodified training step was measured to do, per unit and over time.

    Measurements only: what each action would cost on top of them is the ``CostModel``'s (``costs.py``).
    """

    units: tuple[UnitCost, ...]
    storages: tuple[StorageLife, ...]
    events: tuple[MemoryEvent, ...]
    parameter_bytes: int
    buffer_bytes: int
    input_bytes: int
    gradient_bytes: int  # bytes of the parameter gradients one step creates
    baseline_peak_bytes: int  # measured peak of the unmodified step (same definition as autockpt.measure.step)
    forward_ms: float
    step_ms: float  # forward + backward, median of repeats
    gradient_bytes_by_event: tuple[int, ...] = ()  # per event: bytes of parameter gradients allocated so far
    # whether ``StorageLife.gradient_free_event`` was recorded (the simulation of RECOMPUTE_OWN needs it)
    gradient_lifetimes: bool = False
    # what the training loop keeps on the device across steps (``loop.step_in_loop``): optimizer states; 0 for the
    # bare forward + backward
    optimizer_state_bytes: int = 0
    loop: TrainingLoop | None = None  # the loop the events were raised for; None: the bare step, gradients None
    # bytes on the device that the step does not own (other models, a cache, the user's leftover tensors, kernel
    # workspaces), alive through the step and counted in every event: on CUDA what was allocated beyond the step's
    # own tensors when the trace was taken, until ``loop.with_foreign_bytes`` moves it to a later reading
    foreign_bytes: int = 0
    # False: the unit and step times are placeholders (``measure.fake.FakeTrace``: fake tensors take no time; 0, or
    # FLOP-proportional at a given rate); True: measured on the step, benchmarked op by op, or a device's roofline
    times_measured: bool = True

    @property
    def static_bytes(self) -> int:
        """Parameters, buffers, inputs, parameter gradients and optimizer states: memory no plan can remove."""
        return (
            self.parameter_bytes + self.buffer_bytes + self.input_bytes + self.gradient_bytes
            + self.optimizer_state_bytes
        )


# The name of the measured step before the cost model was split off it (issue 20).


@dataclass(frozen=True, kw_only=True, slots=True)
class ActionPrice:
    """What one action adds to a step on one device, on top of the kernels it re-runs: a fixed cost per region
    (RNG state, frame and recomputation set-up) plus a cost per tensor the region's units save (torch's checkpoint:
    a holder in forward, a repack in the recomputation, an unpack in backward)."""

    action: Action
    region_ms: float
    saved_tensor_ms: float


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkPrice:
    """The link between the device and host memory, measured on the machine (``costs.calibrate_link``): what moving
    a storage of n bytes costs one way, ``latency_ms + n / (GB/s * 1e6)`` ms (GB = 10^9 bytes)."""

    device_to_host_gb_per_s: float
    host_to_device_gb_per_s: float
    latency_ms: float  # per storage moved, each way
    overlaps_compute: bool  # copies run on their own streams beside the compute (CUDA); False: synchronous (CPU)

    def device_to_host_ms(self, nbytes: int) -> float:
        return self.latency_ms + nbytes / (self.device_to_host_gb_per_s * 1e6)

    def host_to_device_ms(self, nbytes: int) -> float:
        return self.latency_ms + nbytes / (self.host_to_device_gb_per_s * 1e6)


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """Output of costs: the price of each action on the device the step runs on, calibrated there."""

    device: str
    prices: tuple[ActionPrice, ...]
    link: LinkPrice | None = None  # measured when a plan may offload (a host pool was asked for)

    def price(self, action: Action) -> ActionPrice:
        for price in self.prices:
            if price.action is action:
                return price
        raise ValueError(
            f"the cost model for {self.device} has no price for {action.value!r} (it has "
            f"{[p.action.value for p in self.prices]}); calibrate it with costs.calibrate(device, actions)"
        )

    @property
    def actions(self) -> tuple[Action, ...]:
        return tuple(p.action for p in self.prices)


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
class RegionAction:
    """One region of a policy and what happens to the tensors its units save for backward."""

    region: Region
    action: Action


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    """A contiguous run of units (inclusive) and the device it runs on."""

    first_unit: int
    last_unit: int
    device: str  # as ``str(torch.device)``: "cpu", "cuda:0"; "" where the plan did not record it (plan files v1)

    def __post_init__(self) -> None:
        if self.first_unit < 0 or self.last_unit < self.first_unit - 1:
            raise ValueError(f"Stage needs 0 <= first_unit <= last_unit + 1, got {self.first_unit}..{self.last_unit}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where each part of the step runs: stages in unit order, covering every unit once."""

    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a Placement needs at least one stage")
        for before, after in zip(self.stages, self.stages[1:]):
            if after.first_unit != before.last_unit + 1:
                raise ValueError(f"stages must be contiguous and in unit order, got {before} then {after}")

    @staticmethod
    def single_device(num_units: int, device: str) -> Placement:
        """Every unit on one device (a graph of no units is one empty stage)."""
        return Placement(stages=(Stage(first_unit=0, last_unit=num_units - 1, device=device),))


@dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    """What the rewriter needs, nothing else: per region an action, and where the step runs.

    Regions are disjoint and in unit order; a unit in no region keeps what it saves. Different regions may have
    different actions.
    """

    region_actions: tuple[RegionAction, ...]
    placement: Placement

    def __post_init__(self) -> None:
        regions = self.regions
        for before, after in itertools.pairwise(regions):
            if after.first_unit <= before.last_unit:
                raise ValueError(f"a Policy's regions must be disjoint and in unit order, got {before} then {after}")

    @property
    def regions(self) -> tuple[Region, ...]:
        return tuple(ra.region for ra in self.region_actions)

    @property
    def actions(self) -> tuple[Action, ...]:
        """The action of each region, in region order."""
        return tuple(ra.action for ra in self.region_actions)

    @staticmethod
    def uniform(regions: Sequence[Region], action: Action, placement: Placement) -> Policy:
        """The same action for every region (sorted into unit order)."""
        ordered = sorted(regions, key=lambda r: r.first_unit)
        return Policy(region_actions=tuple(RegionAction(region=r, action=action) for r in ordered), placement=placement)


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
    transfer_ms: float = 0.0  # offload: link time the step waits for (part of overhead_ms)
    offloaded_bytes: int = 0  # offload: bytes moved to the host pool per step (each way)
    host_pool_bytes: int = 0  # offload: the pool a step needs (``offload.slot_bytes`` of every moved storage)


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
    host_pool_bytes: tuple[int, ...] = ()  # host pool slots taken (offload; host memory, not in total_bytes); () none

    @property
    def total_bytes(self) -> tuple[int, ...]:
        return tuple(map(sum, zip(self.parameter_bytes, self.gradient_bytes, self.activation_bytes,
                                  self.recomputed_bytes, self.temporary_bytes)))


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverStats:
    """How the MILP went (the last program solved); zeros when no program was needed."""

    status: str  # PuLP's word for the last program's solution: "Optimal Solution Found", "Solution Found" (not proven
    # optimal, e.g. time limit), "No Solution Found" (time limit, no incumbent), "No Solution Exists" (infeasible)
    relative_gap: float | None  # proven gap of the last program (None when the solver did not say)
    variables: int
    constraints: int
    programs: int  # programs solved: min-peak floor, first solve and budget refinements


def describe_value(value: Any) -> str:
    """Short description of a user-supplied value for error messages."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class PipelineSchedule(str, Enum):
    """The ``torch.distributed.pipelining`` schedule a pipeline plan is made for."""

    ONE_F_ONE_B = "1F1B"  # Schedule1F1B: stage k of S holds up to min(S - k, microbatches) microbatches in flight
    GPIPE = "GPipe"  # ScheduleGPipe: every stage holds every microbatch until its backward

    def in_flight(self, stage: int, num_stages: int, microbatches: int) -> int:
        """Microbatches whose activations a stage holds at once."""
        return min(num_stages - stage, microbatches) if self is PipelineSchedule.ONE_F_ONE_B else microbatches
