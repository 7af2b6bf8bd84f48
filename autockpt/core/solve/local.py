"""Local search around a plan, judged by the simulator: where the programs' additive model stops short.

The programs add the gains of disjoint regions up and charge forward memory per group of events at its worst; the
simulator sees how regions interact. These passes try one region more, one fewer, or a swap, and keep what the
simulator says is lower (the floor) or cheaper under the budget (a plan).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from autockpt.core.solve.base import FloorSearch, PlanSearch, Problem
from autockpt.types import PlanStatus, Region, Timeline

FLOOR_SEARCH_SIMULATIONS = 120  # in all, over every starting plan: about 1-5 ms each on a 12-layer GPT-2
FLOOR_SEARCH_ADDITIONS = 8  # candidates tried per step, those freeing most at the current peak event first
SWAP_SIMULATIONS = 40  # per plan: about 1-5 ms each on a 12-layer GPT-2


def lower_floor_locally(
    problem: FloorSearch, starts: Sequence[tuple[tuple[Any, ...], Timeline]]
) -> tuple[tuple[Any, ...], Timeline, int]:
    """The lowest simulated peak a descent from any of ``starts`` (the programs' floors, the seed plans) reaches,
    and the index of the start it descended from.

    One step tries dropping each region, then adding each of the candidates that free most at the current peak
    event (replacing the regions they overlap, including the same region under another action), and takes the first
    that lowers the simulated peak and fits the problem's other limits (the host pool). The programs add gains up;
    where regions interact (one region's recomputation burst sits on another's gain) they can stop above a plan that
    one more region, one fewer or a swap reaches.
    """
    simulations = 0
    items = problem.items

    def lower(plan: tuple[Any, ...], timeline: Timeline) -> tuple[tuple[Any, ...], Timeline] | None:
        nonlocal simulations
        block = problem.block_of_event[timeline.peak_event]
        helpful = sorted(
            (k for k, c in enumerate(problem.scored) if c.gains.get(block, 0) > 0 and items[k] not in plan),
            key=lambda k: -problem.scored[k].gains[block],
        )[:FLOOR_SEARCH_ADDITIONS]
        trials = [tuple(item for item in plan if item != dropped) for dropped in plan]
        trials += [put_in(plan, items[k], problem.region_of) for k in helpful]
        for trial in trials:
            if simulations >= FLOOR_SEARCH_SIMULATIONS:
                return None
            simulations += 1
            trial_timeline = problem.simulate(trial)
            if trial_timeline.peak_bytes < timeline.peak_bytes and problem.fits(trial_timeline, trial_timeline.peak_bytes):
                return trial, trial_timeline
        return None

    order = sorted(range(len(starts)), key=lambda i: starts[i][1].peak_bytes)
    best = (*starts[order[0]], order[0])
    for index in order:
        step: tuple[tuple[Any, ...], Timeline] | None = starts[index]
        while step is not None:
            plan, timeline = step
            step = lower(plan, timeline)
        if timeline.peak_bytes < best[1].peak_bytes:
            best = (plan, timeline, index)
    return best


def put_in(plan: tuple[Any, ...], item: Any, region_of: Callable[[Any], Region] = lambda r: r) -> tuple[Any, ...]:
    """``plan`` with ``item`` in place of the items whose regions overlap its region, in unit order."""
    region = region_of(item)
    kept = [other for other in plan if not region_of(other).overlaps(region)]
    return tuple(sorted([*kept, item], key=lambda other: region_of(other).first_unit))


def swap_for_cheaper(
    problem: Problem, regions: tuple[Region, ...], timeline: Timeline, status: PlanStatus, budget_bytes: int
) -> tuple[tuple[Region, ...], Timeline, PlanStatus]:
    """Put a candidate in place of the plan's regions it overlaps, then drop what the plan no longer needs; keep the
    first such plan that fits and adds less step time, and go on from it.

    The programs charge forward memory per group of events at its worst, so a region can look like it does not fit
    where the simulator shows it does. Swaps that save most are tried first; a swap that costs more on its own can
    still pay when it frees enough for other regions to go.
    """
    cost = {c.region: c.cost_ms for c in problem.scored}
    simulations = 0

    def swaps(current: tuple[Region, ...]) -> list[tuple[float, Region]]:
        """(cost change, candidate) for each candidate that overlaps the plan and costs less than all of it."""
        total = sum(cost.get(r, math.inf) for r in current)
        found = []
        for candidate in problem.scored:
            region = candidate.region
            overlapped = [r for r in current if r.overlaps(region)]
            if region in current or not overlapped or candidate.cost_ms >= total:
                continue
            found.append((candidate.cost_ms - sum(cost.get(r, math.inf) for r in overlapped), region))
        return sorted(found, key=lambda swap: swap[0])

    improved = True
    while improved and simulations < SWAP_SIMULATIONS:
        improved = False
        for _, region in swaps(regions):
            if simulations >= SWAP_SIMULATIONS:
                break
            trial = put_in(regions, region)
            trial_timeline = problem.simulate(trial)
            simulations += 1
            if trial_timeline.peak_bytes > budget_bytes:
                continue
            if trial_timeline.overhead_ms >= timeline.overhead_ms:
                simulations += len(trial)
                trial, trial_timeline, _ = drop_unneeded_regions(problem, trial, trial_timeline, status, budget_bytes)
            if trial_timeline.overhead_ms < timeline.overhead_ms:
                regions, timeline, status, improved = trial, trial_timeline, PlanStatus.FEASIBLE, True
                break
    return regions, timeline, status


def drop_unneeded_regions(
    problem: PlanSearch, regions: tuple[Any, ...], timeline: Timeline, status: PlanStatus, budget_bytes: int
) -> tuple[tuple[Any, ...], Timeline, PlanStatus]:
    """One pass, most expensive region first: drop each region whose removal keeps the simulated peak in budget.

    The program charges forward memory per group of events at its worst, so it can checkpoint a region the exact
    simulation shows is not needed; dropping it only saves time.
    """
    profile = problem.trace

    def forward_ms(item: Any) -> float:
        region = problem.region_of(item)
        return sum(profile.units[u].forward_ms for u in range(region.first_unit, region.last_unit + 1))

    kept = list(regions)
    for region in sorted(regions, key=forward_ms, reverse=True):
        trial = [r for r in kept if r != region]
        trial_timeline = problem.simulate(trial)
        if problem.fits(trial_timeline, budget_bytes) and trial_timeline.overhead_ms <= timeline.overhead_ms:
            kept, timeline, status = trial, trial_timeline, PlanStatus.FEASIBLE
    return tuple(kept), timeline, status
