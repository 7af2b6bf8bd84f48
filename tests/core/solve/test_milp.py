"""The MILP (``autockpt.core.solve.milp``, in the default solver; CBC and HiGHS through PuLP): the exhaustive optimum on
a small chain, and the baseline seed plans it falls back on. (Against the exact solver on random graphs: test_optimality.py.)"""

from __future__ import annotations

import collections
from typing import Any

import pulp
import pytest
import torch
from support import FREE_MACHINERY, tiny, torch_scorer
from torch import nn

import autockpt
from autockpt.core.solve.base import SolveResult, SolverOptions
from autockpt.core.solve.candidates import candidate_regions
from autockpt.core.solve.default import solve_prepared
from autockpt.core.solve.prepare import prepare
from autockpt.measure.capture import capture
from autockpt.measure.trace import trace_step
from autockpt.types import Action, Region, StepTrace


def _chain(widths: list[int], batch: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    previous = 32
    for width in widths:
        layers += [nn.Linear(previous, width), nn.Tanh()]
        previous = width
    return nn.Sequential(*layers, nn.Linear(previous, 4)), torch.randn(batch, 32)


def solve(
    measured: StepTrace, segments: list[Region], candidates: list[Region], budget: int, options: SolverOptions | None = None
) -> SolveResult:
    """The default solver on these candidates, no seed plans, torch's checkpoint with free machinery."""
    problem = prepare(measured, FREE_MACHINERY, Action.RECOMPUTE_TORCH, segments, candidates)
    return solve_prepared(problem, budget, options)


def _disjoint_sets(candidates: list[Region]) -> list[tuple[Region, ...]]:
    ordered = sorted(candidates, key=lambda r: (r.first_unit, r.last_unit))
    found: list[tuple[Region, ...]] = []

    def extend(start: int, chosen: tuple[Region, ...], last_unit: int) -> None:
        found.append(chosen)
        for i in range(start, len(ordered)):
            if ordered[i].first_unit > last_unit:
                extend(i + 1, chosen + (ordered[i],), ordered[i].last_unit)

    extend(0, (), -1)
    return found


SOLVERS = [
    "cbc",
    pytest.param("highs", marks=pytest.mark.skipif(not pulp.HiGHS(msg=False).available(), reason="needs highspy")),
]


@pytest.fixture(scope="module")
def small_chain() -> tuple[StepTrace, list[Region], list[Region], list[tuple[tuple[Region, ...], Any]], Any]:
    """A 4-layer chain's trace, regions, every disjoint region set simulated (the exhaustive answer both solvers are
    held to, made once) and the plan of none. 4 layers, not 5: 2,584 sets, not 17,711 (0.3 s, not 1.9 s); the budgets
    below still give three feasible ones (one with a two-region optimum) and two infeasible ones."""
    model, x = _chain([128] * 4, 256)
    graph = capture(model, (x,), {})
    measured = trace_step(graph, (x,), {}, lambda out: out.sum())
    segments, candidates = candidate_regions(graph, measured)
    scorer = torch_scorer(measured)
    scored = [(plan, scorer.simulate(plan)) for plan in _disjoint_sets(candidates)]
    return measured, segments, candidates, scored, scorer.simulate(())


@pytest.mark.parametrize("solver", SOLVERS)
def test_ilp_finds_the_exhaustive_optimum_on_a_small_chain(solver: str, small_chain) -> None:
    measured, segments, candidates, scored, baseline = small_chain
    floor = min(t.peak_bytes for _, t in scored)
    checked = 0
    for fraction in (0.5, 0.6, 0.7, 0.8, 0.9):
        budget = int(measured.static_bytes + fraction * (baseline.peak_bytes - measured.static_bytes))
        feasible = [t.overhead_ms for _, t in scored if t.peak_bytes <= budget]
        if not feasible:
            with pytest.raises(autockpt.InfeasibleBudgetError):
                solve(measured, segments, candidates, budget)
            continue
        result = solve(measured, segments, candidates, budget, SolverOptions(solver=solver))
        assert result.timeline.peak_bytes <= budget
        assert result.timeline.overhead_ms <= min(feasible) * 1.01 + 1e-9, fraction
        checked += 1
    assert checked >= 3
    result = solve(measured, segments, candidates, baseline.peak_bytes)
    assert result.min_feasible_bytes <= floor * 1.02


def test_a_cheaper_baseline_plan_is_returned_when_the_program_misses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeds: whatever the program answers, the plan is never worse than a baseline policy under the same budget."""
    from autockpt.core.solve import default
    from autockpt.core.solve.base import ProgramAnswer
    from autockpt.core.solve.baselines import BASELINE_STRATEGIES
    from autockpt.planning.planner import baseline_plan
    from autockpt.types import PlanStatus, SolverStats

    case = tiny("transformer")
    # one checkpoint kind: the baselines are scored for torch's, so the plan must be made for it too
    planner = autockpt.Planner.from_model(
        case.model, example_inputs=case.args, solver_options=autockpt.SolverOptions(checkpoint="torch_non_reentrant")
    )
    every_1 = baseline_plan(planner, "every_1")

    def infeasible(problem, budget, options, solver, **_):
        stats = SolverStats(status="Infeasible", relative_gap=None, variables=1, constraints=1, programs=1)
        return ProgramAnswer(regions=() if budget is None else None, status=PlanStatus.FEASIBLE, stats=stats)

    monkeypatch.setattr(default, "solve_flat_program", infeasible)  # the programs find nothing at all
    monkeypatch.setattr(default, "solve_block_program", infeasible)
    # the searches with the simulator off too, so only the seeds can give a plan
    monkeypatch.setattr(default, "drop_unneeded_regions", lambda problem, *best: best[:3])
    monkeypatch.setattr(default, "swap_for_cheaper", lambda problem, *best: best[:3])
    monkeypatch.setattr(
        default, "lower_floor_locally",
        lambda problem, starts: min(((*start, i) for i, start in enumerate(starts)), key=lambda s: s[1].peak_bytes),
    )
    plan = planner.plan(budget_bytes=every_1.predicted_peak_bytes)
    assert plan.predicted_peak_bytes <= every_1.predicted_peak_bytes
    fitting = [baseline_plan(planner, s) for s in BASELINE_STRATEGIES]
    fitting = [b for b in fitting if b.regions and b.predicted_peak_bytes <= every_1.predicted_peak_bytes]
    assert plan.predicted_overhead == min(b.predicted_overhead for b in fitting)
    assert plan.regions in {b.regions for b in fitting}


def test_a_program_solved_before_is_answered_without_the_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46: a program equal to one solved before in the process (every coefficient, bound and name, the same
    solver settings) gets that solve's answer without the solver; a changed coefficient or setting is solved."""
    from autockpt.core.solve import pulp_tools

    monkeypatch.setattr(pulp_tools, "SOLVED_PROGRAMS", collections.OrderedDict())
    solved: list[str] = []
    real_solve = pulp.LpProblem.solve

    def counted(self: pulp.LpProblem, solver: Any = None, **kwargs: Any) -> int:
        solved.append(self.name)
        return real_solve(self, solver, **kwargs)

    monkeypatch.setattr(pulp.LpProblem, "solve", counted)

    def knapsack(weight_of_a: int) -> tuple[pulp.LpProblem, pulp.LpVariable, pulp.LpVariable]:
        prob = pulp.LpProblem("knapsack", pulp.LpMaximize)
        a, b = pulp.LpVariable("a", cat="Binary"), pulp.LpVariable("b", cat="Binary")
        prob += 3 * a + 2 * b
        prob += weight_of_a * a + 2 * b <= 3, "capacity"
        return prob, a, b

    options = SolverOptions()
    name = pulp_tools.solver_name(options)
    first, a, b = knapsack(2)
    stats = pulp_tools.solve_and_write(first, name, options)
    assert (a.varValue, b.varValue, first.sol_status) == (1, 0, pulp.LpSolutionOptimal) and solved == ["knapsack"]
    again, a, b = knapsack(2)
    assert pulp_tools.solve_and_write(again, name, options) == stats
    assert (a.varValue, b.varValue, again.status, again.sol_status) == (1, 0, first.status, first.sol_status)
    assert len(solved) == 1
    changed, a, b = knapsack(4)  # a no longer fits
    pulp_tools.solve_and_write(changed, name, options)
    assert (a.varValue, b.varValue) == (0, 1) and len(solved) == 2
    pulp_tools.solve_and_write(knapsack(2)[0], name, SolverOptions(relative_gap=0.5))
    assert len(solved) == 3
