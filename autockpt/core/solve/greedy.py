"""Greedy: candidate regions in order of added milliseconds per byte freed, each kept if it lowers the simulated peak.

The fallback when a program finds no solution in time, and a baseline for the programs' plan quality.
"""

from __future__ import annotations

from autockpt.core.solve.base import Problem, ScoredCandidate
from autockpt.types import Region


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
