"""Optimality: the production plan's recompute time is within 1 % of the exact optimum over checkpoint-region plans.

The exact optimum comes from ``autockpt.core.solve.exact`` (enumeration, small graphs only), itself checked against plain
brute force in test_exact.py. Forward times come from a fixed cost model (``modelled_costs``): measured times of
microsecond ops on a shared CPU are noise, and would make which plan is cheapest change from run to run.
"""

from __future__ import annotations

import pytest

import autockpt
from autockpt.core.solve.base import ProgramAnswer
from autockpt.core.solve.exact import exact_regions, min_peak_bytes, usable_regions
from autockpt.errors import InfeasibleBudgetError
from autockpt.types import PlanStatus, Region, SolverStats
from experiments.common.random_graphs import (
    TORCH_CHECKPOINT,
    modelled_costs,
    modelled_machinery,
    modelled_planner,
    scorer_of,
)

TOLERANCE = 0.01  # the target: production within 1 % of the exact optimum

# The first six seeds whose peak some region plan lowers (the others have floor == unmodified peak: nothing to
# compare), at 0.3 and 0.7 of the way from the production floor to the unmodified peak; then cases where
# experiments/bench/bench_optimality.py once found the production plan over 1 %, one per cause, now fixed:
# 40 / 2: no candidate started after unit 0, which saves nothing (candidates now also come without leading units that
# save nothing); 48: the forward events of a two-unit segment formed one constraint block (small graphs now get a
# segment per unit); 27: two regions whose gains the program adds up simulated over budget together (plans that
# simulate over budget are now excluded by a no-good cut and the program re-solved).
CASES = [
    (0, 0.3), (0, 0.7), (2, 0.3), (2, 0.7), (5, 0.3), (5, 0.7), (6, 0.3), (6, 0.7), (9, 0.3), (9, 0.7), (10, 0.3),
    (10, 0.7), (40, 0.3), (27, 0.3), (48, 0.5),
]


def _production_floor(planner: autockpt.Planner) -> int:
    with pytest.raises(InfeasibleBudgetError) as error:
        planner.plan(budget_bytes=1)
    return error.value.min_feasible_bytes


@pytest.mark.parametrize(("seed", "fraction"), CASES)
def test_production_plan_is_within_one_percent_of_the_exact_optimum(seed: int, fraction: float) -> None:
    planner = modelled_planner(seed)
    scorer = scorer_of(planner)
    floor, baseline = _production_floor(planner), scorer.simulate(()).peak_bytes
    assert floor < baseline, f"seed {seed}: no region plan lowers the peak; pick another seed"
    budget = int(floor + fraction * (baseline - floor))

    plan = planner.plan(budget_bytes=budget)
    exact = exact_regions(scorer, budget)

    produced = scorer.simulate(plan.regions)
    assert plan.recompute_ms == pytest.approx(produced.recompute_ms)  # planned on the modelled costs
    assert produced.peak_bytes <= budget and plan.predicted_peak_bytes <= budget
    assert exact.peak_bytes <= budget
    # the objective both minimise: recompute time plus each region's fixed cost
    assert exact.overhead_ms <= produced.overhead_ms + 1e-9  # the production plan is one of the plans searched
    assert produced.overhead_ms <= (1 + TOLERANCE) * exact.overhead_ms + 1e-9, (
        f"seed {seed}, budget {budget}: production {_text(plan.regions)} {produced.overhead_ms:.6f} ms, "
        f"exact {_text(exact.regions)} {exact.overhead_ms:.6f} ms"
    )


# Seeds where experiments/bench/bench_optimality.py once found the production floor above the exact floor: the programs add
# gains up, and these graphs have regions that interact (a recomputation burst on top of another region's gain).
# Fixed by offering the best single region as a seed and a local descent from every floor plan with the simulator.
# 524 stands in for 47, the one of them whose floor only the descent's added region reaches (a descent that only drops
# regions stops above it; 54 needs the drop): its exact floor is enumerated in 0.05 s, 47's in 3-4 s.
FLOOR_SEEDS = [24, 38, 54, 68, 524]


@pytest.mark.parametrize("seed", FLOOR_SEEDS)
def test_production_floor_is_the_exact_floor(seed: int) -> None:
    planner = modelled_planner(seed)
    scorer = scorer_of(planner)
    exact_floor = min_peak_bytes(scorer)
    assert exact_floor < scorer.simulate(()).peak_bytes
    floor = _production_floor(planner)
    assert floor == exact_floor
    plan = planner.plan(budget_bytes=floor)  # the floor is a budget the production solver accepts
    assert scorer.simulate(plan.regions).peak_bytes <= floor


def _text(regions: tuple[Region, ...]) -> str:
    return " ".join(f"{r.first_unit}-{r.last_unit}" for r in regions) or "nothing"


@pytest.mark.parametrize("seed", [2, 9, 53])
def test_the_swap_pass_replaces_an_expensive_region_the_program_chose(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program that answers the most expensive single region that fits: trying cheaper candidates in its place
    brings the plan down to the exact optimum at that budget."""
    from autockpt.core.solve import default

    planner = modelled_planner.__wrapped__(seed)  # a planner of its own: its problems are prepared with the patch
    profile, scorer = planner.trace, scorer_of(planner)
    floor, baseline = _production_floor(planner), scorer.simulate(()).peak_bytes
    budget = int(floor + 0.7 * (baseline - floor))
    fitting = [(r,) for r in usable_regions(profile) if scorer.simulate((r,)).peak_bytes <= budget]
    long_region = max(fitting, key=lambda regions: scorer.simulate(regions).recompute_ms)
    exact = exact_regions(scorer, budget)
    assert scorer.simulate(long_region).recompute_ms > 1.5 * exact.overhead_ms  # room for the pass to win

    def long_answer(problem, budget, options, solver, **_):
        stats = SolverStats(status="Optimal", relative_gap=0.0, variables=1, constraints=1, programs=1)
        return ProgramAnswer(regions=long_region, status=PlanStatus.OPTIMAL, stats=stats)

    monkeypatch.setattr(default, "solve_flat_program", long_answer)
    monkeypatch.setattr(default, "solve_block_program", long_answer)
    planner = modelled_planner.__wrapped__(seed)  # floors found with the patched programs too
    plan = planner.plan(budget_bytes=budget)
    assert plan.predicted_peak_bytes <= budget
    assert plan.recompute_ms < scorer.simulate(long_region).recompute_ms
    assert plan.recompute_ms <= (1 + TOLERANCE) * exact.overhead_ms + 1e-9, (_text(plan.regions), _text(exact.regions))


@pytest.mark.parametrize("seed", [0, 5, 9])
def test_each_region_s_fixed_cost_is_part_of_the_objective(seed: int) -> None:
    """With a fixed cost per checkpointed region (the checkpoint machinery), the production plan is still within 1 %
    of the exact optimum of recompute time + regions x fixed cost, and it never uses more regions than it does when
    regions are free."""
    planner = modelled_planner(seed)
    free = planner.trace
    unit_ms = min(u.forward_ms for u in free.units)
    floor, baseline = _production_floor(planner), scorer_of(planner).simulate(()).peak_bytes
    budget = int(floor + 0.3 * (baseline - floor))
    free_plan = planner.plan(budget_bytes=budget)

    costly = autockpt.Planner.from_model(planner.model, example_inputs=planner.request.args, solver_options=TORCH_CHECKPOINT)
    costly.trace = modelled_costs(costly.trace)
    costly.costs = modelled_machinery(region_ms=20 * unit_ms)  # a region costs 20 ops
    plan = costly.plan(budget_bytes=budget)
    profile, scorer = costly.trace, scorer_of(costly)
    produced, exact = scorer.simulate(plan.regions), exact_regions(scorer, budget)
    assert produced.overhead_ms == pytest.approx(produced.recompute_ms + len(plan.regions) * 20 * unit_ms)
    assert plan.predicted_overhead == pytest.approx(produced.overhead_ms / profile.step_ms)
    assert produced.peak_bytes <= budget
    assert produced.overhead_ms <= (1 + TOLERANCE) * exact.overhead_ms + 1e-9, (_text(plan.regions), _text(exact.regions))
    assert len(plan.regions) <= len(free_plan.regions)
