"""PuLP helpers every program in this package shares: the constraints they have in common, the solver, its report.

Conventions of the programs (``milp.py``, ``blocks.py``): one binary variable per choice, a legend comment per
variable and a ``# [Constraint]`` label per family of rows; memory in bytes, or in GB for the peak variable of a
floor program so coefficients stay well scaled.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
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
    """Solve ``prob`` with the named solver (writing it as an .lp file first when the options ask) and report. A
    program solved before in this process, to the coefficient and with the same solver settings, is answered from
    ``SOLVED_PROGRAMS`` (planners of one model and step build the same programs: its floor, its budgets' refinements)."""
    if options.write_lp_path:
        prob.writeLP(f"{options.write_lp_path}.{prob.name}.lp")
    variables = prob.variables()  # PuLP sorts them on every call: once for the key and the values
    key = _program_key(prob, variables, name, options, objective_cutoff)
    solved = SOLVED_PROGRAMS.get(key)
    if solved is None:
        prob.solve(make_solver(name, options, objective_cutoff=objective_cutoff))
        solved = SolvedProgram(
            status=prob.status, sol_status=prob.sol_status,
            values=tuple(variable.varValue for variable in variables), stats=program_stats(prob, name),
        )
        SOLVED_PROGRAMS[key] = solved
        if len(SOLVED_PROGRAMS) > SOLVED_PROGRAMS_KEPT:
            SOLVED_PROGRAMS.popitem(last=False)
    else:
        SOLVED_PROGRAMS.move_to_end(key)
        prob.status, prob.sol_status = solved.status, solved.sol_status
        for variable, value in zip(variables, solved.values):
            variable.varValue = value
    return solved.stats


@dataclasses.dataclass(frozen=True, slots=True)
class SolvedProgram:
    """What a solve left on its program: PuLP's statuses and each variable's value (in ``prob.variables()`` order)."""

    status: int
    sol_status: int
    values: tuple[float | None, ...]
    stats: SolverStats


# the programs solved last in this process, by their content and solver settings (a HiGHS solve of a floor program
# took 0.1-1 s on the tests' models; about 40 % of the suite's solves were ones solved before, issue 46)
SOLVED_PROGRAMS: collections.OrderedDict[bytes, SolvedProgram] = collections.OrderedDict()
SOLVED_PROGRAMS_KEPT = 256


def _program_key(prob: pulp.LpProblem, variables: Sequence[pulp.LpVariable], name: str, options: SolverOptions,
                 objective_cutoff: float | None) -> bytes:
    """The program's every coefficient, bound, sense and name, with what the solver is told: equal keys, equal
    answers (HiGHS and CBC are deterministic on one program). A digest of its text (``repr`` of a float is exact):
    about 1 ms for a floor program of the tests' models, where PuLP's ``toDict`` as JSON took 8."""
    program = (
        prob.name, prob.sense, name, options.time_limit_s, options.relative_gap, objective_cutoff,
        [(variable.name, coefficient) for variable, coefficient in prob.objective.items()],
        [(row, constraint.sense, constraint.constant, [(variable.name, coefficient) for variable, coefficient in
                                                       constraint.items()])
         for row, constraint in prob.constraints.items()],
        [(variable.name, variable.cat, variable.lowBound, variable.upBound) for variable in variables],
    )
    return hashlib.sha256(repr(program).encode()).digest()
