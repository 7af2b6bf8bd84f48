"""Greedy: candidate regions in order of added milliseconds per byte freed, each kept if it lowers the simulated peak.

The fallback when a program finds no solution in time, and a baseline for the programs' plan quality.
"""

from __future__ import annotations

import time

from autockpt.core.solve.base import NO_PROGRAM, Problem, ScoredCandidate, SolveResult, SolverOptions, region_actions
from autockpt.core.solve.refine import check_reachable, identity_result, no_plan_error
from autockpt.types import PlanStatus, Region


class GreedySolver:
    """``greedy_regions`` at the budget; its floor is where the same order gets with no budget."""

    name = "greedy"

    def solve(self, problem: Problem, budget_bytes: int, options: SolverOptions) -> SolveResult:
        started = time.perf_counter()
        floor = problem.simulate(greedy_regions(problem, None)).peak_bytes
        min_feasible = min(floor, problem.baseline.peak_bytes)
        if budget_bytes >= problem.baseline.peak_bytes:
            return identity_result(problem, min_feasible, self.name, started, [NO_PROGRAM])
        check_reachable(problem, budget_bytes, min_feasible)
        regions = greedy_regions(problem, budget_bytes)
        timeline = problem.simulate(regions)
        if timeline.peak_bytes > budget_bytes:
            raise no_plan_error(budget_bytes, floor)
        return SolveResult(
            region_actions=region_actions(regions, problem.action), action=problem.action, timeline=timeline, baseline=problem.baseline,
            min_feasible_bytes=min_feasible, status=PlanStatus.FEASIBLE, solver=self.name,
            solve_time_s=time.perf_counter() - started, stats=NO_PROGRAM,
        )


def greedy_regions(problem: Problem, budget_bytes: int | None) -> tuple[Region, ...]:
    """Fallback when the solver returns no solution in time: add candidate regions in order of recompute ms per byte
    of their largest gain, keeping each one that lowers the simulated peak, until the peak is under ``budget_bytes``
    (None: as low as this order gets it)."""
    def cost_per_byte(candidate: ScoredCandidate) -> float:
        return candidate.cost_ms / max(1, max(candidate.gains.values(), default=0))

    chosen: list[Region] = []
    peak = problem.baseline.peak_bytes
    for candidate in sorted(problem.scored, key=cost_per_byte):
        if budget_bytes is not None and peak <= budget_bytes:
            break
        region = candidate.region
        if any(region.overlaps(other) for other in chosen):
            continue
        trial = sorted([*chosen, region], key=lambda r: r.first_unit)
        trial_peak = problem.simulate(trial).peak_bytes
        if trial_peak < peak:
            chosen, peak = trial, trial_peak
    return tuple(chosen)
