"""The greedy fallback (``autockpt.core.solve.greedy.greedy_regions``): used when the MILP finds nothing in time; it adds
candidates cheapest per byte freed while each lowers the simulated peak, and stops once the budget is met."""

from __future__ import annotations

import itertools

import pytest
from support import tiny

import autockpt
from autockpt.core.solve.candidates import candidate_regions
from autockpt.core.solve.exact import min_peak_bytes
from autockpt.core.solve.greedy import greedy_regions
from autockpt.core.solve.prepare import prepare
from experiments.common.random_graphs import modelled_planner, scorer_of


@pytest.mark.parametrize("seed", [0, 5, 9])
def test_greedy_regions_lower_the_peak_and_stop_once_the_budget_is_met(seed: int) -> None:
    planner = modelled_planner(seed)
    profile, scorer = planner.trace, scorer_of(planner)
    problem = prepare(profile, planner.costs, scorer.action, *candidate_regions(planner.graph, profile))
    baseline = scorer.simulate(()).peak_bytes

    lowest = greedy_regions(problem, None)  # no budget: as low as this order gets
    floor = scorer.simulate(lowest).peak_bytes
    assert lowest and floor < baseline
    assert all(a.last_unit < b.first_unit for a, b in itertools.pairwise(lowest))  # disjoint, in unit order
    assert set(lowest) <= {candidate.region for candidate in problem.scored}
    assert floor >= min_peak_bytes(scorer)  # never below the exact floor

    assert greedy_regions(problem, baseline) == ()  # the unmodified step fits: nothing to add
    budget = (floor + baseline) // 2
    fitting = greedy_regions(problem, budget)
    assert scorer.simulate(fitting).peak_bytes <= budget
    # the same order as without a budget, stopped early: some of the same regions, never more
    assert set(fitting) <= set(lowest) and len(fitting) <= len(lowest)


def test_without_any_solution_in_time_a_greedy_plan_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    from autockpt.core.solve import default, prepare
    from autockpt.core.solve.base import ProgramAnswer
    from autockpt.types import PlanStatus, SolverStats

    case = tiny("mlp")
    planner = autockpt.Planner.from_model(case.model, example_inputs=case.args)
    budget = int(planner.trace.static_bytes + 0.6 * (planner.trace.baseline_peak_bytes - planner.trace.static_bytes))

    def timed_out(problem, budget, options, solver, **_):
        stats = SolverStats(status="No Solution Found", relative_gap=None, variables=1, constraints=1, programs=1)
        return ProgramAnswer(regions=() if budget is None else None, status=PlanStatus.FEASIBLE, stats=stats)

    monkeypatch.setattr(default, "solve_flat_program", timed_out)
    monkeypatch.setattr(default, "solve_block_program", timed_out)
    monkeypatch.setattr(autockpt.planning.solving, "baseline_seed_plans", lambda graph, profile: [])  # no seed floor either
    score = prepare.score_candidates
    monkeypatch.setattr(prepare, "score_candidates", lambda *args: (score(*args)[0], None))  # nor the best single region
    plan = planner.plan(budget_bytes=budget)
    # the greedy floor plan fits every feasible budget; the greedy plan for this budget is used when it costs less
    # (which one wins depends on the measured times), so the label names the floor, and maybe the plan
    assert plan.status is autockpt.types.PlanStatus.FEASIBLE and "greedy fallback (memory floor" in plan.solver
    assert plan.regions and plan.predicted_peak_bytes <= budget
    module = planner.apply(plan)
    measured = autockpt.measure_step(module, case.args, {}, None).peak_bytes
    assert 0.99 * plan.predicted_peak_bytes <= measured <= plan.predicted_peak_bytes <= budget
