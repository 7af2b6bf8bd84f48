"""The greedy fallback (``autockpt.solve.ilp.greedy_regions``): used when the MILP finds nothing in time; it adds
candidates cheapest per byte freed while each lowers the simulated peak, and stops once the budget is met."""

from __future__ import annotations

import pytest

import autockpt
from autockpt import zoo
from autockpt.simulate import simulate
from autockpt.solve.candidates import candidate_regions
from autockpt.solve.exact import min_peak_bytes
from autockpt.solve.ilp import greedy_regions, prepare

from random_graphs import modelled_planner


@pytest.mark.parametrize("seed", [0, 5, 9])
def test_greedy_regions_lower_the_peak_and_stop_once_the_budget_is_met(seed: int) -> None:
    planner = modelled_planner(seed)
    profile = planner.profile
    problem = prepare(profile, *candidate_regions(planner.graph, profile))
    baseline = simulate(profile, ()).peak_bytes

    lowest = greedy_regions(profile, problem.scored, None)  # no budget: as low as this order gets
    floor = simulate(profile, lowest).peak_bytes
    assert lowest and floor < baseline
    assert all(a.last_unit < b.first_unit for a, b in zip(lowest, lowest[1:]))  # disjoint, in unit order
    assert set(lowest) <= {candidate.region for candidate in problem.scored}
    assert floor >= min_peak_bytes(profile)  # never below the exact floor

    assert greedy_regions(profile, problem.scored, baseline) == ()  # the unmodified step fits: nothing to add
    budget = (floor + baseline) // 2
    fitting = greedy_regions(profile, problem.scored, budget)
    assert simulate(profile, fitting).peak_bytes <= budget
    # the same order as without a budget, stopped early: some of the same regions, never more
    assert set(fitting) <= set(lowest) and len(fitting) <= len(lowest)


def test_without_any_solution_in_time_a_greedy_plan_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    from autockpt.solve import ilp
    from autockpt.types import SolverStats

    case = zoo.build("mlp")
    planner = autockpt.Planner(case.model, example_inputs=case.args)
    budget = int(planner.profile.static_bytes + 0.6 * (planner.profile.baseline_peak_bytes - planner.profile.static_bytes))

    def timed_out(problem, budget, options, solver_name, programs, **_):  # noqa: ANN001
        programs.append(SolverStats(status="No Solution Found", relative_gap=None, variables=1, constraints=1, programs=1))
        return ((), ilp.PlanStatus.FEASIBLE) if budget is None else (None, ilp.PlanStatus.FEASIBLE)

    monkeypatch.setattr(ilp, "_solve_program", timed_out)
    monkeypatch.setattr(autockpt.api, "baseline_seed_plans", lambda graph, profile: [])  # no seed floor either
    score = ilp._score_candidates
    monkeypatch.setattr(ilp, "_score_candidates", lambda *args: (score(*args)[0], None))  # nor the best single region
    plan = planner.plan(budget_bytes=budget)
    # the greedy floor plan fits every feasible budget; the greedy plan for this budget is used when it costs less
    # (which one wins depends on the measured times), so the label names the floor, and maybe the plan
    assert plan.status is autockpt.PlanStatus.FEASIBLE and "greedy fallback (memory floor" in plan.solver
    assert plan.regions and plan.predicted_peak_bytes <= budget
    module = planner.apply(plan)
    measured = autockpt.measure_step(module, case.args, {}, None).peak_bytes
    assert 0.99 * plan.predicted_peak_bytes <= measured <= plan.predicted_peak_bytes <= budget
