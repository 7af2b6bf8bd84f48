"""Policy: a solved (or given) set of regions -> the Policy the rewriter applies and the Plan a person reads.

The plan records, per unit, what it costs and what was decided, the predicted memory curves before and after, and
what each holds at its peak by category (``core/breakdown.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from autockpt.core.breakdown import memory_breakdown
from autockpt.core.region_rules import unit_regions
from autockpt.core.simulate import memory_curve
from autockpt.core.solve.base import SolveResult
from autockpt.record_types import MemoryBreakdown, ModelFingerprint, NodePlan, Provenance
from autockpt.records.plan import Plan
from autockpt.types import (
    OUTSIDE_GRAPH_UNIT,
    Action,
    CostModel,
    Decision,
    Graph,
    MemoryCurve,
    Phase,
    Placement,
    PlanStatus,
    Policy,
    RegionAction,
    StepTrace,
    Timeline,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanningContext:
    """What every plan of one planner shares: the captured graph, its trace and prices, and where it runs."""

    graph: Graph
    trace: StepTrace
    costs: CostModel
    placement: Placement
    fingerprint: ModelFingerprint
    capture_time_s: float
    profile_time_s: float
    memory_before: MemoryCurve  # the predicted step with nothing recomputed
    notes: tuple[str, ...] = ()  # what every plan says besides the capture's notes (how its times were made)
    provenance: Provenance | None = None  # which trace and timing, for which device
    loss_chunk_tokens: int = 0  # the program computes its loss in chunks of this many tokens (0: as captured)

    def overhead(self, overhead_ms: float) -> float:
        """Added milliseconds as a fraction of the unmodified step."""
        return overhead_ms / self.trace.step_ms if self.trace.step_ms > 0 else 0.0


_TIMES_NOT_MEASURED = (
    "unit times were not measured (a fake trace): the predicted overhead and recompute times are placeholders, "
    "0 or proportional to FLOPs"
)


def assemble_plan(
    context: PlanningContext, region_actions: Sequence[RegionAction], action: Action, budget_bytes: int,
    timeline: Timeline, *, result: SolveResult | None = None, solve_time_s: float = 0.0, strategy: str = "autockpt",
) -> Plan:
    """The plan of ``region_actions``, made for the recompute action ``action`` (or the one action of given regions);
    ``result`` is the solver's (None: the regions were given and only scored), ``solve_time_s`` what planning took
    after capture and profiling."""
    trace, graph = context.trace, context.graph
    ordered = tuple(sorted(region_actions, key=lambda ra: ra.region.first_unit))
    policy = Policy(region_actions=ordered, placement=context.placement)
    region_of = unit_regions(len(graph.units), policy.regions)
    action_of = [None if r is None else policy.actions[r] for r in region_of]
    rerun = set(timeline.rerun_units)
    nodes = tuple(
        NodePlan(
            index=unit.index,
            name=unit.name,
            op=unit.op,
            module_path=unit.module_path,
            saved_bytes=cost.saved_bytes,
            output_bytes=cost.output_bytes,
            forward_ms=cost.forward_ms,
            flops=cost.flops,
            decision=_decision(action_of[unit.index]),
            region=region_of[unit.index],
            action=action_of[unit.index],
            recompute_ms=cost.forward_ms if unit.index in rerun else 0.0,
            saved_tensors=cost.saved_tensors,
        )
        for unit, cost in zip(graph.units, trace.units)
    )
    solved = result is not None
    memory_after = memory_curve(trace, context.costs, policy.region_actions)
    return Plan(
        budget_bytes=budget_bytes,
        predicted_peak_bytes=timeline.peak_bytes,
        baseline_peak_bytes=result.baseline.peak_bytes if solved else trace.baseline_peak_bytes,
        min_feasible_bytes=result.min_feasible_bytes if solved else timeline.peak_bytes,
        floor_complete=result.floor_complete if solved else True,
        static_bytes=trace.static_bytes,
        predicted_overhead=context.overhead(timeline.overhead_ms),
        recompute_ms=timeline.recompute_ms,
        prices=tuple(context.costs.price(a) for a in dict.fromkeys((action, *policy.actions))),
        machinery_ms=timeline.machinery_ms,
        offloaded_bytes=timeline.offloaded_bytes,
        host_pool_bytes=timeline.host_pool_bytes,
        transfer_ms=timeline.transfer_ms,
        planned_action=action,
        baseline_step_ms=trace.step_ms,
        capture=graph.kind,
        status=result.status if solved else PlanStatus.GIVEN,
        solver=result.solver if solved else "none",
        solve_time_s=solve_time_s,
        capture_time_s=context.capture_time_s,
        profile_time_s=context.profile_time_s,
        policy=policy,
        nodes=nodes,
        notes=graph.notes + context.notes + (() if trace.times_measured else (_TIMES_NOT_MEASURED,)),
        strategy=strategy,
        fingerprint=context.fingerprint,
        solver_stats=result.stats if solved else None,
        memory_before=context.memory_before,
        memory_after=memory_after,
        loop=trace.loop,
        foreign_bytes=trace.foreign_bytes,
        provenance=context.provenance,
        breakdown=breakdown_at(context, memory_after),
        baseline_breakdown=breakdown_at(context, context.memory_before),
        loss_chunk_tokens=context.loss_chunk_tokens,
        floor_breakdown=(
            breakdown_at(context, memory_curve(trace, context.costs, result.floor_region_actions))
            if solved and result.floor_region_actions is not None else None
        ),
    )


def breakdown_at(context: PlanningContext, curve: MemoryCurve) -> MemoryBreakdown:
    """``curve`` at its peak by category, with where in the step that peak is, in words."""
    found = memory_breakdown(context.trace, curve)
    return dataclasses.replace(found, moment=moment_of(context.trace, context.graph, found.event))


def moment_of(trace: StepTrace, graph: Graph, event: int) -> str:
    """Where event ``event`` of the step is: "forward of layers.3.mlp (aten.mm)", "backward of lm_head (...)", the
    loss, or the end of backward, where the optimizer's step runs when the loop has one."""
    moment = trace.events[event]
    if moment.unit == OUTSIDE_GRAPH_UNIT:
        if moment.phase is Phase.FORWARD:
            return "the loss (after the model's forward)"
        if event == len(trace.events) - 1:
            return ("the end of backward, then optimizer.step()"
                    if trace.loop is not None and trace.loop.optimizer is not None else "the end of backward")
        return "the start of backward (the loss's gradient)"
    unit = graph.units[moment.unit]
    return f"{moment.phase.value} of {unit.module_path or 'the model'} ({unit.op})"


def _decision(action: Action | None) -> Decision:
    if action is None:
        return Decision.KEEP
    return Decision.OFFLOAD if action is Action.OFFLOAD else Decision.RECOMPUTE
