"""Each of autockpt's algorithms alone behind one solver contract, for the tests that judge them against each other
and against the exact optimum (``test_contract.py``). The library runs only the default solver
(``autockpt.core.solve.default.solve_prepared``); these wrappers left it in 0.3 (issue 47)."""

from __future__ import annotations

import time
from typing import Protocol

from autockpt.core.solve.base import NO_PROGRAM, Problem, Program, SolveResult, SolverOptions, region_actions
from autockpt.core.solve.base import summarise_programs as summarised
from autockpt.core.solve.baselines import baseline_regions, parse_strategy
from autockpt.core.solve.blocks import solve_block_program
from autockpt.core.solve.default import solve_prepared
from autockpt.core.solve.exact import exact_regions, min_peak_bytes
from autockpt.core.solve.greedy import greedy_regions
from autockpt.core.solve.milp import solve_flat_program
from autockpt.core.solve.pulp_tools import solver_name
from autockpt.core.solve.refine import (
    check_reachable,
    identity_result,
    no_plan_error,
    refine,
    refuse_static_over_budget,
)
from autockpt.types import Graph, PlanStatus, SolverStats


class Solver(Protocol):
    """One algorithm: the cheapest regions it finds whose simulated peak is at most ``budget_bytes``; raises
    ``InfeasibleBudgetError`` (with the lowest peak it knows of) when it finds none."""

    name: str

    def solve(self, problem: Problem, budget_bytes: int, options: SolverOptions) -> SolveResult: ...


class DefaultSolver:
    name = "autockpt"

    def solve(self, problem: Problem, budget_bytes: int, options: SolverOptions) -> SolveResult:
        return solve_prepared(problem, budget_bytes, options)


class ProgramSolver:
    """One program alone (the flat MILP, or the block program): its floor, then ``refine`` at the budget; no local
    search, no seed plans."""

    def __init__(self, name: str, program: Program) -> None:
        self.name, self.program = name, program

    def solve(self, problem: Problem, budget_bytes: int, options: SolverOptions) -> SolveResult:
        refuse_static_over_budget(problem.trace, budget_bytes, lambda: self.solve(problem, budget_bytes, options))
        started = time.perf_counter()
        solver = solver_name(options)
        programs: list[SolverStats] = []
        floor_answer = self.program(problem, None, options, solver)
        programs.append(floor_answer.stats)
        floor_regions = floor_answer.regions or ()
        floor_timeline = problem.simulate(floor_regions)
        min_feasible = min(floor_timeline.peak_bytes, problem.baseline.peak_bytes)
        if budget_bytes >= problem.baseline.peak_bytes:
            return identity_result(problem, min_feasible, f"{self.name} ({solver})", started, programs)
        check_reachable(problem, budget_bytes, min_feasible)
        best = (floor_regions, floor_timeline, PlanStatus.FEASIBLE) if floor_timeline.peak_bytes <= budget_bytes else None
        best = refine(problem, budget_bytes, options, self.program, solver, programs, best=best, rules_out_sets=True)
        if best is None:
            raise no_plan_error(budget_bytes, floor_timeline.peak_bytes)
        regions, timeline, status = best
        return SolveResult(
            region_actions=region_actions(regions, problem.action), action=problem.action, timeline=timeline,
            baseline=problem.baseline, min_feasible_bytes=min_feasible, status=status, solver=f"{self.name} ({solver})",
            solve_time_s=time.perf_counter() - started, stats=summarised(programs),
        )


def MilpSolver() -> ProgramSolver:
    return ProgramSolver("milp", solve_flat_program)


def BlockSolver() -> ProgramSolver:
    return ProgramSolver("blocks", solve_block_program)


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
            region_actions=region_actions(regions, problem.action), action=problem.action, timeline=timeline,
            baseline=problem.baseline, min_feasible_bytes=min_feasible, status=PlanStatus.FEASIBLE, solver=self.name,
            solve_time_s=time.perf_counter() - started, stats=NO_PROGRAM,
        )


class ExactSolver:
    """``exact_regions``: the optimum over region plans, for graphs of up to ``max_units`` units."""

    name = "exact"

    def __init__(self, max_units: int = 14) -> None:
        self.max_units = max_units
        # the exact floor of each problem solved (by ``id``, the problem kept alive with it): the enumeration is
        # seconds on some random graphs, and tests solve one problem at several budgets
        self._floors: dict[int, tuple[Problem, int]] = {}

    def solve(self, problem: Problem, budget_bytes: int, options: SolverOptions) -> SolveResult:
        started = time.perf_counter()
        if id(problem) not in self._floors:
            self._floors[id(problem)] = (problem, min_peak_bytes(problem.scorer, max_units=self.max_units))
        floor = self._floors[id(problem)][1]
        min_feasible = min(floor, problem.baseline.peak_bytes)
        if budget_bytes >= problem.baseline.peak_bytes:
            return identity_result(problem, min_feasible, self.name, started, [NO_PROGRAM])
        found = exact_regions(problem.scorer, budget_bytes, max_units=self.max_units)
        return SolveResult(
            region_actions=region_actions(found.regions, problem.action), action=problem.action,
            timeline=problem.simulate(found.regions), baseline=problem.baseline, min_feasible_bytes=min_feasible,
            status=PlanStatus.OPTIMAL, solver=self.name, solve_time_s=time.perf_counter() - started, stats=NO_PROGRAM,
        )


class BaselineSolver:
    """A baseline policy's regions on the graph, whatever the budget (status ``given``); ``InfeasibleBudgetError``
    when they do not fit it."""

    def __init__(self, graph: Graph, strategy: str) -> None:
        parse_strategy(strategy)
        self.graph, self.strategy, self.name = graph, strategy, strategy

    def solve(self, problem: Problem, budget_bytes: int, options: SolverOptions) -> SolveResult:
        started = time.perf_counter()
        chosen = baseline_regions(self.graph, problem.trace, self.strategy)
        if not chosen.available:
            raise ValueError(f"baseline {self.strategy!r}: {'; '.join(chosen.notes)}")
        timeline = problem.simulate(chosen.regions)
        if timeline.peak_bytes > budget_bytes:
            raise no_plan_error(budget_bytes, timeline.peak_bytes)
        return SolveResult(
            region_actions=region_actions(chosen.regions, problem.action), action=problem.action, timeline=timeline,
            baseline=problem.baseline, min_feasible_bytes=timeline.peak_bytes, status=PlanStatus.GIVEN,
            solver=self.name, solve_time_s=time.perf_counter() - started, stats=NO_PROGRAM,
        )
