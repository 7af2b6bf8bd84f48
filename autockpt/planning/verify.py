"""Verify: plans -> the module that keeps the budget when measured, and the faster of several that do.

``optimize`` does not trust a prediction: it rewrites each candidate plan (one per recompute action), measures one
real step, tightens the target by the overshoot while every measured peak is over the budget, and, when more than one
plan keeps it, times their steps against each other (alternating rounds) and keeps the faster.

A plan is made for the device bytes the step does not own as they were read when it was solved
(``Plan.foreign_bytes``: on CUDA other models, caches, leftovers, kernel workspaces). The measured step may find a
different figure (the planner holds copies of the buffers and the user's gradients aside while it measures); its
peak is judged against the budget moved by that difference (``in_planned_device``), never by the planner's own copies.

A refusal states the smallest budget it promises from the floor's own plans, chosen by bytes alone
(``CandidatePlans.floor_plans``): their predicted or lowest measured peak, whichever is higher. A call at that budget
tries the same plans (first when the budget is under the predicted floor, last when it is not), so it keeps it, and
the same model and inputs get the same promise: the plans the measured times choose, and the floor they predict,
moved with the machine's load (issue 37).
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

VERIFY_ATTEMPTS = 4  # the last one at the floor, its own plans (chosen by bytes) after the fastest


class CandidatePlans(Protocol):
    """What verification needs from a planner (``api.Planner`` implements it)."""

    def plans_under(self, target_bytes: int, budget_bytes: int) -> list[Plan]:
        """One plan per recompute action that has one predicted under ``target_bytes``, made for ``budget_bytes``;
        raises ``InfeasibleBudgetError`` when none has."""

    def floor_plans(self, floor_bytes: int, budget_bytes: int) -> list[Plan]:
        """The floor's own plans, chosen by bytes alone (the same for the same model and inputs, whatever the
        measured times), made for ``budget_bytes``; empty when there are none."""

    def apply(self, plan: Plan) -> OptimizedModule: ...

    def measure(self, module: OptimizedModule) -> StepMeasurement: ...

    def alternating_step_seconds(self, modules: Sequence[OptimizedModule]) -> list[list[float]]: ...


def verified_module(planner: CandidatePlans, budget_bytes: int) -> OptimizedModule:
    """Plan, rewrite, measure one real step; tighten by the overshoot while the measured peak is over budget (never
    below the smallest predicted peak). At the floor, when none of its plans keeps the budget, the floor's own plans,
    chosen by bytes, are tried last: those a refusal measures (``measured_floor``), so that a budget it stated is
    kept."""
    target = budget_bytes
    tightenings: list[str] = []
    peaks: list[int] = []  # every plan's measured peak
    by_bytes: list[tuple[Plan, int]] = []  # the floor's own plans, chosen by bytes, with their measured peaks
    # this attempt's plans, by their regions and actions: measured peak and plan; the modules that keep the budget
    measured: dict[tuple, tuple[int, Plan]] = {}
    kept: list[OptimizedModule] = []

    def measure(the_plan: Plan) -> int:
        key = the_plan.policy.region_actions
        if key not in measured:
            module, peak = measured_module(planner, the_plan)
            measured[key] = (peak, module.plan)
            if peak <= budget_bytes:
                kept.append(module)
        return measured[key][0]

    for attempt in range(VERIFY_ATTEMPTS):
        try:
            plans = planner.plans_under(target, budget_bytes)
        except InfeasibleBudgetError as error:
            if attempt == 0:
                at_floor = measured_floor(planner, error)
                if isinstance(at_floor, OptimizedModule):
                    return at_floor
                raise at_floor from None
            raise InfeasibleBudgetError(
                f"the budget {format_bytes(budget_bytes)} was not kept when measured ({tightenings[-1]} bytes) "
                f"and no tighter plan exists (smallest predicted peak {error.min_feasible_bytes} bytes). Use a "
                f"budget of at least {min(peaks)} bytes (the lowest measured peak) or a smaller batch.",
                budget_bytes=budget_bytes,
                min_feasible_bytes=min(peaks),
            ) from error
        unmodified = next((the_plan for the_plan in plans if the_plan.status is PlanStatus.IDENTITY), None)
        if unmodified is not None:
            return planner.apply(unmodified)
        floor = min(the_plan.min_feasible_bytes for the_plan in plans)
        measured.clear()
        for the_plan in plans:
            measure(the_plan)
        if target <= floor and not kept:
            # the last attempt: the floor's own plans, chosen by bytes, after those the measured times chose
            by_bytes += [(the_plan, measure(the_plan)) for the_plan in planner.floor_plans(floor, budget_bytes)]
        if kept:
            return kept[0] if len(kept) == 1 else faster(planner, kept)
        peaks += [peak for peak, _ in measured.values()]
        for peak, the_plan in measured.values():
            kind = the_plan.planned_action.value
            tightenings.append(f"{kind}: predicted {the_plan.predicted_peak_bytes}, measured {peak}")
            logger.info("measured peak %d bytes is over the budget %d (%s)", peak, budget_bytes, kind)
        if target <= floor:
            break  # the floor's plans are over: no tighter plan exists
        logger.info("no plan kept the budget %d when measured; tightening", budget_bytes)
        overshoot = max(peak for peak, _ in measured.values()) - budget_bytes
        target = tightened_target(target, overshoot, budget_bytes, floor, last_next=attempt == VERIFY_ATTEMPTS - 2)
    # the floor's own plans are what a call at the budget stated tries last, so it is kept there; chosen by bytes,
    # they state the same budget whatever the measured times chose before them (issue 37)
    stated, which = (
        (promised_bytes(by_bytes), "what the floor's own plans, chosen by bytes, measure") if by_bytes
        else (min(peaks), "the lowest measured peak")
    )
    raise InfeasibleBudgetError(
        f"the budget {format_bytes(budget_bytes)} was not kept when measured after {len(tightenings)} plans "
        f"(bytes: {'; '.join(tightenings)}). Use a budget of at least {stated} bytes ({which}) or a smaller batch.",
        budget_bytes=budget_bytes,
        min_feasible_bytes=stated,
    )


def measured_module(planner: CandidatePlans, the_plan: Plan) -> tuple[OptimizedModule, int]:
    """``the_plan`` rewritten and measured (one real step): the module, its plan recording the measured peak, and
    that peak with the device as planned (``in_planned_device``)."""
    module = planner.apply(the_plan)
    peak, recorded = in_planned_device(the_plan, planner.measure(module))
    module.set_plan(recorded)
    return module, peak


def tightened_target(target: int, overshoot: int, budget_bytes: int, floor: int, *, last_next: bool) -> int:
    """The next target after a measured overshoot: lower by it (and 0.1 % of the budget), never below the floor; the
    floor itself when the next attempt is the last, so that a step measured over by more than the tightenings so far
    (the CUDA allocator's rounding in a cache warm from other work, a compiled step) does not end in "infeasible"
    while a tighter plan that keeps the budget exists."""
    if last_next:
        return floor
    return max(target - overshoot - max(1, budget_bytes // 1000), floor)


def measured_floor(planner: CandidatePlans, error: InfeasibleBudgetError) -> OptimizedModule | InfeasibleBudgetError:
    """``error`` (a budget under the predicted floor) with a smallest feasible budget that is kept when measured and
    the same for the same model and inputs; or the module that keeps the budget after all.

    The floor's own plans, chosen by bytes alone (``CandidatePlans.floor_plans``), are rewritten and measured: the
    budget stated is the higher of their predicted peak and their lowest measured peak (above the prediction by bytes
    the simulator does not see: 8 on a Hugging Face ResNet, 1-4 KiB on the diffusers UNet). A call at that budget
    tries the same plans, here when its budget is under the predicted floor and last in ``verified_module`` when it is
    not, so it keeps it. Not the plans the measured times choose at the floor, nor that floor itself: both moved with
    the machine's load (issue 37: a ResNet-18's plans at the floor measured 104,495,488 or 105,674,104 bytes; a tiny
    UNet's floor was predicted at 1,611,560 bytes in one profile, 1,598,120 in others)."""
    floor = error.min_feasible_bytes
    plans = planner.floor_plans(floor, error.budget_bytes)
    if not plans:
        return measured_floor_under(planner, error)  # with a host pool, or nothing lowers the peak
    kept: list[OptimizedModule] = []
    peaks: list[int] = []
    for the_plan in plans:
        module, peak = measured_module(planner, the_plan)
        peaks.append(peak)
        if peak <= error.budget_bytes:
            kept.append(module)
    if kept:  # the floor the measured times predicted was above what these plans measure
        return kept[0] if len(kept) == 1 else faster(planner, kept)
    stated = promised_bytes(list(zip(plans, peaks)))
    if stated == floor:
        return error
    predicted = plans[0].predicted_peak_bytes
    logger.info(
        "the floor's own plans predict %d bytes and measure %s, predicted floor %d: stating %d",
        predicted, peaks, floor, stated,
    )
    return InfeasibleBudgetError(
        f"{error} (Measured, the floor's own plan chosen by bytes alone, predicted at {predicted} bytes, peaks at "
        f"{min(peaks)} bytes: the smallest budget stated as kept is {format_bytes(stated)}, {stated} bytes.)",
        budget_bytes=error.budget_bytes, min_feasible_bytes=stated, host_pool_bytes_needed=error.host_pool_bytes_needed,
    )


def promised_bytes(by_bytes: Sequence[tuple[Plan, int]]) -> int:
    """The budget the floor's own plans, chosen by bytes, promise: the higher of their predicted peak (the lowest of
    any action, the same for each) and their lowest measured peak. A call at it tries the same plans, so it is kept."""
    return max(min(peak for _, peak in by_bytes), min(the_plan.predicted_peak_bytes for the_plan, _ in by_bytes))


def measured_floor_under(planner: CandidatePlans, error: InfeasibleBudgetError) -> InfeasibleBudgetError:
    """``measured_floor`` where the floor has no plans chosen by bytes (with a host pool): the plans under the floor
    are measured, and when they measure above their prediction the stated minimum is the lowest measured peak plus
    the largest such slack. Which plans those are follows the measured times (issue 37)."""
    floor = error.min_feasible_bytes
    try:
        plans = planner.plans_under(floor, floor)
    except InfeasibleBudgetError:
        return error  # the floor came from a search the plan at that target does not repeat: nothing to measure
    peaks = [measured_module(planner, the_plan)[1] for the_plan in plans]
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
