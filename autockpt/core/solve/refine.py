"""Refine: move the budget handed to a program until the simulated peak of its answer sits just under the user's.

The programs add the gains of disjoint regions up and charge forward memory per group of events at its worst, so
their answer at the user's budget can simulate over it (regions interact) or well under it (the program was too
cautious). ``refine`` bisects on the program's effective budget, rules out sets that simulated over the budget (the
MILPs can; the block chain answers the same at the same budget), and keeps the cheapest plan that fits.
"""

from __future__ import annotations

import contextvars
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from autockpt.core.solve.base import (
    PlanSearch,
    Problem,
    Program,
    SolveResult,
    SolverOptions,
    region_actions,
    summarise_programs,
)
from autockpt.errors import InfeasibleBudgetError
from autockpt.types import PlanStatus, SolverStats, StepTrace, Timeline
from autockpt.units import format_bytes

RETRIES_AT_ONE_BUDGET = 2  # programs re-solved at one effective budget, each without the sets that went over

Plan3 = tuple[tuple[Any, ...], Timeline, PlanStatus]  # a plan's items, its simulated timeline, how it was found


def refine(
    problem: PlanSearch,
    budget_bytes: int,
    options: SolverOptions,
    program: Program,
    solver: str,
    programs: list[SolverStats],
    *,
    best: Plan3 | None,
    rules_out_sets: bool,
) -> Plan3 | None:
    """The cheapest plan found under ``budget_bytes`` (``best`` if none is cheaper), after at most
    ``options.refinement_rounds`` programs; each program's statistics are appended to ``programs``."""
    baseline, profile = problem.baseline, problem.trace
    # Bisection on the budget handed to the program: below search_low the program's plans were (or would be) too
    # tight or fit, above search_high the simulated peak went over the user's budget.
    effective = float(budget_bytes)
    search_low, search_high = -math.inf, math.inf
    # a plan this close under the budget is kept: each further program (~0.5-2 s) buys little recompute time
    close_enough_bytes = 0.01 * max(baseline.peak_bytes - profile.static_bytes, 0)
    over_budget: list[tuple[Any, ...]] = []  # plans the program chose that simulated over the budget
    last_overshoot_effective, retries_here = math.nan, 0
    for _ in range(options.refinement_rounds):
        answer = program(problem, effective, options, solver, excluded=over_budget)
        programs.append(answer.stats)
        regions, status = answer.regions, answer.status
        if regions is None:  # the program is infeasible: it over-estimates memory, give it more room
            search_low = max(search_low, effective)
            effective = effective + 0.01 * budget_bytes if search_high == math.inf else (effective + search_high) / 2
            continue
        timeline = problem.simulate(regions)
        if problem.fits(timeline, budget_bytes):
            if best is None or timeline.overhead_ms < best[1].overhead_ms:
                best = (regions, timeline, status)
            search_low = max(search_low, effective)
            slack = budget_bytes - timeline.peak_bytes
            if slack <= close_enough_bytes:
                break
            effective = effective + slack if search_high == math.inf else (effective + search_high) / 2
        else:
            # the program adds gains up, but regions interact: rule this set out and try the same effective budget
            # again (the next-cheapest set may well fit) before tightening it
            over_budget.append(regions)
            retries_here = 0 if effective != last_overshoot_effective else retries_here + 1
            last_overshoot_effective = effective
            if retries_here < RETRIES_AT_ONE_BUDGET and rules_out_sets:
                continue
            search_high = min(search_high, effective)
            overshoot = timeline.peak_bytes - budget_bytes
            effective = (
                effective - overshoot - 0.001 * budget_bytes if search_low == -math.inf else (effective + search_low) / 2
            )
        if search_high - search_low < 0.001 * budget_bytes:
            break
    return best


def identity_result(
    problem: Problem, min_feasible_bytes: int, solver: str, started: float, programs: Sequence[SolverStats],
    floor_region_actions: tuple[Any, ...] | None = None,
) -> SolveResult:
    """The budget is at or above the unmodified peak: nothing to do."""
    return SolveResult(
        region_actions=region_actions((), problem.action), action=problem.action, timeline=problem.baseline, baseline=problem.baseline,
        min_feasible_bytes=min_feasible_bytes, status=PlanStatus.IDENTITY, solver=solver,
        solve_time_s=time.perf_counter() - started, stats=summarise_programs(list(programs)),
        floor_region_actions=floor_region_actions,
    )


def static_over_budget(trace: StepTrace, budget_bytes: int, min_feasible_bytes: int | None) -> str:
    """The refusal of a budget under the step's static bytes, which no checkpoint or offload plan lowers; with the
    smallest peak found, or (None) the bound ``floor_lower_bound_bytes`` when no floor was searched."""
    parts = [("parameters", trace.parameter_bytes), ("gradients", trace.gradient_bytes),
             ("optimizer states", trace.optimizer_state_bytes), ("buffers", trace.buffer_bytes),
             ("inputs", trace.input_bytes)]
    breakdown = " + ".join(f"{name} {format_bytes(size)}" for name, size in parts if size)
    smallest = format_bytes(min_feasible_bytes) if min_feasible_bytes is not None else (
        f"at least {format_bytes(floor_lower_bound_bytes(trace))} (a bound, no floor was searched: the static memory "
        "and what the step still holds when it ends, the model's output and optimizer.step()'s temporaries, or the "
        "largest working set of one of its ops)"
    )
    devices = math.ceil(trace.static_bytes / max(budget_bytes, 1))
    return (
        f"budget {format_bytes(budget_bytes)} is below the smallest peak autockpt can reach for this model and input, "
        f"{smallest}, and below the static memory alone, {format_bytes(trace.static_bytes)} "
        f"({breakdown}), which is held through the whole step whatever is recomputed or offloaded: no plan fits one "
        f"device. The static bytes alone need at least {devices:,} devices of {format_bytes(budget_bytes)}: split the "
        f"model into at least {devices:,} pipeline stages (autockpt.plan_pipeline) or shard its parameters, gradients "
        f"and optimizer states across at least {devices:,} devices (FSDP, ZeRO-3), each device then also holding its "
        "activations; a smaller optimizer state (e.g. 8-bit or factored) lowers the static bytes too."
    )


def end_of_step_bytes(trace: StepTrace) -> int:
    """What the step holds when it ends (the end marker event: parameters, buffers, inputs, gradients, optimizer
    states, the model's output and ``optimizer.step()``'s peak). No plan changes that event (regions free and hold
    tensors only until their backward is done), so no plan's peak is under it: a lower bound of the floor."""
    return trace.events[-1].peak_bytes if trace.events else trace.static_bytes


def floor_lower_bound_bytes(trace: StepTrace) -> int:
    """A bound no plan's peak goes under, known without a search: ``end_of_step_bytes``, or where more, the largest
    of what an event's own ops raise the bytes by (its peak over its start: the same ops run under any plan, making
    the same tensors) on top of what no plan frees while it runs (parameters, buffers, inputs, optimizer states, the
    device bytes the step does not own; gradients only where they are alive from the step's start, since autocast's
    late leaf gradients move others later). A chunked loss's working set, say, is such a rise: a program whose chunk
    makes more than the budget leaves is refused without its floor searched."""
    held = trace.parameter_bytes + trace.buffer_bytes + trace.input_bytes + trace.optimizer_state_bytes + (
        trace.foreign_bytes)
    if trace.loop is not None and trace.loop.gradients_at_start:
        held += trace.gradient_bytes
    rise = max((event.peak_bytes - event.start_bytes for event in trace.events), default=0)
    return max(end_of_step_bytes(trace), held + rise)


# True while a refusal's floor is searched: the solve it runs again takes the full path (it refuses nothing first)
_SEARCHING_FLOOR: contextvars.ContextVar[bool] = contextvars.ContextVar("autockpt_searching_floor", default=False)


def refuse_static_over_budget(trace: StepTrace, budget_bytes: int, search: Callable[[], object]) -> None:
    """Refuse, before any problem is prepared or floor searched, a budget under ``floor_lower_bound_bytes`` (the
    static bytes and what the step holds when it ends, or an op's own working set on top of what no plan frees: a
    bound no plan goes under): a 70-billion-parameter model at one device's memory is then refused in milliseconds
    instead of after a floor search of tens of seconds, and a program of the loss whose logits outlive backward, or
    whose chunk's working set is over the budget (``planning/loss_chunks.py``), without its floor searched.

    ``search`` is the refused solve (the call this check starts); run again while the refusal's floor is searched,
    this check lets it through, so that it raises the ``InfeasibleBudgetError`` whose ``min_feasible_bytes`` (the
    floor, searched) this refusal's gives when first read (``errors.InfeasibleBudgetError``).
    """
    bound = floor_lower_bound_bytes(trace)
    if budget_bytes >= bound or _SEARCHING_FLOOR.get():
        return

    searched: list[InfeasibleBudgetError] = []

    def searched_floor() -> int:
        searching = _SEARCHING_FLOOR.set(True)
        try:
            search()
        except InfeasibleBudgetError as error:
            searched.append(error)
            return error.min_feasible_bytes
        finally:
            _SEARCHING_FLOOR.reset(searching)
        raise RuntimeError(f"a plan was found under {bound} bytes, a bound no plan goes under: a simulator bug")

    if budget_bytes < trace.static_bytes:  # far off: said at once, with the bound and the devices the bytes need
        raise InfeasibleBudgetError(static_over_budget(trace, budget_bytes, None), budget_bytes=budget_bytes,
                                    min_feasible_bytes=searched_floor, lower_bound_bytes=bound)
    def searched_refusal() -> str:  # a floor set by hand (the setter) searched nothing: said plainly
        return str(searched[0]) if searched else no_plan_error(budget_bytes, refusal.min_feasible_bytes).args[0]

    # near: the user choosing a budget needs the floor, so the message is the search's (searched when read)
    refusal = InfeasibleBudgetError("", budget_bytes=budget_bytes, min_feasible_bytes=searched_floor,
                                    lower_bound_bytes=bound, searched_message=searched_refusal)
    raise refusal


def check_reachable(problem: Problem, budget_bytes: int, min_feasible_bytes: int) -> None:
    """Raise ``InfeasibleBudgetError`` when the budget is below the lowest peak found."""
    if budget_bytes >= min_feasible_bytes:
        return
    trace = problem.trace
    states = " + optimizer states" if trace.optimizer_state_bytes else ""
    loop = f"; {trace.loop.describe()}" if trace.loop is not None else ""
    # the end marker event holds optimizer.step()'s peak, which no plan changes
    step_peak = trace.events[-1].peak_bytes if trace.loop is not None and trace.loop.optimizer is not None else 0
    binding = (
        " That floor is optimizer.step()'s own peak, which no plan lowers: a smaller or fused optimizer, or sharding "
        "its states, is what would." if step_peak >= min_feasible_bytes else ""
    )
    if budget_bytes < trace.static_bytes:
        raise InfeasibleBudgetError(static_over_budget(trace, budget_bytes, min_feasible_bytes),
                                    budget_bytes=budget_bytes, min_feasible_bytes=min_feasible_bytes)
    raise InfeasibleBudgetError(
        f"budget {format_bytes(budget_bytes)} is below the smallest peak autockpt can reach for this model and input, "
        f"{format_bytes(min_feasible_bytes)} (static memory alone, parameters + buffers + gradients + inputs{states}, "
        f"is {format_bytes(trace.static_bytes)}; the unmodified step peaks at "
        f"{format_bytes(problem.baseline.peak_bytes)}{loop}). Use a budget of at least {min_feasible_bytes} bytes, or a "
        f"smaller batch or sequence.{binding}",
        budget_bytes=budget_bytes,
        min_feasible_bytes=min_feasible_bytes,
    )


def no_plan_error(budget_bytes: int, floor_peak_bytes: int) -> InfeasibleBudgetError:
    return InfeasibleBudgetError(
        f"no plan found under the budget {format_bytes(budget_bytes)}; the smallest simulated peak found is "
        f"{format_bytes(floor_peak_bytes)}. Raise the budget to at least {floor_peak_bytes} bytes.",
        budget_bytes=budget_bytes,
        min_feasible_bytes=floor_peak_bytes,
    )
