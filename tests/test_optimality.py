"""Optimality: the production plan's recompute time is within 1 % of the exact optimum over checkpoint-region plans.

The exact optimum comes from ``autockpt.solve.exact`` (enumeration, small graphs only), itself checked here against
plain brute force. Forward times come from a fixed cost model (``modelled_costs``): measured times of microsecond
ops on a shared CPU are noise, and would make which plan is cheapest change from run to run.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest
import torch

import autockpt
from autockpt import zoo
from autockpt.errors import InfeasibleBudgetError
from autockpt.simulate import simulate
from autockpt.solve.candidates import _mutation_hazards, _unsafe
from autockpt.solve.exact import exact_regions, min_peak_bytes, removable_bytes, usable_regions
from autockpt.types import Profile, Region, SolverStats

from random_graphs import modelled_costs, random_model

TOLERANCE = 0.01  # the target: production within 1 % of the exact optimum
TORCH_CHECKPOINT = autockpt.SolverOptions(checkpoint="torch_non_reentrant")  # the exact solver's semantics

# The first six seeds whose peak some region plan lowers (the others have floor == unmodified peak: nothing to
# compare), at 0.3 and 0.7 of the way from the production floor to the unmodified peak; then cases where
# experiments/bench_optimality.py once found the production plan over 1 %, one per cause, now fixed:
# 40 / 2: no candidate started after unit 0, which saves nothing (candidates now also come without leading units that
# save nothing); 48: the forward events of a two-unit segment formed one constraint block (small graphs now get a
# segment per unit); 27: two regions whose gains the program adds up simulated over budget together (plans that
# simulate over budget are now excluded by a no-good cut and the program re-solved).
CASES = [
    (0, 0.3), (0, 0.7), (2, 0.3), (2, 0.7), (5, 0.3), (5, 0.7), (6, 0.3), (6, 0.7), (9, 0.3), (9, 0.7), (10, 0.3),
    (10, 0.7), (40, 0.3), (27, 0.3), (48, 0.5),
]


@functools.cache
def _planner(seed: int) -> autockpt.Planner:
    torch.set_num_threads(2)
    torch.manual_seed(seed)
    model, x = random_model(seed)
    # one checkpoint kind: the exact solver it is compared with follows the profile's (torch's) semantics
    planner = autockpt.Planner(model, example_inputs=(x,), solver_options=TORCH_CHECKPOINT)
    planner.profile = modelled_costs(planner.profile)  # before the first plan: the solver plans on these costs
    return planner


def _production_floor(planner: autockpt.Planner) -> int:
    with pytest.raises(InfeasibleBudgetError) as error:
        planner.plan(budget_bytes=1)
    return error.value.min_feasible_bytes


@pytest.mark.parametrize(("seed", "fraction"), CASES)
def test_production_plan_is_within_one_percent_of_the_exact_optimum(seed: int, fraction: float) -> None:
    planner = _planner(seed)
    profile = planner.profile
    floor, baseline = _production_floor(planner), simulate(profile, ()).peak_bytes
    assert floor < baseline, f"seed {seed}: no region plan lowers the peak; pick another seed"
    budget = int(floor + fraction * (baseline - floor))

    plan = planner.plan(budget_bytes=budget)
    exact = exact_regions(profile, budget)

    produced = simulate(profile, plan.regions)
    assert plan.recompute_ms == pytest.approx(produced.recompute_ms)  # planned on the modelled costs
    assert produced.peak_bytes <= budget and plan.predicted_peak_bytes <= budget
    assert exact.peak_bytes <= budget
    # the objective both minimise: recompute time plus each region's fixed cost
    assert exact.overhead_ms <= produced.overhead_ms + 1e-9  # the production plan is one of the plans searched
    assert produced.overhead_ms <= (1 + TOLERANCE) * exact.overhead_ms + 1e-9, (
        f"seed {seed}, budget {budget}: production {_text(plan.regions)} {produced.overhead_ms:.6f} ms, "
        f"exact {_text(exact.regions)} {exact.overhead_ms:.6f} ms"
    )


# Seeds where experiments/bench_optimality.py once found the production floor above the exact floor: the programs add
# gains up, and these graphs have regions that interact (a recomputation burst on top of another region's gain).
# Fixed by offering the best single region as a seed and a local descent from every floor plan with the simulator.
FLOOR_SEEDS = [24, 38, 47, 54, 68]


@pytest.mark.parametrize("seed", FLOOR_SEEDS)
def test_production_floor_is_the_exact_floor(seed: int) -> None:
    planner = _planner(seed)
    exact_floor = min_peak_bytes(planner.profile)
    assert exact_floor < simulate(planner.profile, ()).peak_bytes
    floor = _production_floor(planner)
    assert floor == exact_floor
    plan = planner.plan(budget_bytes=floor)  # the floor is a budget the production solver accepts
    assert simulate(planner.profile, plan.regions).peak_bytes <= floor


def _text(regions: tuple[Region, ...]) -> str:
    return " ".join(f"{r.first_unit}-{r.last_unit}" for r in regions) or "nothing"


def _all_region_sets(profile: Profile) -> list[tuple[Region, ...]]:
    """Brute force: every set of disjoint safe ranges, including ranges that save nothing (the exact search
    leaves those out; brute force checks that this loses nothing)."""
    hazards = _mutation_hazards(profile)
    n = len(profile.units)
    ranges = [Region(first_unit=a, last_unit=b) for a in range(n) for b in range(a, n)]
    ranges = [r for r in ranges if not _unsafe(r, hazards)]
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
    profile = _planner(seed).profile
    assert 5 <= len(profile.units) <= 8
    sets = _all_region_sets(profile)
    timelines = [simulate(profile, s) for s in sets]

    measured = np.array([e.peak_bytes for e in profile.events])
    for regions, timeline in itertools.islice(zip(sets, timelines), 0, None, 7):
        # a set's recompute time is the sum of its regions' (what makes cheapest-first enumeration exact) ...
        assert timeline.recompute_ms == pytest.approx(sum(simulate(profile, (r,)).recompute_ms for r in regions))
        # ... and the pruning bound never exceeds the simulated bytes of any event
        bound = measured - sum((removable_bytes(profile, r) for r in regions), np.zeros_like(measured))
        assert (bound <= np.array(timeline.event_bytes)).all()

    floor = min(t.peak_bytes for t in timelines)
    baseline = simulate(profile, ()).peak_bytes
    assert floor < baseline
    assert min_peak_bytes(profile) == floor
    budgets = sorted({floor, *(int(floor + f * (baseline - floor)) for f in (0.1, 0.3, 0.5, 0.7, 0.9)), baseline})
    for budget in budgets:
        best = min(t.recompute_ms for t in timelines if t.peak_bytes <= budget)
        exact = exact_regions(profile, budget)
        assert exact.peak_bytes <= budget
        assert exact.overhead_ms == pytest.approx(best, rel=1e-9, abs=1e-12), budget
        assert simulate(profile, exact.regions).peak_bytes == exact.peak_bytes
    with pytest.raises(InfeasibleBudgetError) as error:
        exact_regions(profile, floor - 1)
    assert error.value.min_feasible_bytes == floor


def test_exact_search_skips_regions_with_in_place_hazards() -> None:
    torch.manual_seed(0)
    case = zoo.ConvNet(4, 1), (torch.randn(4, 3, 8, 8),)
    planner = autockpt.Planner(case[0], example_inputs=case[1], loss_fn=lambda out: out.pow(2).mean())
    profile = modelled_costs(planner.profile)
    hazards = _mutation_hazards(profile)
    assert hazards, "the ConvNet's in-place ReLU and residual add should make some regions unsafe"
    n = len(profile.units)
    saving = [(a, b) for a in range(n) for b in range(a, n) if any(u.saved_bytes for u in profile.units[a : b + 1])]
    usable = usable_regions(profile)
    assert len(usable) < len(saving) and not any(_unsafe(r, hazards) for r in usable)
    baseline = simulate(profile, ()).peak_bytes
    floor = min_peak_bytes(profile)
    exact = exact_regions(profile, (floor + baseline) // 2)
    assert exact.regions and not any(_unsafe(r, hazards) for r in exact.regions)


def test_exact_search_refuses_too_many_units() -> None:
    profile = _planner(2).profile
    with pytest.raises(ValueError, match=r"6 units, more than max_units=5"):
        exact_regions(profile, 10**12, max_units=5)
    with pytest.raises(ValueError, match="max_units"):
        min_peak_bytes(profile, max_units=5)
    assert math.isclose(exact_regions(profile, 10**12, max_units=6).overhead_ms, 0.0)


@pytest.mark.parametrize("seed", [2, 9, 53])
def test_the_swap_pass_replaces_an_expensive_region_the_program_chose(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program that answers the most expensive single region that fits: trying cheaper candidates in its place
    brings the plan down to the exact optimum at that budget."""
    from autockpt.solve import ilp

    planner = _planner(seed)
    profile = planner.profile
    floor, baseline = _production_floor(planner), simulate(profile, ()).peak_bytes
    budget = int(floor + 0.7 * (baseline - floor))
    fitting = [(r,) for r in usable_regions(profile) if simulate(profile, (r,)).peak_bytes <= budget]
    long_region = max(fitting, key=lambda regions: simulate(profile, regions).recompute_ms)
    exact = exact_regions(profile, budget)
    assert simulate(profile, long_region).recompute_ms > 1.5 * exact.overhead_ms  # room for the pass to win

    def long_answer(problem, budget, options, solver_name, programs, **_):  # noqa: ANN001
        programs.append(SolverStats(status="Optimal", relative_gap=0.0, variables=1, constraints=1, programs=1))
        return long_region, ilp.PlanStatus.OPTIMAL

    monkeypatch.setattr(ilp, "_solve_program", long_answer)
    monkeypatch.setattr(planner, "_problems", {})  # re-prepare with the patched program (floor included)
    plan = planner.plan(budget_bytes=budget)
    assert plan.predicted_peak_bytes <= budget
    assert plan.recompute_ms < simulate(profile, long_region).recompute_ms
    assert plan.recompute_ms <= (1 + TOLERANCE) * exact.overhead_ms + 1e-9, (_text(plan.regions), _text(exact.regions))


@pytest.mark.parametrize("seed", [0, 5, 9])
def test_each_region_s_fixed_cost_is_part_of_the_objective(seed: int) -> None:
    """With a fixed cost per checkpointed region (the checkpoint machinery), the production plan is still within 1 %
    of the exact optimum of recompute time + regions x fixed cost, and it never uses more regions than it does when
    regions are free."""
    planner = _planner(seed)
    free = planner.profile
    unit_ms = min(u.forward_ms for u in free.units)
    floor, baseline = _production_floor(planner), simulate(free, ()).peak_bytes
    budget = int(floor + 0.3 * (baseline - floor))
    free_plan = planner.plan(budget_bytes=budget)

    costly = autockpt.Planner(planner.model, example_inputs=planner.request.args, solver_options=TORCH_CHECKPOINT)
    costly.profile = modelled_costs(costly.profile, region_overhead_ms=20 * unit_ms)  # a region costs 20 ops
    plan = costly.plan(budget_bytes=budget)
    profile = costly.profile
    produced, exact = simulate(profile, plan.regions), exact_regions(profile, budget)
    assert produced.overhead_ms == pytest.approx(produced.recompute_ms + len(plan.regions) * 20 * unit_ms)
    assert plan.predicted_overhead == pytest.approx(produced.overhead_ms / profile.step_ms)
    assert produced.peak_bytes <= budget
    assert produced.overhead_ms <= (1 + TOLERANCE) * exact.overhead_ms + 1e-9, (_text(plan.regions), _text(exact.regions))
    assert len(plan.regions) <= len(free_plan.regions)
