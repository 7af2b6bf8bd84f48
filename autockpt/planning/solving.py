"""The solve step of a ``Planner``: each recompute action's prepared problem (scored candidates, floors; made once
per trace and prices, kept on the planner), the joint problem with a host pool, the cheapest plan of every action
under a budget, the floor's own plans chosen by bytes, and the host pool a refused budget would need.

Functions of the planner whose state they read and whose caches (``_problems``, ``_joint``) they fill: the planner
holds the step, this module decides over it (``planner.py`` orchestrates; ``verify.py`` measures).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

from autockpt.core.simulate import simulate
from autockpt.core.solve.base import NO_PROGRAM, Problem, SolveResult, region_actions
from autockpt.core.solve.baselines import baseline_seed_plans
from autockpt.core.solve.candidates import candidate_regions
from autockpt.core.solve.default import floor_by_bytes, refuse_static_over_budget, solve_prepared
from autockpt.core.solve.joint import JointProblem, solve_joint, unbounded_pool
from autockpt.core.solve.prepare import prepare
from autockpt.core.solve.refine import floor_lower_bound_bytes
from autockpt.core.structure import find_repeated_blocks
from autockpt.errors import InfeasibleBudgetError
from autockpt.measure.costs import calibrate, free_machinery
from autockpt.planning.policy import PlanningContext
from autockpt.records.plan import Plan
from autockpt.types import Action, CaptureKind, CostModel, Graph, PlanStatus, Region, StepTrace
from autockpt.units import GB, format_bytes


class PlannerState(Protocol):
    """What the solve step reads and fills of ``planner.Planner`` (a protocol: no import of it, no circle)."""

    graph: Graph
    trace: StepTrace
    costs: CostModel
    actions: tuple[Action, ...]
    host_pool_bytes: int
    solver_options: Any
    _device: Any
    _context: PlanningContext | None
    _problems: dict[Action, Problem]
    _joint: dict[int, JointProblem]
    _on_stage: Callable[[str], None]

    @property
    def context(self) -> PlanningContext: ...

    def _follow_foreign_bytes(self) -> None: ...

    def _plan_of(self, result: SolveResult, budget_bytes: int, solve_time_s: float) -> Plan: ...

    def _solves_by_blocks(self) -> bool: ...

logger = logging.getLogger(__name__)


def floor_plans(planner: PlannerState, floor_bytes: int, budget_bytes: int) -> list[Plan]:
    """The floor's own plans, chosen by bytes alone: what a refusal measures to state its smallest budget and what
    verification tries last (``verify.py``), so that the budget stated is the same for the same model and inputs
    and kept at that budget. Per recompute action, ``solve.default.floor_by_bytes`` on the trace with every unit
    timed alike and the machinery free; the plans of the actions whose peak is lowest, in action order, scored
    with the measured times and recorded as made for ``budget_bytes``, with ``floor_bytes`` as their floor.
    Empty with a host pool (the joint floor is not searched this way) or when no plan lowers the peak."""
    if planner.host_pool_bytes > 0:
        return []
    started = time.perf_counter()
    planner._follow_foreign_bytes()
    # timed alike, no timing picks among byte-equal plans: the same bytes give the same plans
    alike = dataclasses.replace(
        planner.trace, units=tuple(dataclasses.replace(unit, forward_ms=1.0) for unit in planner.trace.units)
    )
    found: list[tuple[Action, tuple[Region, ...], int]] = []
    for action in planner.actions:
        problem = prepared(planner, alike, free_machinery(planner.costs), action)
        regions, timeline = floor_by_bytes(problem, planner.solver_options)
        if regions and timeline.peak_bytes < problem.baseline.peak_bytes:
            found.append((action, regions, timeline.peak_bytes))
    lowest = min((peak for _, _, peak in found), default=None)
    baseline = simulate(planner.trace, planner.costs, ())
    plans = []
    for action, regions, peak in found:
        if peak != lowest:
            continue
        ordered = region_actions(regions, action)
        result = SolveResult(
            region_actions=ordered, action=action, timeline=simulate(planner.trace, planner.costs, ordered),
            baseline=baseline, min_feasible_bytes=floor_bytes, status=PlanStatus.FEASIBLE,
            solver="the floor's plan, chosen by bytes", solve_time_s=time.perf_counter() - started,
            stats=NO_PROGRAM,
        )
        plans.append(planner._plan_of(result, budget_bytes, result.solve_time_s))
    return plans


def solve_each(
    planner: PlannerState, target_bytes: int, *, pool_hint: bool = True
) -> tuple[dict[Action, SolveResult], float]:
    """Per action with a plan under ``target_bytes``: its cheapest plan, and the seconds all of it took
    (preparing each action's problem the first time, floors, every action's solve). With a host pool, one joint
    plan keyed by the action of its recompute-only rival. Each result's ``min_feasible_bytes`` is the lowest over
    all actions; raises ``InfeasibleBudgetError`` when no action has a plan (at once under the static bytes). The
    device bytes the step does not own are read again first: the plan is for the device as it is. ``pool_hint``: a
    refusal says which host pool would make the budget feasible (``with_pool_needed``: a joint solve, seconds on a
    billion-parameter model; off where another program of the loss may have a plan, ``loss_chunks.chosen``)."""
    planner._on_stage("solve")
    started = time.perf_counter()
    planner._follow_foreign_bytes()
    refuse_static_over_budget(planner.trace, target_bytes, lambda: solve_each(planner, target_bytes))  # nothing prepared
    context = planner.context
    results: dict[Action, SolveResult] = {}
    infeasible: list[InfeasibleBudgetError] = []
    solves = (
        [functools.partial(solve_joint, joint_for(planner, planner.host_pool_bytes))] if planner.host_pool_bytes > 0
        else [functools.partial(solve_prepared, problem_for(planner, action, context)) for action in planner.actions]
    )
    for solve in solves:
        try:
            result = solve(target_bytes, planner.solver_options)
            results[result.action] = result
        except InfeasibleBudgetError as error:
            infeasible.append(error)
    if not results:
        lowest = min(infeasible, key=lambda error: error.min_feasible_bytes)  # the action that gets lowest
        raise with_pool_needed(planner, lowest, target_bytes) if pool_hint else lowest
    floor = min([r.min_feasible_bytes for r in results.values()] + [e.min_feasible_bytes for e in infeasible])
    complete = all(r.floor_complete for r in results.values())  # an infeasible action ran the full search
    lowest = min(results.values(), key=lambda r: r.min_feasible_bytes)  # the action whose plan sets the floor
    floor_plan = lowest.floor_region_actions if lowest.min_feasible_bytes == floor else None
    for action, result in results.items():
        results[action] = dataclasses.replace(
            result, min_feasible_bytes=floor, floor_complete=complete, floor_region_actions=floor_plan,
        )
        logger.info(
            "plan (%s): %s, %d regions, predicted peak %d bytes (target %d), solve %.1fs", action.value,
            result.status.value, len(result.regions), result.timeline.peak_bytes, target_bytes, result.solve_time_s,
        )
    return results, time.perf_counter() - started


def price(planner: PlannerState, action: Action) -> None:
    """Calibrate ``action`` when the cost model has no price for it (offload, for a planner made without a pool).
    The problems prepared so far stay: the prices they use are unchanged."""
    if action in planner.costs.actions:
        return
    planner.costs = calibrate(planner._device, (*planner.costs.actions, action))
    if planner._context is not None:
        planner._context = dataclasses.replace(planner._context, costs=planner.costs)


def joint_for(planner: PlannerState, pool_capacity_bytes: int) -> JointProblem:
    """The joint problem over every recompute action planned for (each region its own) and offload."""
    if pool_capacity_bytes not in planner._joint:
        context = planner.context
        planner._joint[pool_capacity_bytes] = JointProblem(
            tuple(problem_for(planner, a, context) for a in planner.actions), problem_for(planner, Action.OFFLOAD, context),
            pool_capacity_bytes,
        )
    return planner._joint[pool_capacity_bytes]


def with_pool_needed(planner: PlannerState, error: InfeasibleBudgetError, target_bytes: int) -> InfeasibleBudgetError:
    """``error``, saying which host pool would make ``target_bytes`` feasible when a pool (or a larger one) would
    (found by planning with a pool that holds every offload candidate; nothing changes when none would)."""
    if planner.graph.kind is CaptureKind.MODULE or target_bytes < floor_lower_bound_bytes(planner.trace):
        return error  # no pool lowers what the step holds when it ends
    price(planner, Action.OFFLOAD)
    planner._on_stage("solve")
    joint = unbounded_pool(joint_for(planner, planner.host_pool_bytes))
    if joint.pool_capacity_bytes <= planner.host_pool_bytes:
        return error
    try:
        needed = solve_joint(joint, target_bytes, planner.solver_options).timeline.host_pool_bytes
    except InfeasibleBudgetError:
        return error
    pool_gb = math.ceil(needed / GB * 1000) / 1000
    return InfeasibleBudgetError(
        f"{error} A host pool makes it feasible: with host_pool_gb={pool_gb} ({format_bytes(needed)}), the plan "
        f"offloads saved tensors to host memory instead.",
        budget_bytes=error.budget_bytes, min_feasible_bytes=error.min_feasible_bytes, host_pool_bytes_needed=needed,
    )


def problem_for(planner: PlannerState, action: Action, context: PlanningContext) -> Problem:
    if action not in planner._problems:
        planner._problems[action] = prepared(planner, planner.trace, planner.costs, action)
    return planner._problems[action]


def prepared(planner: PlannerState, trace: StepTrace, costs: CostModel, action: Action) -> Problem:
    structure = find_repeated_blocks(planner.graph, trace) if planner._solves_by_blocks() else None
    return prepare(
        trace, costs, action, *candidate_regions(planner.graph, trace),
        seed_plans=baseline_seed_plans(planner.graph, trace), structure=structure,
    )
