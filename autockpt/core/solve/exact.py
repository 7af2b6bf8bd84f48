"""Reference solver for tests and experiments: the cheapest checkpoint-region plan under a budget, by enumeration.

``exact_regions`` searches every set of non-overlapping contiguous unit ranges (any ranges, not only the production
solver's candidates) and returns the one with the least simulated recompute time whose simulated peak fits the
budget. It is exact with respect to the simulator (``autockpt.core.simulate``), and the search is exponential in the
number of units (the sets of disjoint ranges of n units number F(2n+1), about 2.6^n), so it refuses large profiles.

Exact *over checkpoint-region plans*: what ``torch.utils.checkpoint`` can run, each region dropping everything it
saved and re-running its units in backward. It is not an optimum over arbitrary rematerialisation schedules
(Checkmate-style per-tensor keep/recompute decisions at any point of the step), which can do better and which no
region plan can express.

How: a region's recompute cost depends only on the region (which units it re-runs is fixed by the measured
backward, not by the other regions), so a set's cost is the sum of its regions' costs. The search pops region sets
in increasing total cost from a priority queue and simulates each; the first set that fits the budget is optimal.
A cheap bound (``removable_bytes``: what a region can at most free at each event) rules out most sets that cannot
fit without simulating them.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import numpy as np

from autockpt.core.solve.base import Scorer
from autockpt.core.solve.candidates import is_unsafe, mutation_hazards
from autockpt.errors import InfeasibleBudgetError
from autockpt.types import Region, StepTrace


@dataclass(frozen=True, kw_only=True, slots=True)
class ExactResult:
    regions: tuple[Region, ...]
    peak_bytes: int  # simulated peak of the plan
    overhead_ms: float  # simulated added step time of the plan (recompute + checkpoint machinery)
    plans_examined: int  # region sets considered, cheapest first, up to and including the optimum
    plans_simulated: int = 0  # of those, the ones the memory bound could not rule out (the rest were not simulated)


def exact_regions(scorer: Scorer, budget_bytes: int, *, max_units: int = 14) -> ExactResult:
    """The cheapest set of regions (by simulated recompute ms) whose simulated peak is at most ``budget_bytes``.

    Raises ``ValueError`` when the profile has more than ``max_units`` units (the search is exponential), and
    ``InfeasibleBudgetError`` when no region set fits; its ``min_feasible_bytes`` is then the exact smallest peak
    of any region plan (``min_peak_bytes``).
    """
    profile, simulate = scorer.trace, scorer.simulate
    num_units = len(profile.units)
    if num_units > max_units:
        raise ValueError(
            f"exact_regions enumerates region sets, exponential in the number of units: this profile has "
            f"{num_units} units, more than max_units={max_units}. Use a smaller model, or raise max_units if you can "
            f"wait (about 2.6x longer per extra unit)."
        )
    regions = usable_regions(profile)
    cost = [simulate((region,)).overhead_ms for region in regions]
    # extensions[p + 1]: regions starting after unit p, cheapest first (p = -1: any region)
    extensions = [
        sorted((i for i, r in enumerate(regions) if r.first_unit > p), key=lambda i: cost[i])
        for p in range(-1, num_units)
    ]

    measured = np.array([event.peak_bytes for event in profile.events], dtype=np.int64)
    removable = [removable_bytes(profile, region) for region in regions]
    examined = simulated = 0

    def check(chosen: tuple[int, ...]) -> ExactResult | None:
        nonlocal examined, simulated
        examined += 1
        # Sound pruning: no event can drop below its measured bytes minus what the regions may free there, so a
        # set whose bound is over the budget is infeasible without simulating it
        if chosen and int((measured - sum(removable[i] for i in chosen)).max()) > budget_bytes:
            return None
        simulated += 1
        plan = tuple(regions[i] for i in chosen)
        timeline = simulate(plan)
        if timeline.peak_bytes > budget_bytes:
            return None
        return ExactResult(
            regions=plan, peak_bytes=timeline.peak_bytes, overhead_ms=timeline.overhead_ms,
            plans_examined=examined, plans_simulated=simulated,
        )

    found = check(())
    if found is not None:
        return found
    # Each heap entry stands for one region set, prefix + extensions[after][k]; popping it also pushes its next
    # sibling (the (k+1)-th cheapest extension of the same prefix) and its first child (the set extended by its
    # cheapest following region). Costs are >= 0, so sets come out in non-decreasing cost, each exactly once.
    # Among sets of equal cost the one with fewer regions comes first (a region that re-runs nothing costs 0 ms but
    # is one more checkpoint call); children have one region more, so the order stays monotone.
    order = itertools.count()  # last tie-break: never compare the tuples
    heap: list[tuple[float, int, int, float, tuple[int, ...], int, int]] = []

    def push(prefix_cost: float, prefix: tuple[int, ...], after: int, k: int) -> None:
        options = extensions[after + 1]
        if k < len(options):
            entry = (prefix_cost + cost[options[k]], len(prefix) + 1, next(order), prefix_cost, prefix, after, k)
            heapq.heappush(heap, entry)

    push(0.0, (), -1, 0)
    while heap:
        total, _, _, prefix_cost, prefix, after, k = heapq.heappop(heap)
        region = extensions[after + 1][k]
        chosen = (*prefix, region)
        found = check(chosen)
        if found is not None:
            return found
        push(prefix_cost, prefix, after, k + 1)
        push(total, chosen, regions[region].last_unit, 0)
    floor = min_peak_bytes(scorer, max_units=max_units)
    raise InfeasibleBudgetError(
        f"no set of checkpoint regions brings the simulated peak to {budget_bytes} bytes; the smallest peak of any "
        f"region plan is {floor} bytes",
        budget_bytes=budget_bytes,
        min_feasible_bytes=floor,
    )


def min_peak_bytes(scorer: Scorer, *, max_units: int = 14) -> int:
    """The smallest simulated peak of any region plan (the exact memory floor), by depth-first enumeration.

    Sets whose memory bound is not below the best peak found so far are not simulated; nothing else is skipped.
    """
    profile, simulate = scorer.trace, scorer.simulate
    num_units = len(profile.units)
    if num_units > max_units:
        raise ValueError(
            f"min_peak_bytes enumerates region sets, exponential in the number of units: this profile has "
            f"{num_units} units, more than max_units={max_units}"
        )
    regions = usable_regions(profile)
    measured = np.array([event.peak_bytes for event in profile.events], dtype=np.int64)
    removable = [removable_bytes(profile, region) for region in regions]
    starting_after = [[i for i, r in enumerate(regions) if r.first_unit > p] for p in range(-1, num_units)]
    best = simulate(()).peak_bytes

    def visit(chosen: list[int], freed: np.ndarray, after: int) -> None:
        nonlocal best
        for i in starting_after[after + 1]:
            total = freed + removable[i]
            chosen.append(i)
            if int((measured - total).max()) < best:
                best = min(best, simulate(tuple(regions[j] for j in chosen)).peak_bytes)
            # a superset may free more than this set, so the bound of this set does not prune its extensions
            visit(chosen, total, regions[i].last_unit)
            chosen.pop()

    visit([], np.zeros(len(profile.events), dtype=np.int64), -1)
    return best


def removable_bytes(profile: StepTrace, region: Region) -> np.ndarray:
    """Per event, an upper bound on the bytes checkpointing ``region`` can take off the measured timeline.

    In the simulator a plan frees a storage earlier only when the storage is made and saved inside one region, and
    never before the storage's last forward use; everything else a plan does (held inputs, recomputed copies,
    replay bursts) adds bytes. A storage has one producer, so the bounds of disjoint regions add up. This mirrors
    the simulator's rules; tests/core/solve/test_exact.py checks it against ``simulate`` for every region set of small
    graphs, so a simulator change that frees memory in a new way shows up there.
    """
    bound = np.zeros(len(profile.events), dtype=np.int64)
    for storage in profile.storages:
        if storage.free_event is None or storage.producer_unit not in region:
            continue
        if any(saver in region for saver in storage.saver_units):
            bound[storage.last_forward_use_event + 1 : storage.free_event + 1] += storage.nbytes
    return bound


def usable_regions(profile: StepTrace) -> list[Region]:
    """Every contiguous unit range that saves something for backward and is safe to checkpoint (no in-place write
    into one of its inputs); a range that saves nothing frees nothing and only adds recompute."""
    num_units = len(profile.units)
    saves = [unit.saved_bytes > 0 for unit in profile.units]
    hazards = mutation_hazards(profile)
    return [
        Region(first_unit=a, last_unit=b)
        for a in range(num_units)
        for b in range(a, num_units)
        if any(saves[a : b + 1]) and not is_unsafe(Region(first_unit=a, last_unit=b), hazards)
    ]
