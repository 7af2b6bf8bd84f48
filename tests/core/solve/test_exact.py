"""The exact solver (``autockpt.core.solve.exact``, enumeration over small graphs): checked against plain brute force,
the in-place hazards it must skip, and the graph size it refuses. It is the oracle the production solver is judged
by (test_optimality.py)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from support import torch_scorer

import autockpt
from autockpt.core.solve.candidates import is_unsafe, mutation_hazards
from autockpt.core.solve.exact import exact_regions, min_peak_bytes, removable_bytes, usable_regions
from autockpt.errors import InfeasibleBudgetError
from autockpt.present import zoo
from autockpt.types import Region, StepTrace
from experiments.common.random_graphs import modelled_costs, modelled_planner


def _all_region_sets(profile: StepTrace) -> list[tuple[Region, ...]]:
    """Brute force: every set of disjoint safe ranges, including ranges that save nothing (the exact search
    leaves those out; brute force checks that this loses nothing)."""
    hazards = mutation_hazards(profile)
    n = len(profile.units)
    ranges = [Region(first_unit=a, last_unit=b) for a in range(n) for b in range(a, n)]
    ranges = [r for r in ranges if not is_unsafe(r, hazards)]
    found: list[tuple[Region, ...]] = []

    def extend(chosen: tuple[Region, ...], after: int) -> None:
        found.append(chosen)
        for region in ranges:
            if region.first_unit > after:
                extend((*chosen, region), region.last_unit)

    extend((), -1)
    return found


@pytest.mark.parametrize("seed", [2, 40, 41])
def test_exact_search_matches_brute_force(seed: int) -> None:
    profile = modelled_planner(seed).trace
    scorer = torch_scorer(profile)
    assert 5 <= len(profile.units) <= 8
    sets = _all_region_sets(profile)
    timelines = [scorer.simulate(s) for s in sets]

    measured = np.array([e.peak_bytes for e in profile.events])
    for regions, timeline in itertools.islice(zip(sets, timelines), 0, None, 7):
        # a set's recompute time is the sum of its regions' (what makes cheapest-first enumeration exact) ...
        assert timeline.recompute_ms == pytest.approx(sum(scorer.simulate((r,)).recompute_ms for r in regions))
        # ... and the pruning bound never exceeds the simulated bytes of any event
        bound = measured - sum((removable_bytes(profile, r) for r in regions), np.zeros_like(measured))
        assert (bound <= np.array(timeline.event_bytes)).all()

    floor = min(t.peak_bytes for t in timelines)
    baseline = scorer.simulate(()).peak_bytes
    assert floor < baseline
    assert min_peak_bytes(scorer) == floor
    budgets = sorted({floor, *(int(floor + f * (baseline - floor)) for f in (0.1, 0.3, 0.5, 0.7, 0.9)), baseline})
    for budget in budgets:
        best = min(t.recompute_ms for t in timelines if t.peak_bytes <= budget)
        exact = exact_regions(scorer, budget)
        assert exact.peak_bytes <= budget
        assert exact.overhead_ms == pytest.approx(best, rel=1e-9, abs=1e-12), budget
        assert scorer.simulate(exact.regions).peak_bytes == exact.peak_bytes
    with pytest.raises(InfeasibleBudgetError) as error:
        exact_regions(scorer, floor - 1)
    assert error.value.min_feasible_bytes == floor


def test_exact_search_skips_regions_with_in_place_hazards() -> None:
    torch.manual_seed(0)
    case = zoo.ConvNet(4, 1), (torch.randn(4, 3, 8, 8),)
    planner = autockpt.Planner.from_model(case[0], example_inputs=case[1], loss_fn=lambda out: out.pow(2).mean())
    profile = modelled_costs(planner.trace)
    scorer = torch_scorer(profile)
    hazards = mutation_hazards(profile)
    assert hazards, "the ConvNet's in-place ReLU and residual add should make some regions unsafe"
    n = len(profile.units)
    saving = [(a, b) for a in range(n) for b in range(a, n) if any(u.saved_bytes for u in profile.units[a : b + 1])]
    usable = usable_regions(profile)
    assert len(usable) < len(saving) and not any(is_unsafe(r, hazards) for r in usable)
    baseline = scorer.simulate(()).peak_bytes
    floor = min_peak_bytes(scorer)
    exact = exact_regions(scorer, (floor + baseline) // 2)
    assert exact.regions and not any(is_unsafe(r, hazards) for r in exact.regions)


def test_exact_search_refuses_too_many_units() -> None:
    profile = modelled_planner(2).trace
    scorer = torch_scorer(profile)
    with pytest.raises(ValueError, match=r"6 units, more than max_units=5"):
        exact_regions(scorer, 10**12, max_units=5)
    with pytest.raises(ValueError, match="max_units"):
        min_peak_bytes(scorer, max_units=5)
    assert math.isclose(exact_regions(scorer, 10**12, max_units=6).overhead_ms, 0.0)
