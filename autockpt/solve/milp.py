"""The flat MILP: one binary variable per candidate region, one memory row per event block (``prepare.py``).

    minimise    sum_i cost_i * w_i                                  (added ms; for the floor: the peak P)
    subject to  base_b - sum_i gain_i(b) * w_i <= budget  per block b (for the floor: <= P)
                at most one chosen region covers each unit; not a set already simulated over the budget

Effects of disjoint regions are taken as additive, and forward events are charged per group at their worst, so the
simulator scores the chosen regions exactly and ``refine.py`` moves the effective budget handed to the program until
the simulated peak sits just under the user's. Optimality is with respect to this program and the candidates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pulp

from autockpt.solve.base import Problem, ProgramAnswer, ScoredCandidate, SolveResult, SolverOptions
from autockpt.solve.pulp_tools import add_no_good_cut, add_no_overlap, has_solution, is_proven_optimal, solve_and_write
from autockpt.solve.refine import solve_with_program
from autockpt.types import PlanStatus, Region
from autockpt.units import GB


class MilpSolver:
    """The flat program alone, refined until the simulated peak fits (no block program, no local search, no seeds)."""

    name = "milp"

    def solve(self, problem: Problem, budget_bytes: int, options: SolverOptions) -> SolveResult:
        return solve_with_program(problem, budget_bytes, options, solve_flat_program, name=self.name)


def solve_flat_program(
    problem: Problem,
    budget: float | None,
    options: SolverOptions,
    solver: str,
    *,
    excluded: Sequence[tuple[Region, ...]] = (),
    peak_cutoff_bytes: int | None = None,
) -> ProgramAnswer:
    """The flat program at ``budget`` (None: minimise the peak, looking only for peaks under ``peak_cutoff_bytes``,
    which HiGHS uses to prune). A floor program without a solution answers no regions."""
    prob, chosen_regions = build_flat_program(problem.scored, problem.block_base, budget, excluded)
    floor = budget is None
    cutoff_gb = peak_cutoff_bytes / GB if floor and peak_cutoff_bytes is not None else None
    stats = solve_and_write(prob, solver, options, objective_cutoff=cutoff_gb)
    if not has_solution(prob):
        return ProgramAnswer(regions=() if floor else None, status=PlanStatus.FEASIBLE, stats=stats)
    return ProgramAnswer(
        regions=chosen_regions(), status=PlanStatus.OPTIMAL if is_proven_optimal(prob) else PlanStatus.FEASIBLE,
        stats=stats,
    )


def build_flat_program(
    candidates: list[ScoredCandidate], block_base: list[int], budget: float | None, excluded: Sequence[tuple[Region, ...]]
) -> tuple[pulp.LpProblem, Callable[[], tuple[Region, ...]]]:
    """One variable per candidate region, one memory row per event block; and a function reading the answer."""
    prob = pulp.LpProblem("autockpt_floor" if budget is None else "autockpt_plan", pulp.LpMinimize)
    # w_i: 1 if candidate region i is checkpointed
    w = [pulp.LpVariable(f"w_{i}", cat=pulp.LpBinary) for i in range(len(candidates))]
    peak = None
    if budget is None:
        # P: the peak bytes to minimise (in GB so coefficients stay well scaled). Memory only: the floor must not
        # depend on timing noise in the profile.
        peak = pulp.LpVariable("peak_gb", lowBound=0)
        prob += peak
    else:
        prob += pulp.LpAffineExpression([(w[i], c.cost_ms) for i, c in enumerate(candidates)])

    # [Constraint] checkpoint regions do not overlap
    add_no_overlap(prob, [c.region for c in candidates], w)

    # [Constraint] not a set already simulated over the budget (a no-good cut: at least one of its regions changes)
    position = {c.region: i for i, c in enumerate(candidates)}
    for k, regions in enumerate(excluded):
        if regions and all(r in position for r in regions):
            add_no_good_cut(prob, f"not_plan_{k}", [w[position[r]] for r in regions], w)

    # [Constraint] predicted bytes of every event block under the budget
    by_block: dict[int, list[tuple[int, int]]] = {}
    for i, c in enumerate(candidates):
        for block, gain in c.gains.items():
            by_block.setdefault(block, []).append((i, gain))
    for block, base in enumerate(block_base):
        terms = by_block.get(block, [])
        if budget is not None and base + sum(-gain for _, gain in terms if gain < 0) <= budget:
            continue  # holds whatever is chosen: leaving it out keeps the program small
        # base - sum(gain_i * w_i) <= budget (or <= P GB for the floor); built as one affine expression, which is
        # much faster in PuLP than summing products
        expression = pulp.LpAffineExpression([(w[i], -gain) for i, gain in terms], constant=base)
        if peak is not None:
            expression.addterm(peak, -GB)
        prob += pulp.LpConstraint(expression, pulp.LpConstraintLE, f"memory_block_{block}", budget or 0)

    def chosen_regions() -> tuple[Region, ...]:
        chosen = (c.region for i, c in enumerate(candidates) if (w[i].value() or 0) > 0.5)
        return tuple(sorted(chosen, key=lambda r: r.first_unit))

    return prob, chosen_regions
