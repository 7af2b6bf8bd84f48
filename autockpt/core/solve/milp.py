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
from typing import Any

import pulp

from autockpt.core.solve.base import Problem, ProgramAnswer, ScoredCandidate, SolverOptions
from autockpt.core.solve.pulp_tools import (
    add_no_good_cut,
    add_no_overlap,
    has_solution,
    is_proven_optimal,
    solve_and_write,
)
from autockpt.types import PlanStatus, Region
from autockpt.units import GB


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
    built = build_flat_program(problem.scored, problem.block_base, budget, excluded)
    return answer_flat_program(built, budget, options, solver, peak_cutoff_bytes)


def answer_flat_program(
    built: tuple[pulp.LpProblem, Callable[[], tuple[Any, ...]]],
    budget: float | None,
    options: SolverOptions,
    solver: str,
    peak_cutoff_bytes: int | None = None,
) -> ProgramAnswer:
    """Solve a program ``build_flat_program`` built and read its answer."""
    prob, chosen = built
    floor = budget is None
    cutoff_gb = peak_cutoff_bytes / GB if floor and peak_cutoff_bytes is not None else None
    stats = solve_and_write(prob, solver, options, objective_cutoff=cutoff_gb)
    if not has_solution(prob):
        return ProgramAnswer(regions=() if floor else None, status=PlanStatus.FEASIBLE, stats=stats)
    return ProgramAnswer(
        regions=chosen(), status=PlanStatus.OPTIMAL if is_proven_optimal(prob) else PlanStatus.FEASIBLE, stats=stats,
    )


def build_flat_program(
    candidates: list[ScoredCandidate],
    block_base: list[int],
    budget: float | None,
    excluded: Sequence[tuple[Any, ...]],
    *,
    items: Sequence[Any] | None = None,
    pool_capacity_bytes: int | None = None,
) -> tuple[pulp.LpProblem, Callable[[], tuple[Any, ...]]]:
    """One variable per candidate, one memory row per event block; and a function reading the answer.

    ``items``: what the answer lists for each candidate (default its region; the joint program lists the region with
    its action, and may hold one region more than once, under different actions). ``pool_capacity_bytes``: add the
    host pool's row, the offloaded candidates' ``pool_bytes`` within it."""
    items = list(items) if items is not None else [c.region for c in candidates]
    prob = pulp.LpProblem("autockpt_floor" if budget is None else "autockpt_plan", pulp.LpMinimize)
    # w_i: 1 if candidate i is chosen (its region recomputed, or offloaded)
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

    # [Constraint] not a set already simulated over the budget (a no-good cut: at least one of its items changes)
    position = {item: i for i, item in enumerate(items)}
    for k, plan in enumerate(excluded):
        if plan and all(item in position for item in plan):
            add_no_good_cut(prob, f"not_plan_{k}", [w[position[item]] for item in plan], w)

    # [Constraint] what offloaded regions store fits the host pool (additive: a storage is moved once, so a plan's
    # pool is at most the sum of its regions' alone; the simulator then checks the plan's exact pool)
    pool_terms = [(w[i], c.pool_bytes) for i, c in enumerate(candidates) if c.pool_bytes > 0]
    if pool_capacity_bytes is not None and sum(b for _, b in pool_terms) > pool_capacity_bytes:
        prob += pulp.LpConstraint(
            pulp.LpAffineExpression(pool_terms), pulp.LpConstraintLE, "host_pool", pool_capacity_bytes
        )

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

    def chosen_items() -> tuple[Any, ...]:
        chosen = sorted((i for i in range(len(candidates)) if (w[i].value() or 0) > 0.5),
                        key=lambda i: candidates[i].region.first_unit)
        return tuple(items[i] for i in chosen)

    return prob, chosen_items
