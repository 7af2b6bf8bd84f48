"""What a plan records: the values a plan and a pipeline plan are made of, written to and read from plan files.

``PlanRecord`` (with its rows ``NodePlan``, the model's ``ModelFingerprint`` of ``TensorSpec``s, the budget sweep's
``ParetoPoint``s, the ``Provenance`` of its trace and timing and its ``MemoryBreakdown``s) is what ``records/plan.py``,
``summary.py``, ``codec.py`` and the reports read; ``PipelineRecord`` is a pipeline plan, with its stages
(``PipelineStageRecord``) and tied parameters (``SharedParameter``). The values the stages pass to make them (graph,
trace, costs, policy, timeline) are in ``types.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autockpt.types import (
    Action,
    ActionPrice,
    CaptureKind,
    Decision,
    MemoryCurve,
    Phase,
    PipelineSchedule,
    PlanStatus,
    Policy,
    Region,
    SolverStats,
    TrainingLoop,
)
from autockpt.units import format_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorSpec:
    """Name, shape and dtype of a parameter or an input: what a saved plan must match to apply."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "torch.float32"; for a non-tensor input, "python" and ``value`` holds its repr
    value: str = ""
    # integer and bool inputs: the least and greatest value in the example, so that a saved plan can rebuild inputs
    # the model accepts (token ids below the vocabulary size); not part of what a plan must match. None: a parameter,
    # another dtype, an empty tensor, or a plan file of schema version 2 or older
    value_range: tuple[int, int] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFingerprint:
    """What a plan was made for. Applying a plan to a model or inputs with another fingerprint is refused."""

    model_class: str
    graph_digest: str  # sha256 of the captured units' ops and module paths, in order
    num_units: int
    parameters: tuple[TensorSpec, ...]
    inputs: tuple[TensorSpec, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Provenance:
    """How a plan's step was known and what it is for: the trace that recorded its memory, the timing that gave its
    times, the device it is planned for (``planning/build.py`` chooses them)."""

    trace: str  # "measured" (a real step on the model's device) or "fake" (FakeTensorMode: no real step ran)
    timing: str  # "measured", "benchmark" (each op alone on the local device), "roofline" or "none"
    device: str  # the device planned for: the model's ("cpu", "cuda:0") or a DeviceSpec's name ("h100-sxm-80gb")
    device_memory_bytes: int | None = None  # the device memory planned for, when known (given, the target's, CUDA's)
    reason: str = ""  # why trace="auto" chose this trace ("" when it was asked for)
    # the user's eager model and the captured program, each unmodified, forward + backward, measured on the example
    # inputs (``planning/eager_check.py``); None where not measured (a fake trace, a module-level capture)
    eager_peak_bytes: int | None = None
    captured_peak_bytes: int | None = None

    def describe(self) -> str:
        """``fake trace, roofline timing, for h100-sxm-80gb with 80.000 GB (74.506 GiB) of device memory``, then
        ``; auto: why`` when ``trace="auto"`` chose the trace."""
        memory = (
            f" with {format_bytes(self.device_memory_bytes)} of device memory"
            if self.device_memory_bytes is not None else ""
        )
        why = f"; auto: {self.reason}" if self.reason else ""
        return f"{self.trace} trace, {self.timing} timing, for {self.device}{memory}{why}"


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """What one moment of a predicted step holds, by category (``core/breakdown.py`` says how each is found); the
    categories add up to ``total_bytes`` exactly, which at a plan's peak is its predicted peak.

    Static categories (parameters, buffers and inputs, optimizer states, other device memory) are the trace's;
    gradients are those made so far; ``logits_bytes`` is the model's output and what the loss makes from it in
    forward; ``activation_bytes`` every other tensor made in forward and still alive; ``temporary_bytes`` the rest.
    """

    event: int  # the event of the step's timeline (``StepTrace.events``)
    phase: Phase
    moment: str = ""  # where in the step that event is, in words ("backward of layers.3.mlp"); "" in older files
    parameter_bytes: int
    gradient_bytes: int  # parameter gradients made so far
    optimizer_state_bytes: int
    buffer_and_input_bytes: int
    activation_bytes: int  # tensors made in forward still alive (saved for backward, or not yet freed), logits aside
    logits_bytes: int  # the model's output (a language model's logits) and what the loss made from it in forward
    recomputed_bytes: int = 0  # copies made by recomputation (and its burst), brought back from the host pool
    other_device_bytes: int = 0  # device bytes the step does not own (``StepTrace.foreign_bytes``)
    temporary_bytes: int  # everything else: backward temporaries, activation gradients, optimizer.step()'s

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.rows())

    def rows(self) -> list[tuple[str, int]]:
        """(category, bytes) in the order the summary and the report list them."""
        return [
            ("parameters", self.parameter_bytes),
            ("gradients", self.gradient_bytes),
            ("optimizer states", self.optimizer_state_bytes),
            ("buffers and inputs", self.buffer_and_input_bytes),
            ("activations", self.activation_bytes),
            ("logits and loss", self.logits_bytes),
            ("recomputed copies", self.recomputed_bytes),
            ("other device memory", self.other_device_bytes),
            ("temporaries", self.temporary_bytes),
        ]


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
    action: Action | None = None  # the action of its region, None when in none
    recompute_ms: float = 0.0  # forward ms run again in backward (0 for the tail a region's early stop skips)
    saved_tensors: int = 0  # tensors autograd saves for this unit (each passes the checkpoint's hooks when recomputed)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRecord:
    """The values of a plan: what autockpt decided for one model, inputs and budget, with its predictions.

    ``autockpt.Plan`` (``plan.py``) is this record with its report and save methods; the stages and the modules that
    write plans (``summary.py``, ``report.py``, ``codec.py``) read this record. Bytes are exact integers.
    """

    budget_bytes: int
    predicted_peak_bytes: int
    baseline_peak_bytes: int  # predicted (= measured in profiling) peak with nothing recomputed
    min_feasible_bytes: int  # the lowest predicted peak found (see floor_complete)
    static_bytes: int
    predicted_overhead: float  # (recompute time + checkpoint machinery) / unmodified step time
    recompute_ms: float
    baseline_step_ms: float
    capture: CaptureKind
    status: PlanStatus
    solver: str
    solve_time_s: float  # everything after capture and profiling: preparation, floor, every action's solve
    capture_time_s: float
    profile_time_s: float
    policy: Policy  # what the rewriter applies
    # the recompute action the solver planned with: it picks one per plan (every region has it), and an identity plan
    # still records which one it was made for
    planned_action: Action
    nodes: tuple[NodePlan, ...]
    measured_peak_bytes: int | None = None  # optimize() runs one real step on the example inputs to check the budget
    notes: tuple[str, ...] = field(default=())
    strategy: str = "autockpt"  # "autockpt" for solved plans; a baseline policy's name otherwise
    fingerprint: ModelFingerprint | None = None
    solver_stats: SolverStats | None = None
    memory_before: MemoryCurve | None = None  # predicted step with nothing recomputed
    memory_after: MemoryCurve | None = None  # predicted step under this plan
    pareto: tuple[ParetoPoint, ...] = ()  # other budgets, when the planner was asked for them
    prices: tuple[ActionPrice, ...] = ()  # the cost model's prices the prediction used (``costs.py``)
    machinery_ms: float = 0.0  # predicted checkpoint machinery of all regions: part of predicted_overhead
    # False: min_feasible_bytes comes from the quick floor search (block program, baselines, local descent), which
    # was enough to prove this budget reachable; a lower budget runs the full search, which may find lower
    floor_complete: bool = True
    offloaded_bytes: int = 0  # per step, moved to the host pool and back (regions whose action is OFFLOAD)
    host_pool_bytes: int = 0  # the host pool the optimized module allocates once (0: no pool)
    transfer_ms: float = 0.0  # predicted link time the step waits for: part of predicted_overhead
    loop: TrainingLoop | None = None  # the training loop the budget covers (None: forward and backward alone)
    # device bytes the step does not own, read when the plan was solved and counted in every prediction (on CUDA:
    # allocated beyond the model's parameters, buffers, gradients and inputs; ``StepTrace.foreign_bytes``)
    foreign_bytes: int = 0
    # what the CUDA caching allocator reserved at the measured step's peak (``torch.cuda.max_memory_reserved``);
    # None on CPU or when nothing was measured
    measured_reserved_bytes: int | None = None
    provenance: Provenance | None = None  # which trace and timing made the plan, for which device (None: unknown)
    # by category, at the predicted peak under this plan and at the unmodified step's peak (None: plan files of
    # schema version 4 or older, or plans not made by autockpt's planner)
    breakdown: MemoryBreakdown | None = None
    baseline_breakdown: MemoryBreakdown | None = None
    # the same at the peak of the floor's plan (``min_feasible_bytes``): what sets the floor (None: files of schema 6
    # or older, a joint program's floor, plans not made by the planner)
    floor_breakdown: MemoryBreakdown | None = None
    # the output projection and the cross-entropy run in chunks of this many tokens (``measure/chunked_tail.py``);
    # 0: the loss runs as the model wrote it (and in files of schema 7 or older)
    loss_chunk_tokens: int = 0

    @property
    def regions(self) -> tuple[Region, ...]:
        return self.policy.regions

    @property
    def region_overhead_ms(self) -> float:
        """Measured fixed cost of one region of the planned action (``ActionPrice.region_ms``)."""
        return self._price().region_ms

    @property
    def saved_tensor_overhead_ms(self) -> float:
        """Measured machinery cost per saved tensor of the planned action (``ActionPrice.saved_tensor_ms``)."""
        return self._price().saved_tensor_ms

    def _price(self) -> ActionPrice:
        for price in self.prices:
            if price.action is self.planned_action:
                return price
        return ActionPrice(action=self.planned_action, region_ms=0.0, saved_tensor_ms=0.0)

    @property
    def recomputed_units(self) -> tuple[int, ...]:
        return tuple(n.index for n in self.nodes if n.decision is Decision.RECOMPUTE)

    def __repr__(self) -> str:
        return (
            f"Plan(capture={self.capture.value}, status={self.status.value}, budget_bytes={self.budget_bytes}, "
            f"predicted_peak_bytes={self.predicted_peak_bytes}, baseline_peak_bytes={self.baseline_peak_bytes}, "
            f"regions={len(self.regions)}, predicted_overhead={self.predicted_overhead:.3f})"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineStageRecord:
    """One stage of a pipeline plan: which units and modules, and what it is predicted to hold and take.

    ``predicted_peak_bytes`` = the stage plan's predicted peak for one microbatch + (in flight - 1) x
    ``retained_bytes`` + ``schedule_buffer_bytes``.
    """

    index: int
    first_unit: int
    last_unit: int
    module_paths: tuple[str, ...]
    parameter_names: tuple[str, ...]
    parameter_bytes: int
    budget_bytes: int
    microbatches_in_flight: int
    retained_bytes: int  # per microbatch in flight: activations its forward leaves for its backward, under the plan
    # the schedule's own tensors: receive buffers for inputs and output gradients (one per microbatch), and on the
    # last stage the outputs it keeps to return
    schedule_buffer_bytes: int
    predicted_peak_bytes: int
    predicted_microbatch_ms: float  # forward + backward + recomputation of one microbatch
    input_names: tuple[str, ...]  # values received from the previous stage (fx node names)
    output_names: tuple[str, ...]  # values sent to the next stage
    sent_bytes: int  # per microbatch, what crosses the cut after this stage (0 on the last)
    # the last stage's plan is of the stage and the loss function together (``pipeline/last_stage.py``): the
    # schedule's loss function runs both, so the loss may be computed in chunks (schema 9; False before)
    with_loss: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class SharedParameter:
    """A parameter read by more than one stage (tied weights): each holds it, their gradients are summed."""

    name: str
    stages: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineRecord:
    """What ``plan_pipeline`` decided: the cuts, and per stage its units, modules, plan and predictions
    (``pipeline/plan.py``'s ``PipelinePlan`` adds the methods; the pipeline report reads this record)."""

    num_stages: int
    microbatches: int
    schedule: PipelineSchedule
    return_outputs: bool
    cuts: tuple[int, ...]  # the step is cut after these units
    stages: tuple[PipelineStageRecord, ...]
    stage_plans: tuple[PlanRecord, ...]  # each stage's recompute plan, over the stage's own units
    shared_parameters: tuple[SharedParameter, ...]
    predicted_step_ms: float  # the schedule's: (microbatches + stages - 1) x slowest stage + transfers
    link_gb_per_s: float  # what sending activations between stages was priced at (GB = 10^9 bytes)
    strategy: str  # "autockpt" (the split program), or the baseline split it was given
    capture: CaptureKind
    fingerprint: ModelFingerprint  # the whole model on one microbatch
    candidate_cuts: tuple[int, ...] = ()
    plan_time_s: float = 0.0
    notes: tuple[str, ...] = ()
    provenance: Provenance | None = None  # how the stages' steps were traced and timed (every stage alike)

