"""The split program: where to cut a step into pipeline stages, given what each candidate stage would cost.

Input: candidate cut points (unit boundaries where a cut is possible) and a table of *stage options*: for a stage
position s and a run of units (from one candidate boundary to another), the fastest recompute plan that keeps that
device's budget with the schedule's microbatches in flight there, and its time per microbatch (``StageOption``;
``pipeline/plan.py`` fills the table with the single-device planner). A split picks one option per stage, contiguous and
covering every unit. Its predicted step time is the schedule's: (microbatches + stages - 1) x the slowest stage's
time per microbatch (fill, steady state and drain), plus the time to send activations and their gradients across
every cut for every microbatch.

Solved as a MILP (PuLP, CBC or HiGHS); ``exhaustive_split`` enumerates every split on the same table, the program's
oracle in tests and the benchmark.

Variables (legend):
  choose[s, o]  binary  stage s runs option o (a run of units with its recompute plan)
  slowest_ms    float   the slowest stage's time per microbatch
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulp

from autockpt.core.solve.base import SolverOptions
from autockpt.core.solve.pulp_tools import has_solution, make_solver, solver_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageOption:
    """Stage ``stage`` running units ``first_unit .. last_unit`` under its best plan at its budget."""

    stage: int
    first_unit: int
    last_unit: int
    microbatch_ms: float  # forward + backward + recomputation of one microbatch on this stage


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitProblem:
    num_units: int
    num_stages: int
    microbatches: int
    options: tuple[StageOption, ...]  # only options that keep their budget
    # per unit boundary (cut after unit p): milliseconds to send what crosses it forward and its gradient back, for
    # one microbatch
    transfer_ms: Mapping[int, float]


@dataclass(frozen=True, kw_only=True, slots=True)
class Split:
    cuts: tuple[int, ...]  # cut after these units
    options: tuple[StageOption, ...]  # one per stage
    predicted_step_ms: float


def step_ms(problem: SplitProblem, options: Sequence[StageOption]) -> float:
    """The schedule's predicted step time for one option per stage."""
    slowest = max(o.microbatch_ms for o in options)
    transfers = sum(problem.transfer_ms[o.last_unit] for o in options[:-1])
    return (problem.microbatches + problem.num_stages - 1) * slowest + problem.microbatches * transfers


def exhaustive_split(problem: SplitProblem) -> Split | None:
    """Every split on the table, the fastest (None when no split keeps every budget)."""
    by_start: dict[tuple[int, int], list[StageOption]] = {}
    for option in problem.options:
        by_start.setdefault((option.stage, option.first_unit), []).append(option)
    best: Split | None = None

    def extend(chosen: list[StageOption]) -> None:
        nonlocal best
        stage = len(chosen)
        start = chosen[-1].last_unit + 1 if chosen else 0
        for option in by_start.get((stage, start), ()):
            if stage == problem.num_stages - 1 and option.last_unit != problem.num_units - 1:
                continue
            picked = [*chosen, option]
            if stage < problem.num_stages - 1:
                extend(picked)
                continue
            time_ms = step_ms(problem, picked)
            if best is None or time_ms < best.predicted_step_ms - 1e-12:
                best = Split(cuts=tuple(o.last_unit for o in picked[:-1]), options=tuple(picked), predicted_step_ms=time_ms)

    extend([])
    return best


def solve_split(problem: SplitProblem, options: SolverOptions | None = None) -> Split | None:
    """The fastest split by the MILP (None when no split keeps every budget)."""
    options = options or SolverOptions()
    prob = pulp.LpProblem("pipeline_split", pulp.LpMinimize)
    choose = {i: pulp.LpVariable(f"choose_{i}", cat="Binary") for i in range(len(problem.options))}
    slowest_ms = pulp.LpVariable("slowest_ms", lowBound=0)
    fill = problem.microbatches + problem.num_stages - 1
    last = problem.num_units - 1
    prob += fill * slowest_ms + problem.microbatches * pulp.lpSum(
        problem.transfer_ms[o.last_unit] * choose[i]
        for i, o in enumerate(problem.options) if o.stage < problem.num_stages - 1
    )
    for stage in range(problem.num_stages):
        mine = [i for i, o in enumerate(problem.options) if o.stage == stage]
        # [Constraint] every stage runs exactly one option
        prob += pulp.lpSum(choose[i] for i in mine) == 1, f"one_option_stage_{stage}"
        for i in mine:
            # [Constraint] the slowest stage is at least as slow as each chosen one
            prob += slowest_ms >= problem.options[i].microbatch_ms * choose[i], f"slowest_{i}"
    # [Constraint] the first stage starts at unit 0 and the last ends at the last unit
    prob += pulp.lpSum(choose[i] for i, o in enumerate(problem.options) if o.stage == 0 and o.first_unit != 0) == 0, "starts_at_0"
    prob += pulp.lpSum(
        choose[i] for i, o in enumerate(problem.options) if o.stage == problem.num_stages - 1 and o.last_unit != last
    ) == 0, "ends_at_last"
    # [Constraint] contiguous: stage s ends where stage s+1 starts
    boundaries = sorted({o.last_unit for o in problem.options if o.last_unit != last})
    for stage, boundary in itertools.product(range(problem.num_stages - 1), boundaries):
        ends = [choose[i] for i, o in enumerate(problem.options) if o.stage == stage and o.last_unit == boundary]
        starts = [choose[i] for i, o in enumerate(problem.options) if o.stage == stage + 1 and o.first_unit == boundary + 1]
        prob += pulp.lpSum(ends) == pulp.lpSum(starts), f"contiguous_{stage}_{boundary}"
    prob.solve(make_solver(solver_name(options), options))
    if not has_solution(prob) or pulp.LpStatus[prob.status] != "Optimal":
        return None
    picked = sorted(
        (o for i, o in enumerate(problem.options) if (choose[i].value() or 0) > 0.5), key=lambda o: o.stage
    )
    if len(picked) != problem.num_stages:
        return None
    return Split(cuts=tuple(o.last_unit for o in picked[:-1]), options=tuple(picked), predicted_step_ms=step_ms(problem, picked))
