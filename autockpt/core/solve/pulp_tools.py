"""PuLP helpers every program in this package shares: the constraints they have in common, the solver, its report.

Conventions of the programs (``milp.py``, ``blocks.py``): one binary variable per choice, a legend comment per
variable and a ``# [Constraint]`` label per family of rows; memory in bytes, or in GB for the peak variable of a
floor program so coefficients stay well scaled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pulp

from autockpt.core.solve.base import SolverName, SolverOptions
from autockpt.types import Region, SolverStats


def add_no_overlap(prob: pulp.LpProblem, regions: Sequence[Region], variables: Sequence[pulp.LpVariable]) -> None:
    """[Constraint] the chosen regions do not overlap: at most one of the regions covering each elementary piece
    (the coarsest partition of the units on which every region is a union of pieces)."""
    num_units = max((r.last_unit for r in regions), default=-1) + 1
    for k, piece in enumerate(elementary_pieces(num_units, list(regions))):
        covering = [v for r, v in zip(regions, variables) if piece.first_unit in r]
        if len(covering) > 1:
            prob += pulp.lpSum(covering) <= 1, f"no_overlap_piece_{k}"


def add_no_good_cut(
    prob: pulp.LpProblem, name: str, chosen: Sequence[pulp.LpVariable], everything: Sequence[pulp.LpVariable]
) -> None:
    """[Constraint] the answer is not exactly the set ``chosen`` (a set already simulated over the budget): at least
    one of its variables goes to 0 or another goes to 1."""
    inside = {id(v) for v in chosen}
    terms = [(v, 1 if id(v) in inside else -1) for v in everything]
    prob += pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintLE, name, len(inside) - 1)


def elementary_pieces(num_units: int, candidates: list[Region]) -> list[Region]:
    """The coarsest partition of the units on which every candidate region is a union of pieces (none for no units:
    a model with no candidate region)."""
    if num_units <= 0:
        return []
    starts = sorted({0} | {r.first_unit for r in candidates} | {r.last_unit + 1 for r in candidates if r.last_unit + 1 < num_units})
    ends = starts[1:] + [num_units]
    return [Region(first_unit=a, last_unit=b - 1) for a, b in zip(starts, ends)]


def program_stats(prob: pulp.LpProblem, solver_name: str) -> SolverStats:
    """How one solved program went."""
    return SolverStats(
        status=pulp.LpSolution.get(prob.sol_status, str(prob.sol_status)), relative_gap=mip_gap(prob, solver_name),
        variables=len(prob.variables()), constraints=len(prob.constraints), programs=1,
    )


def has_solution(prob: pulp.LpProblem) -> bool:
    return prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)


def is_proven_optimal(prob: pulp.LpProblem) -> bool:
    return prob.sol_status == pulp.LpSolutionOptimal


def no_incumbent(stats: SolverStats) -> bool:
    """The solver stopped (time limit) without any solution: not the same as a proven infeasible program."""
    return stats.status == pulp.LpSolution[pulp.LpSolutionNoSolutionFound]


def mip_gap(prob: pulp.LpProblem, solver_name: str) -> float | None:
    """The proven relative gap; HiGHS reports it through its model object, PuLP's CBC command does not."""
    model = getattr(prob, "solverModel", None)
    if solver_name != SolverName.HIGHS or model is None:
        return None
    try:
        gap = float(model.getInfo().mip_gap)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
    return gap if math.isfinite(gap) else None


def solver_name(options: SolverOptions) -> str:
    if options.solver != SolverName.AUTO:
        return options.solver
    return SolverName.HIGHS if pulp.HiGHS(msg=False).available() else SolverName.CBC


def make_solver(name: str, options: SolverOptions, *, objective_cutoff: float | None = None) -> pulp.LpSolver:
    """``objective_cutoff``: HiGHS prunes every branch whose bound is above it (CBC through PuLP: ignored)."""
    if name == SolverName.HIGHS:
        cutoff = {} if objective_cutoff is None else {"objective_bound": objective_cutoff}
        solver = pulp.HiGHS(msg=False, timeLimit=options.time_limit_s, gapRel=options.relative_gap, **cutoff)
        if not solver.available():
            raise ValueError("solver='highs' needs the highspy package: pip install highspy (or use solver='cbc')")
        return solver
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=options.time_limit_s, gapRel=options.relative_gap)


def solve_and_write(prob: pulp.LpProblem, name: str, options: SolverOptions, *, objective_cutoff: float | None = None) -> SolverStats:
    """Solve ``prob`` with the named solver (writing it as an .lp file first when the options ask) and report."""
    if options.write_lp_path:
        prob.writeLP(f"{options.write_lp_path}.{prob.name}.lp")
    prob.solve(make_solver(name, options, objective_cutoff=objective_cutoff))
    return program_stats(prob, name)
