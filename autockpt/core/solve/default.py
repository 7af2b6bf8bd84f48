"""The default solver (``strategy="autockpt"``): every algorithm of this package, each where it does best.

0. **Static memory** first: a budget under the static bytes (parameters, gradients, optimizer states, buffers,
   inputs) is refused before any floor is searched; the error searches the floor when its ``min_feasible_bytes`` is
   read (``refine.refuse_static_over_budget``).
1. **Floor**, once per problem and options, in two steps. The quick floor: the block program's lowest peak and the
   seed plans, each lowered by local descent (``local.lower_floor_locally``); it proves a budget reachable in well
   under a second, and a budget at or above it is solved without the next step. The full floor, when a budget is
   below the quick floor, when the budget needs no plan (the unmodified peak fits: the plan then reports the floor
   for budgets to come) or when the problem has no repeated blocks: also the flat MILP minimising the peak (HiGHS
   prunes with the lowest peak known so far), or the greedy order when it finds nothing in time; seconds on 12
   layers. A quick floor at the bound no plan goes under (``refine.floor_lower_bound_bytes``) is the full floor
   already.
   ``SolveResult.floor_complete`` says which one ``min_feasible_bytes`` comes from.
2. **Plan**: ``refine`` with the block program (its chain DP answers in milliseconds) at budgets it can reach, else
   with the flat MILP; the greedy plan when a program ran out of time.
3. **Polish**, judged by the simulator: drop regions the plan does not need, swap for cheaper candidates, and take a
   seed plan (a baseline policy) that fits and adds less time, so a plan is never worse than a baseline.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from autockpt.core.solve.base import Floor, Problem, SolveResult, SolverOptions, region_actions, summarise_programs
from autockpt.core.solve.blocks import solve_block_program
from autockpt.core.solve.greedy import greedy_regions
from autockpt.core.solve.local import drop_unneeded_regions, lower_floor_locally, swap_for_cheaper
from autockpt.core.solve.milp import solve_flat_program
from autockpt.core.solve.pulp_tools import no_incumbent, solver_name
from autockpt.core.solve.refine import (
    check_reachable,
    floor_lower_bound_bytes,
    identity_result,
    no_plan_error,
    refine,
    refuse_static_over_budget,
)
from autockpt.types import PlanStatus, Region, SolverStats, Timeline

logger = logging.getLogger(__name__)


def solve_prepared(problem: Problem, budget_bytes: int, options: SolverOptions | None = None) -> SolveResult:
    """The cheapest plan under ``budget_bytes`` on a prepared problem (the floor is solved once per options). A
    budget under the static bytes is refused first, the floor searched only when the error's ``min_feasible_bytes``
    is read (``refine.refuse_static_over_budget``)."""
    options = options or SolverOptions()
    refuse_static_over_budget(problem.trace, budget_bytes, lambda: solve_prepared(problem, budget_bytes, options))
    started = time.perf_counter()
    baseline = problem.baseline
    solver = solver_name(options)
    floor = floor_for(problem, options, solver, budget_bytes)
    programs: list[SolverStats] = [floor.stats]
    fallbacks: list[str] = ["memory floor"] if floor.greedy else []
    min_feasible = min(floor.timeline.peak_bytes, baseline.peak_bytes)
    floor_plan = region_actions(floor.regions if floor.timeline.peak_bytes < baseline.peak_bytes else (), problem.action)
    if budget_bytes >= baseline.peak_bytes:
        return identity_result(problem, min_feasible, solver, started, programs, floor_plan)
    check_reachable(problem, budget_bytes, min_feasible)

    best = (floor.regions, floor.timeline, PlanStatus.FEASIBLE) if floor.timeline.peak_bytes <= budget_bytes else None
    # the block program solves in milliseconds; below its own floor only the flat program has plans
    use_blocks = floor.block_peak_bytes is not None and budget_bytes >= floor.block_peak_bytes
    program = solve_block_program if use_blocks else solve_flat_program
    best = refine(problem, budget_bytes, options, program, solver, programs, best=best, rules_out_sets=not use_blocks)
    if any(no_incumbent(p) for p in programs[1:]):  # a plan program timed out: the greedy plan may be cheaper
        regions = greedy_regions(problem, budget_bytes)
        timeline = problem.simulate(regions)
        if timeline.peak_bytes <= budget_bytes and (best is None or timeline.overhead_ms < best[1].overhead_ms):
            best = (regions, timeline, PlanStatus.FEASIBLE)
            fallbacks.append("plan")
    if best is not None:
        best = drop_unneeded_regions(problem, *best, budget_bytes)
        best = swap_for_cheaper(problem, *best, budget_bytes)
    cheaper_seed = min(
        (seed for seed in problem.seeds if seed.timeline.peak_bytes <= budget_bytes
         and (best is None or seed.timeline.overhead_ms < best[1].overhead_ms)),
        key=lambda seed: seed.timeline.overhead_ms, default=None,
    )
    if cheaper_seed is not None:  # the program's approximations missed a plan at least this good
        best = (cheaper_seed.regions, cheaper_seed.timeline, PlanStatus.FEASIBLE)
        solver = f"{solver} (seed plan {cheaper_seed.name} was cheaper)"
        logger.info("the %s baseline plan adds less step time than the program's plan; using it", cheaper_seed.name)
    if fallbacks:
        logger.warning(
            "the %s solver found no solution within %.1f s for the %s; used a greedy plan instead (raise "
            "SolverOptions.time_limit_s for a better one)", solver, options.time_limit_s, " and the ".join(fallbacks),
        )
        solver = f"{solver} + greedy fallback ({', '.join(fallbacks)})"
    if best is None:
        raise no_plan_error(budget_bytes, floor.timeline.peak_bytes)
    regions, timeline, status = best
    return SolveResult(
        region_actions=region_actions(regions, problem.action), action=problem.action, timeline=timeline, baseline=baseline, min_feasible_bytes=min_feasible,
        floor_complete=floor.complete, status=status, solver=solver, solve_time_s=time.perf_counter() - started, stats=summarise_programs(programs),
        floor_region_actions=floor_plan,
    )


def floor_for(problem: Problem, options: SolverOptions, solver: str, budget_bytes: int) -> Floor:
    """The floor ``budget_bytes`` needs (see the module's docstring), computed once per problem and options."""
    floor = problem.floors.get(options)
    if floor is None and problem.blocks is not None:
        floor = quick_floor(problem, options, solver)
        if floor is not None and floor.timeline.peak_bytes <= floor_lower_bound_bytes(problem.trace):
            # it reaches the bound no plan goes under (the step's end: the optimizer's step, the output; an op's own
            # working set): the full search finds no lower peak (a chunked loss's floor is often this one)
            floor = dataclasses.replace(floor, complete=True)
        if floor is not None:
            problem.floors[options] = floor
    if floor is not None and (floor.complete or floor.timeline.peak_bytes <= budget_bytes < problem.baseline.peak_bytes):
        return floor
    floor = problem.floors[options] = find_floor(problem, options, solver, quick=floor)
    return floor


def quick_floor(problem: Problem, options: SolverOptions, solver: str) -> Floor | None:
    """The lowest simulated peak of the block program's floor and the seed plans, each lowered by local descent;
    None when the block program found nothing in time (the full search then runs, with its greedy fallback)."""
    assert problem.blocks is not None
    block_answer = solve_block_program(problem, None, options, solver)
    if no_incumbent(block_answer.stats):
        return None
    block_regions = block_answer.regions or ()
    block_start = (block_regions, problem.simulate(block_regions))
    starts = [block_start, *((seed.regions, seed.timeline) for seed in problem.seeds)]
    regions, timeline, _ = lower_floor_locally(problem, starts)
    return Floor(
        regions, timeline, block_answer.stats, False, block_start[1].peak_bytes, block_start=block_start,
        complete=False,
    )


def find_floor(problem: Problem, options: SolverOptions, solver: str, *, quick: Floor | None = None) -> Floor:
    """The lowest simulated peak found: the programs' floors and the seed plans, each lowered by local descent
    (``quick``: the quick floor already found, whose block program is not solved again)."""
    floor_programs: list[SolverStats] = []
    lowest_seed = min(problem.seeds, key=lambda seed: seed.timeline.peak_bytes, default=None)
    # the lowest seed's peak is a cutoff: branches that cannot beat it are pruned (about twice as fast on GPT-2)
    cutoff = lowest_seed.timeline.peak_bytes if lowest_seed is not None else None
    answer = solve_flat_program(problem, None, options, solver, peak_cutoff_bytes=cutoff)
    floor_programs.append(answer.stats)
    floor_regions = answer.regions or ()
    timed_out = no_incumbent(answer.stats)
    if timed_out:
        floor_regions = greedy_regions(problem, None)
    starts = [(floor_regions, problem.simulate(floor_regions))]
    starts += [(seed.regions, seed.timeline) for seed in problem.seeds]
    block_start = None
    if quick is not None:  # its block program's floor, already solved and simulated
        floor_programs.append(quick.stats)
        block_start = quick.block_start
    elif problem.blocks is not None:
        block_answer = solve_block_program(problem, None, options, solver)
        floor_programs.append(block_answer.stats)
        block_regions = block_answer.regions or ()
        block_start = (block_regions, problem.simulate(block_regions))
    if block_start is not None:
        starts.append(block_start)
    regions, timeline, lowest_start = lower_floor_locally(problem, starts)
    greedy = timed_out and lowest_start == 0  # the greedy plan (or a descent from it) is the floor
    return Floor(
        regions, timeline, floor_programs[0], greedy, block_start[1].peak_bytes if block_start else None,
        block_start=block_start, complete=True,
    )


def floor_by_bytes(problem: Problem, options: SolverOptions) -> tuple[tuple[Region, ...], Timeline]:
    """The floor's own plan chosen by bytes alone, on a problem prepared from a trace whose units are all timed alike
    (``api.Planner.floor_plans``): the full floor search (``find_floor``), then the regions its peak does not need
    dropped, largest first. On measured times the search picks among byte-equal plans by them (which trimmed regions
    are offered, which block plans are dominated, which plan the program returns), so its plan, and what that plan
    measures, moved with the machine's load (issue 37); timed alike, the same bytes give the same plan."""
    floor = find_floor(problem, options, solver_name(options))
    regions, timeline, _ = drop_unneeded_regions(
        problem, floor.regions, floor.timeline, PlanStatus.FEASIBLE, floor.timeline.peak_bytes
    )
    return regions, timeline
