"""Joint: keep, recompute or offload, per region, in one program under the device budget and the host pool.

The candidates are scored alone by the simulator under each action, as for one action (``prepare.py``): each recompute
problem's (one per recompute action planned for: both checkpoints under "auto", so each region gets its own) and the
offload problem's (``Action.OFFLOAD``), on the same event blocks.
The joint flat program gives every (region, action) a binary variable x:

    minimise    sum cost_ia * x_ia                          (added ms; for the floor: the peak P)
    subject to  base_b - sum gain_ia(b) * x_ia <= budget    per event block b (for the floor: <= P)
                sum pool_i * x_i,offload <= pool capacity   the host pool holds what offloaded regions save
                at most one chosen (region, action) covers each unit

``refine`` moves the effective budget until the simulated plan fits, peak *and* pool (``JointProblem.fits``). The
cheaper of the default solver's recompute-only plans, one per recompute action (block program, seeds, local passes:
``default.py``), is the plan to beat, so a pool never makes a plan worse than having none.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from autockpt.core.simulate import simulate
from autockpt.core.solve.base import (
    Problem,
    ProgramAnswer,
    ScoredCandidate,
    SolveResult,
    SolverOptions,
    region_actions,
    summarise_programs,
)
from autockpt.core.solve.default import solve_prepared
from autockpt.core.solve.local import drop_unneeded_regions, lower_floor_locally
from autockpt.core.solve.milp import answer_flat_program, build_flat_program
from autockpt.core.solve.pulp_tools import solver_name
from autockpt.core.solve.refine import Plan3, check_reachable, refine, refuse_static_over_budget
from autockpt.errors import InfeasibleBudgetError
from autockpt.types import Action, PlanStatus, Region, RegionAction, SolverStats, StepTrace, Timeline
from autockpt.units import format_bytes


@dataclass(frozen=True, slots=True)
class JointFloor:
    """The lowest simulated peak of the joint floor program's plan (within the pool)."""

    plan: tuple[RegionAction, ...]
    timeline: Timeline
    stats: SolverStats


@dataclass(slots=True)
class JointProblem:
    """Prepared problems on one trace and cost model: one per recompute action planned for and the offload problem;
    and the host pool's capacity in bytes."""

    recomputes: tuple[Problem, ...]
    offload: Problem
    pool_capacity_bytes: int
    scored: list[ScoredCandidate] = field(init=False)
    items: list[RegionAction] = field(init=False)  # per candidate of ``scored``: its region and action
    floors: dict[SolverOptions, JointFloor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        actions = [p.action for p in self.recomputes]
        if (
            self.offload.action is not Action.OFFLOAD or not actions or not all(a.recomputes for a in actions)
            or len(set(actions)) != len(actions)
        ):
            raise ValueError(
                "a joint problem needs one problem per distinct recompute action and an offload problem, got "
                f"{[a.value for a in actions]} and {self.offload.action.value}"
            )
        if any(p.block_base != self.offload.block_base or p.trace is not self.offload.trace for p in self.recomputes):
            raise ValueError("the recompute and offload problems must be prepared on the same trace and segments")
        offloads = [c for c in self.offload.scored if c.pool_bytes <= self.pool_capacity_bytes]
        self.scored, self.items = [], []
        for problem in self.recomputes:
            self.scored += problem.scored
            self.items += [RegionAction(region=c.region, action=problem.action) for c in problem.scored]
        self.scored += offloads
        self.items += [RegionAction(region=c.region, action=Action.OFFLOAD) for c in offloads]

    @property
    def recompute(self) -> Problem:
        """The first recompute action's problem (its seeds start the floor's descent, offloaded)."""
        return self.recomputes[0]

    @property
    def trace(self) -> StepTrace:
        return self.recompute.trace

    @property
    def baseline(self) -> Timeline:
        return self.recompute.baseline

    @property
    def block_base(self) -> list[int]:
        return self.recompute.block_base

    @property
    def block_of_event(self) -> list[int]:
        return self.recompute.block_of_event

    @property
    def action(self) -> Action:
        """The first recompute action (a plan records the action of its recompute-only rival)."""
        return self.recompute.action

    def simulate(self, plan: Sequence[RegionAction]) -> Timeline:
        ordered = tuple(sorted(plan, key=lambda ra: ra.region.first_unit))
        return simulate(self.trace, self.offload.scorer.costs, ordered)

    def fits(self, timeline: Timeline, budget_bytes: int) -> bool:
        """The simulated device peak is within the budget and what the plan offloads within the pool."""
        return timeline.peak_bytes <= budget_bytes and timeline.host_pool_bytes <= self.pool_capacity_bytes

    @staticmethod
    def region_of(item: RegionAction) -> Region:
        return item.region


def solve_joint_program(
    joint: JointProblem,
    budget: float | None,
    options: SolverOptions,
    solver: str,
    *,
    excluded: Sequence[tuple[RegionAction, ...]] = (),
    peak_cutoff_bytes: int | None = None,
) -> ProgramAnswer:
    """The joint flat program at ``budget`` (None: the lowest peak within the pool)."""
    built = build_flat_program(
        joint.scored, joint.block_base, budget, excluded, items=joint.items,
        pool_capacity_bytes=joint.pool_capacity_bytes,
    )
    return answer_flat_program(built, budget, options, solver, peak_cutoff_bytes)


def joint_floor(joint: JointProblem, options: SolverOptions, solver: str) -> JointFloor:
    """The lowest simulated peak within the pool (once per options): the joint floor program's plan, the recompute
    floor, the finest offload plan and the seed plans offloaded, each lowered by local descent."""
    floor = joint.floors.get(options)
    if floor is not None:
        return floor
    answer = solve_joint_program(joint, None, options, solver)
    plans = [tuple(answer.regions or ()), finest_offload(joint)]
    for recompute in joint.recomputes:
        if options in recompute.floors:  # the default solver's recompute floor, found before this one
            plans.append(region_actions(recompute.floors[options].regions, recompute.action))
    plans += [region_actions(seed.regions, Action.OFFLOAD) for seed in joint.recompute.seeds]
    starts = [(plan, joint.simulate(plan)) for plan in plans]
    starts = [(plan, timeline) for plan, timeline in starts if joint.fits(timeline, timeline.peak_bytes)]
    plan, timeline, _ = lower_floor_locally(joint, starts or [((), joint.baseline)])
    floor = joint.floors[options] = JointFloor(plan, timeline, answer.stats)
    return floor


def finest_offload(joint: JointProblem) -> tuple[RegionAction, ...]:
    """The shortest disjoint offload candidates, earliest first, while the pool holds them: short regions are
    fetched back a little at a time, so the floor of offloading alone is near this plan."""
    chosen: list[Region] = []
    pool_bytes = 0
    for candidate in sorted(joint.offload.scored, key=lambda c: (c.region.last_unit - c.region.first_unit, c.region.first_unit)):
        if pool_bytes + candidate.pool_bytes > joint.pool_capacity_bytes or any(candidate.region.overlaps(r) for r in chosen):
            continue
        chosen.append(candidate.region)
        pool_bytes += candidate.pool_bytes
    return region_actions(sorted(chosen, key=lambda r: r.first_unit), Action.OFFLOAD)


def solve_joint(joint: JointProblem, budget_bytes: int, options: SolverOptions | None = None) -> SolveResult:
    """The cheapest plan under ``budget_bytes`` whose regions each keep, recompute or offload within the pool.

    The recompute-only plans of the default solver (one per recompute action) are found first; the cheaper is kept
    unless the joint program finds a plan that fits and adds less predicted step time. ``min_feasible_bytes`` is the
    lowest of the floors. A budget under the static bytes is refused first (``refine.refuse_static_over_budget``).
    """
    options = options or SolverOptions()
    refuse_static_over_budget(joint.trace, budget_bytes, lambda: solve_joint(joint, budget_bytes, options))
    started = time.perf_counter()
    solver = solver_name(options)
    alones: list[SolveResult] = []  # each recompute action's plan alone (the default solver's)
    floors: list[int] = []
    for problem in joint.recomputes:
        try:
            alones.append(solve_prepared(problem, budget_bytes, options))
            floors.append(alones[-1].min_feasible_bytes)
        except InfeasibleBudgetError as error:
            floors.append(error.min_feasible_bytes)
    alone = min(alones, key=lambda r: r.timeline.overhead_ms) if alones else None  # the first action's on a tie
    recompute_floor = min(floors)
    floor = joint_floor(joint, options, solver)
    min_feasible = min(recompute_floor, floor.timeline.peak_bytes)
    if alone is not None and alone.status is PlanStatus.IDENTITY:  # nothing to do; the floor is for budgets to come
        return dataclasses.replace(alone, min_feasible_bytes=min_feasible)
    programs = [alone.stats] if alone is not None else []
    programs.append(floor.stats)
    check_reachable(joint, budget_bytes, min_feasible)

    best: Plan3 | None = None
    if alone is not None:
        best = (alone.region_actions, alone.timeline, alone.status)
    if joint.fits(floor.timeline, budget_bytes) and (best is None or floor.timeline.overhead_ms < best[1].overhead_ms):
        best = (floor.plan, floor.timeline, PlanStatus.FEASIBLE)
    best = refine(joint, budget_bytes, options, solve_joint_program, solver, programs, best=best, rules_out_sets=True)
    if best is None:
        raise InfeasibleBudgetError(
            f"no plan found under the budget {format_bytes(budget_bytes)} with a host pool of "
            f"{format_bytes(joint.pool_capacity_bytes)}; the smallest simulated peak found is "
            f"{format_bytes(min_feasible)}. Raise the budget or the pool (host_pool_gb).",
            budget_bytes=budget_bytes, min_feasible_bytes=min_feasible,
        )
    plan, timeline, status = drop_unneeded_regions(joint, *best, budget_bytes)
    recompute_only = alone is not None and plan == alone.region_actions
    return SolveResult(
        region_actions=tuple(sorted(plan, key=lambda ra: ra.region.first_unit)),
        action=alone.action if alone is not None else joint.action,
        timeline=timeline, baseline=joint.baseline, min_feasible_bytes=min_feasible,
        floor_complete=all(r.floor_complete for r in alones), status=status,
        solver=alone.solver if recompute_only else f"{solver} (joint keep/recompute/offload program)",
        solve_time_s=time.perf_counter() - started, stats=summarise_programs(programs),
    )


def unbounded_pool(joint: JointProblem) -> JointProblem:
    """The same problem with a pool that holds every offload candidate at once: what a budget needs at most."""
    capacity = sum(c.pool_bytes for c in joint.offload.scored)
    return dataclasses.replace(joint, pool_capacity_bytes=capacity, floors={})
