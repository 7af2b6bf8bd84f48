"""Compiled verification: the optimized module under ``torch.compile``, kept under the budget as the compiled step runs.

``torch.compile(optimized)`` keeps every planned region (one checkpoint higher-order op each), but the partitioner
re-decides what is saved between them and Inductor fuses away or adds buffers, so the compiled step's peak is not the
eager step's: on CPU a 2-layer GPT-NeoX-style decoder planned and verified at 1.86 MB peaked at 2.48 MB compiled, and
a GPT-2 planned at 4.77 MB at 3.68 MB. This stage compiles the verified module, measures one compiled step where
MemTracker cannot see (``measure.measure_compiled_step``: the allocator's own count), plans again for a target lowered
by the overshoot while it is over the budget (down to the eager floor), and for ones raised by the headroom while they
fit; of the plans that fit, the one whose compiled step is fastest, timed against the others, is kept.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from autockpt.errors import InfeasibleBudgetError
from autockpt.measure import StepMeasurement, relative_step_times
from autockpt.rewrite import OptimizedModule
from autockpt.units import format_bytes
from autockpt.verify import in_planned_device, tightened_target

logger = logging.getLogger(__name__)

COMPILE_ATTEMPTS = 4  # plans compiled while the compiled step is over the budget (the last one at the eager floor)
LOOSEN_ATTEMPTS = 2  # plans compiled for a looser target while the loosest kept one leaves headroom


class CompilingPlanner(Protocol):
    """What compiled verification needs from a planner (``api.Planner`` implements it)."""

    def optimize(self, budget_gb: float | None = None, *, budget_bytes: int | None = None) -> OptimizedModule: ...

    def measure_compiled(self, compiled: nn.Module, module: OptimizedModule) -> StepMeasurement: ...

    def alternating_step_seconds(self, modules: Sequence[nn.Module]) -> list[list[float]]: ...


@dataclasses.dataclass(frozen=True)
class _Compiled:
    target_bytes: int  # the eager budget the plan was made and verified for
    module: OptimizedModule
    compiled: nn.Module
    peak_bytes: int  # the compiled step's, by the allocator


def compiled_module(
    planner: CompilingPlanner, budget_bytes: int, compile_options: Mapping[str, Any] | None = None
) -> nn.Module:
    """``torch.compile`` of a module optimized so that its *compiled* step measured at most ``budget_bytes``;
    ``InfeasibleBudgetError`` (with the lowest compiled peak measured) when no plan down to the eager floor gets there.

    The compiled peak is not the eager one either way: over the budget, the eager target is lowered by the overshoot
    (down to the eager floor); well under it (the partitioner and Inductor saved less than eager mode keeps), the
    target is raised by the headroom while the looser plan's compiled step still fits. Every plan that fits is a
    candidate, and the one whose compiled step is fastest, timed against the others in alternating rounds, is kept:
    the eager prediction of the recomputation's cost does not carry over either (Inductor fuses what a region
    recomputes; on CPU a GPT-2's looser compiled plans ran slower than the tighter one)."""
    options = dict(compile_options or {})
    readings: list[str] = []

    def attempt(target: int) -> _Compiled:
        module = planner.optimize(budget_bytes=target)
        compiled = torch.compile(module, **options)
        # judged with the device as planned (not the planner's copies held aside while measuring)
        peak, _ = in_planned_device(module.plan, planner.measure_compiled(compiled, module))
        readings.append(f"planned for {target}, compiled {peak}")
        logger.info("plan for %d bytes: compiled step %d bytes (budget %d)", target, peak, budget_bytes)
        return _Compiled(target, module, compiled, peak)

    candidates = [_tightened(attempt, budget_bytes, readings)]
    for _ in range(LOOSEN_ATTEMPTS):
        loosest = candidates[-1]
        looser_target = loosest.target_bytes + budget_bytes - loosest.peak_bytes
        if looser_target <= loosest.target_bytes or not loosest.module.plan.regions:
            break  # no headroom, or nothing left to stop recomputing
        try:
            looser = attempt(looser_target)
        except InfeasibleBudgetError:
            break  # eager verification refused the looser target
        if looser.peak_bytes > budget_bytes:
            break
        if looser.module.plan.policy == loosest.module.plan.policy:
            break  # the same plan: nothing new to time
        candidates.append(looser)
    kept, timing = _fastest(planner, candidates)
    plan = kept.module.plan
    kept.module.set_plan(dataclasses.replace(plan, notes=(*plan.notes, (
        f"compiled with torch.compile({', '.join(f'{k}={v!r}' for k, v in options.items())}): the compiled step "
        f"measured {format_bytes(kept.peak_bytes)} by the allocator's count, budget {format_bytes(budget_bytes)}; "
        f"planned for {format_bytes(kept.target_bytes)} in eager terms (compiled plans tried: {'; '.join(readings)})"
        f"{timing}"
    ))))
    return kept.compiled


def _fastest(planner: CompilingPlanner, candidates: list[_Compiled]) -> tuple[_Compiled, str]:
    """The candidate whose compiled step is fastest (median over alternating rounds of its time over the first
    candidate's in the same round), and a sentence saying how they compared ('' for a single candidate)."""
    if len(candidates) == 1:
        return candidates[0], ""
    seconds = planner.alternating_step_seconds([candidate.compiled for candidate in candidates])
    ratios = relative_step_times(seconds)
    fastest = min(range(len(candidates)), key=ratios.__getitem__)
    compared = ", ".join(
        f"planned for {candidate.target_bytes}: {ratio / ratios[fastest]:.3f}x"
        for candidate, ratio in zip(candidates, ratios)
    )
    logger.info("compiled candidates' step times relative to the fastest: %s", compared)
    return candidates[fastest], (
        f"; kept the fastest of {len(candidates)} compiled plans that fit, by step time relative to it ({compared}; "
        f"median of {len(seconds[0])} alternating rounds)"
    )


def _tightened(attempt: Callable[[int], _Compiled], budget_bytes: int, readings: list[str]) -> _Compiled:
    """The first plan, tightened by the compiled overshoot down to the eager floor, whose compiled step keeps the
    budget."""
    target = budget_bytes
    lowest: int | None = None
    for attempt_index in range(COMPILE_ATTEMPTS):
        try:
            tried = attempt(target)
        except InfeasibleBudgetError as error:
            if lowest is None:
                raise
            raise _not_kept(budget_bytes, readings, lowest, f"the eager plan for {target} bytes failed: {error}") from error
        lowest = tried.peak_bytes if lowest is None else min(lowest, tried.peak_bytes)
        if tried.peak_bytes <= budget_bytes:
            return tried
        floor = tried.module.plan.min_feasible_bytes
        if target <= floor:
            raise _not_kept(budget_bytes, readings, lowest, "the eager floor's plan was tried")
        target = tightened_target(
            target, tried.peak_bytes - budget_bytes, budget_bytes, floor, last_next=attempt_index == COMPILE_ATTEMPTS - 2
        )
        del tried  # its compiled graphs hold memory the next attempt's measurement would count
    raise _not_kept(budget_bytes, readings, lowest, f"after {COMPILE_ATTEMPTS} plans, the eager floor's the last")


def _not_kept(budget_bytes: int, readings: list[str], lowest: int | None, why: str) -> InfeasibleBudgetError:
    return InfeasibleBudgetError(
        f"the budget {format_bytes(budget_bytes)} was not kept by the compiled step ({why}; bytes: "
        f"{'; '.join(readings)}). Use a budget of at least {lowest} bytes (the lowest compiled peak measured), a "
        "smaller batch, or optimize without compiling.",
        budget_bytes=budget_bytes,
        min_feasible_bytes=lowest,
    )
