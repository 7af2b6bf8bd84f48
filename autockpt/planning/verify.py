"""Verify: plans -> the module that keeps the budget when measured, and the faster of several that do.

``optimize`` does not trust a prediction: it rewrites each candidate plan (one per recompute action), measures one
real step, tightens the target by the overshoot while every measured peak is over the budget, and, when more than one
plan keeps it, times their steps against each other (alternating rounds) and keeps the faster.

A plan is made for the device bytes the step does not own as they were read when it was solved
(``Plan.foreign_bytes``: on CUDA other models, caches, leftovers, kernel workspaces). The measured step may find a
different figure (the planner holds copies of the buffers and the user's gradients aside while it measures); its
peak is judged against the budget moved by that difference (``in_planned_device``), never by the planner's own copies.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Protocol

from autockpt.errors import InfeasibleBudgetError
from autockpt.measure.step import StepMeasurement, relative_step_times
from autockpt.records.plan import Plan
from autockpt.runtime.rewrite import OptimizedModule
from autockpt.types import PlanStatus
from autockpt.units import format_bytes

logger = logging.getLogger(__name__)

VERIFY_ATTEMPTS = 4  # the last one is the floor's own plan


class CandidatePlans(Protocol):
    """What verification needs from a planner (``api.Planner`` implements it)."""

    def plans_under(self, target_bytes: int, budget_bytes: int) -> list[Plan]:
        """One plan per recompute action that has one predicted under ``target_bytes``, made for ``budget_bytes``;
        raises ``InfeasibleBudgetError`` when none has."""

    def apply(self, plan: Plan) -> OptimizedModule: ...

    def measure(self, module: OptimizedModule) -> StepMeasurement: ...

    def alternating_step_seconds(self, modules: Sequence[OptimizedModule]) -> list[list[float]]: ...


def verified_module(planner: CandidatePlans, budget_bytes: int) -> OptimizedModule:
    """Plan, rewrite, measure one real step; tighten by the overshoot while the measured peak is over budget (never
    below the smallest predicted peak: the floor's plan is the last one tried)."""
    target = budget_bytes
    tightenings: list[str] = []
    peak = 0
    lowest_peak: int | None = None  # the lowest measured peak of any plan tried: the budget the error states
    for attempt in range(VERIFY_ATTEMPTS):
        try:
            plans = planner.plans_under(target, budget_bytes)
        except InfeasibleBudgetError as error:
            if attempt == 0:
                raise measured_floor(planner, error) from None
            raise InfeasibleBudgetError(
                f"the budget {format_bytes(budget_bytes)} was not kept when measured ({tightenings[-1]} bytes) "
                f"and no tighter plan exists (smallest predicted peak {error.min_feasible_bytes} bytes). Use a "
                f"budget of at least {lowest_peak} bytes (the lowest measured peak) or a smaller batch.",
                budget_bytes=budget_bytes,
                min_feasible_bytes=lowest_peak,
            ) from error
        kept: list[OptimizedModule] = []
        overshoot = 0
        for the_plan in plans:
            module = planner.apply(the_plan)
            if the_plan.status is PlanStatus.IDENTITY:
                return module
            peak, the_plan = in_planned_device(the_plan, planner.measure(module))
            module.set_plan(the_plan)
            lowest_peak = peak if lowest_peak is None else min(lowest_peak, peak)
            if peak <= budget_bytes:
                kept.append(module)
                continue
            overshoot = max(overshoot, peak - budget_bytes)
            kind = the_plan.planned_action.value
            tightenings.append(f"{kind}: predicted {the_plan.predicted_peak_bytes}, measured {peak}")
            logger.info("measured peak %d bytes is over the budget %d (%s)", peak, budget_bytes, kind)
        if kept:
            return kept[0] if len(kept) == 1 else faster(planner, kept)
        floor = min(the_plan.min_feasible_bytes for the_plan in plans)
        if target <= floor:
            break  # the floor's own plan is over: no tighter plan exists
        logger.info("no plan kept the budget %d when measured; tightening", budget_bytes)
        target = tightened_target(target, overshoot, budget_bytes, floor, last_next=attempt == VERIFY_ATTEMPTS - 2)
    raise InfeasibleBudgetError(
        f"the budget {format_bytes(budget_bytes)} was not kept when measured after {len(tightenings)} plans "
        f"(bytes: {'; '.join(tightenings)}). Use a budget of at least {lowest_peak} bytes (the lowest measured peak) "
        "or a smaller batch.",
        budget_bytes=budget_bytes,
        min_feasible_bytes=lowest_peak if lowest_peak is not None else peak,
    )


def tightened_target(target: int, overshoot: int, budget_bytes: int, floor: int, *, last_next: bool) -> int:
    """The next target after a measured overshoot: lower by it (and 0.1 % of the budget), never below the floor; the
    floor itself when the next attempt is the last, so that a step measured over by more than the tightenings so far
    (the CUDA allocator's rounding in a cache warm from other work, a compiled step) does not end in "infeasible"
    while a tighter plan that keeps the budget exists."""
    if last_next:
        return floor
    return max(target - overshoot - max(1, budget_bytes // 1000), floor)


def measured_floor(planner: CandidatePlans, error: InfeasibleBudgetError) -> InfeasibleBudgetError:
    """``error`` with a smallest feasible budget that is kept when measured: the plans at the predicted floor are
    rewritten and measured; when they measure above their prediction (bytes the simulator does not see: 8 on a
    Hugging Face ResNet, 1-4 KiB on the diffusers UNet), the stated minimum is the lowest measured peak plus that
    slack, so that ``optimize`` at the stated minimum succeeds."""
    floor = error.min_feasible_bytes
    try:
        plans = planner.plans_under(floor, floor)
    except InfeasibleBudgetError:
        return error  # the floor came from a search the plan at that target does not repeat: nothing to measure
    peaks = [in_planned_device(the_plan, planner.measure(planner.apply(the_plan)))[0] for the_plan in plans]
    slack = max(peak - the_plan.predicted_peak_bytes for peak, the_plan in zip(peaks, plans))
    if slack <= 0:
        return error
    # a plan chosen again at this budget (another profile: other timings, maybe another plan) may be off by as much
    stated = min(peaks) + slack
    logger.info("the floor's plans measure %s bytes, predicted floor %d: stating %d", peaks, floor, stated)
    return InfeasibleBudgetError(
        f"{error} (Measured, the plan at that floor peaks at {min(peaks)} bytes, {slack} bytes above its prediction: "
        f"the smallest budget stated as kept is {format_bytes(stated)}, {stated} bytes.)",
        budget_bytes=error.budget_bytes, min_feasible_bytes=stated, host_pool_bytes_needed=error.host_pool_bytes_needed,
    )


def in_planned_device(the_plan: Plan, measurement: StepMeasurement) -> tuple[int, Plan]:
    """The measured peak as it would be with the device bytes the step does not own as the plan counted them
    (``measurement.peak_bytes`` less what the measured step found more of), and the plan recording it with the
    reserved bytes beside it; a note says by how much the two readings differed."""
    moved = measurement.foreign_bytes - the_plan.foreign_bytes
    peak = measurement.peak_bytes - moved
    notes = the_plan.notes
    if moved:
        notes = (*notes, (
            f"the measured step found {format_bytes(measurement.foreign_bytes)} on the device that it does not own, "
            f"the plan counted {format_bytes(the_plan.foreign_bytes)}: measured peak {measurement.peak_bytes} bytes, "
            f"{peak} bytes with the device as planned (the figure judged against the budget)"
        ))
        logger.info("%s", notes[-1])
    recorded = dataclasses.replace(
        the_plan, measured_peak_bytes=peak, measured_reserved_bytes=measurement.reserved_bytes, notes=notes,
    )
    return peak, recorded


def faster(planner: CandidatePlans, modules: list[OptimizedModule]) -> OptimizedModule:
    """The module whose training step is fastest, timed in alternating rounds (median of per-round times); the
    choice and the measured ratios go into its plan's notes."""
    seconds = planner.alternating_step_seconds(modules)
    ratios = relative_step_times(seconds)
    fastest = min(range(len(modules)), key=ratios.__getitem__)
    chosen = modules[fastest]
    others = ", ".join(
        f"{module.plan.planned_action.value}'s step took {ratios[i] / ratios[fastest]:.3f}x as long"
        for i, module in enumerate(modules) if i != fastest
    )
    note = (
        f"checkpoint {chosen.plan.planned_action.value} chosen by measured step time: {others} (median of "
        f"{len(seconds[0])} alternating rounds on the example inputs)"
    )
    logger.info(note)
    chosen.set_plan(dataclasses.replace(chosen.plan, notes=(*chosen.plan.notes, note)))
    return chosen
