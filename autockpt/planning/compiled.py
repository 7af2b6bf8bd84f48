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
import gc
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from autockpt.errors import InfeasibleBudgetError
from autockpt.measure.step import StepMeasurement, relative_step_times
from autockpt.planning.verify import in_planned_device, tightened_target
from autockpt.records.plan import Plan
from autockpt.runtime.rewrite import OptimizedModule
from autockpt.units import format_bytes

logger = logging.getLogger(__name__)

COMPILE_ATTEMPTS = 4  # plans compiled while the compiled step is over the budget (the last one at the eager floor)
LOOSEN_ATTEMPTS = 2  # plans compiled for a looser target while the loosest kept one leaves headroom
# structural plans compiled when no eager plan's compiled step fits: a region per repeated block, per two. The compiled
# peak does not follow the eager one: on CPU a 2-layer GPT-NeoX's eager floor plan compiled to 2.48 MB, its
# one-region-per-layer plan to 2.02 MB
STRUCTURAL_PLANS = ("every_1", "every_2")
# step times closer than this to the fastest candidate's count as tied: alternating rounds on a shared CPU do not
# resolve a few per cent (timed in one round robin, compiled GPT-2 plans of 0 to 7 regions ran at 0.70x to 0.76x of
# the eager step, in no order of their regions)
TIED_WITHIN = 0.02
MIN_HEADROOM = 0.005  # a looser plan is compiled only for at least this share of the budget left unused


class CompilingPlanner(Protocol):
    """What compiled verification needs from a planner (``api.Planner`` implements it)."""

    def optimize(self, budget_gb: float | None = None, *, budget_bytes: int | None = None) -> OptimizedModule: ...

    def structural_plan(self, strategy: str) -> Plan | None:
        """The plan of a structural baseline (``every_1``: a region per repeated block), None where the graph has
        none."""

    def apply(self, plan: Plan) -> OptimizedModule: ...

    def measure_compiled(self, compiled: nn.Module, module: OptimizedModule) -> StepMeasurement: ...

    def alternating_step_seconds(self, modules: Sequence[nn.Module]) -> list[list[float]]: ...


@dataclasses.dataclass(frozen=True)
class _Compiled:
    planned_for: str  # what the plan was made for: an eager budget ("planned for N") or a structural baseline
    target_bytes: int  # the eager budget the plan was made for (a baseline's: its predicted peak)
    module: OptimizedModule
    compiled: nn.Module
    peak_bytes: int  # the compiled step's, by the allocator


@dataclasses.dataclass
class _CompiledAttempts:
    """Compiles plans and measures their compiled steps, keeping every reading for the notes and the refusal."""

    planner: CompilingPlanner
    budget_bytes: int
    options: dict[str, Any]
    readings: list[str] = dataclasses.field(default_factory=list)
    peaks: list[int] = dataclasses.field(default_factory=list)
    why: str = ""  # the last refusal's reason

    def for_target(self, target: int) -> _Compiled:
        return self.compiled(self.planner.optimize(budget_bytes=target), f"planned for {target}", target)

    def compiled(self, module: OptimizedModule, planned_for: str, target: int) -> _Compiled:
        compiled = torch.compile(module, **self.options)
        # judged with the device as planned (not the planner's copies held aside while measuring)
        peak, _ = in_planned_device(module.plan, self.planner.measure_compiled(compiled, module))
        self.readings.append(f"{planned_for}, compiled {peak}")
        self.peaks.append(peak)
        logger.info("%s: compiled step %d bytes (budget %d)", planned_for, peak, self.budget_bytes)
        return _Compiled(planned_for, target, module, compiled, peak)

    def refusal(self, why: str, *, at_least: int | None = None) -> InfeasibleBudgetError:
        """The budget refused, stating the lowest compiled peak measured (no lower than ``at_least``: the eager
        floor, when the budget was under it)."""
        self.why = why
        lowest = min(self.peaks, default=None)
        if lowest is not None and at_least is not None:
            lowest = max(lowest, at_least)
        return InfeasibleBudgetError(
            f"the budget {format_bytes(self.budget_bytes)} was not kept by the compiled step ({why}; bytes: "
            f"{'; '.join(self.readings)}). Use a budget of at least {lowest} bytes (the lowest compiled peak "
            "measured), a smaller batch, or optimize without compiling.",
            budget_bytes=self.budget_bytes,
            min_feasible_bytes=lowest,
        )


def compiled_module(
    planner: CompilingPlanner, budget_bytes: int, compile_options: Mapping[str, Any] | None = None
) -> nn.Module:
    """``torch.compile`` of a module optimized so that its *compiled* step measured at most ``budget_bytes``;
    ``InfeasibleBudgetError`` (with the lowest compiled peak measured) when no plan gets there.

    The compiled peak is not the eager one either way: over the budget, the eager target is lowered by the overshoot
    (down to the eager floor), then the structural plans (a region per repeated block, per two) are compiled; well
    under it (the partitioner and Inductor saved less than eager mode keeps), the target is raised by the headroom
    while the looser plan's compiled step still fits, and one plan half way down to the eager floor is compiled too.
    Every plan that fits is a candidate, and the one whose compiled step is fastest, timed against the others in
    alternating rounds, is kept (of steps tied within ``TIED_WITHIN``, the lowest peak): the eager prediction of the
    recomputation's cost does not carry over (Inductor fuses what a region recomputes)."""
    options = dict(compile_options or {})
    attempts = _CompiledAttempts(planner, budget_bytes, options)
    first, refusal = _tightened(attempts)
    if first is None:
        # outside the refusal's except block: its traceback would keep the last plan tried, compiled, alive while the
        # structural plans are measured
        eager_refused = not attempts.peaks  # the budget is under the eager floor: nothing was compiled
        first = _structural(attempts)
        if first is None:
            if eager_refused and not attempts.peaks:
                raise refusal
            raise attempts.refusal(
                f"{attempts.why or refusal}, then the structural plans where the graph has them",
                at_least=refusal.min_feasible_bytes if eager_refused else None,
            )
    tighter = _tighter(attempts, first)
    candidates = [*([tighter] if tighter is not None else []), first, *_looser(attempts, first)]
    kept, timing = _fastest(planner, candidates)
    del candidates, first, tighter
    gc.collect()  # the plans not kept are reference cycles: free their compiled graphs (CUDA graph pools, constants) now
    plan = kept.module.plan
    kept.module.set_plan(dataclasses.replace(plan, notes=(*plan.notes, (
        f"compiled with torch.compile({', '.join(f'{k}={v!r}' for k, v in options.items())}): the compiled step "
        f"measured {format_bytes(kept.peak_bytes)} by the allocator's count, budget {format_bytes(budget_bytes)}; "
        f"{kept.planned_for} (compiled plans tried: {'; '.join(attempts.readings)}){timing}"
    ))))
    return kept.compiled


def _looser(attempts: _CompiledAttempts, first: _Compiled) -> list[_Compiled]:
    """Plans for targets raised by the headroom the last one left, while their compiled steps fit."""
    found: list[_Compiled] = []
    loosest = first
    for _ in range(LOOSEN_ATTEMPTS):
        headroom = attempts.budget_bytes - loosest.peak_bytes
        if headroom < attempts.budget_bytes * MIN_HEADROOM or not loosest.module.plan.regions:
            break  # too little headroom to change the plan, or nothing left to stop recomputing
        try:
            looser = attempts.for_target(loosest.target_bytes + headroom)
        except InfeasibleBudgetError:
            break  # eager verification refused the looser target
        if looser.peak_bytes > attempts.budget_bytes or looser.module.plan.policy == loosest.module.plan.policy:
            break  # over the budget, or the same plan: nothing new to time
        found.append(looser)
        loosest = looser
    return found


def _fastest(planner: CompilingPlanner, candidates: list[_Compiled]) -> tuple[_Compiled, str]:
    """The candidate whose compiled step is fastest (median over alternating rounds of its time over the first
    candidate's in the same round), the lowest peak among those within ``TIED_WITHIN`` of it (a difference the
    rounds do not resolve: the lower peak leaves the allocator more room), and a sentence saying how they compared
    ('' for a single candidate)."""
    if len(candidates) == 1:
        return candidates[0], ""
    seconds = planner.alternating_step_seconds([candidate.compiled for candidate in candidates])
    ratios = relative_step_times(seconds)
    fastest = min(ratios)
    tied = [index for index, ratio in enumerate(ratios) if ratio <= fastest * (1 + TIED_WITHIN)]
    kept = min(tied, key=lambda index: candidates[index].peak_bytes)
    compared = ", ".join(
        f"{candidate.planned_for}: {ratio / fastest:.3f}x" for candidate, ratio in zip(candidates, ratios)
    )
    logger.info("compiled candidates' step times relative to the fastest: %s", compared)
    return candidates[kept], (
        f"; kept of {len(candidates)} compiled plans that fit the lowest peak among those within "
        f"{TIED_WITHIN:.0%} of the fastest step ({compared}; median of {len(seconds[0])} alternating rounds)"
    )


def _tighter(attempts: _CompiledAttempts, first: _Compiled) -> _Compiled | None:
    """A plan half way from the first that fits down to the eager floor, when it is another plan and fits: under
    compile more recomputation need not cost time (Inductor fuses it), and of plans equally fast the lower peak is
    kept."""
    floor = first.module.plan.min_feasible_bytes
    target = first.target_bytes - (first.target_bytes - floor) // 2
    if first.planned_for.startswith("structural") or target >= first.target_bytes:
        return None
    try:
        tighter = attempts.for_target(target)
    except InfeasibleBudgetError:
        return None
    if tighter.peak_bytes > attempts.budget_bytes or tighter.module.plan.policy == first.module.plan.policy:
        return None
    return tighter


def _tightened(attempts: _CompiledAttempts) -> tuple[_Compiled, None] | tuple[None, InfeasibleBudgetError]:
    """The first plan, tightened by the compiled overshoot down to the eager floor, whose compiled step keeps the
    budget; or, when none does, the refusal (the eager planner's own when the budget is under the eager floor)."""
    budget_bytes = attempts.budget_bytes
    target = budget_bytes
    for attempt_index in range(COMPILE_ATTEMPTS):
        try:
            tried = attempts.for_target(target)
        except InfeasibleBudgetError as error:
            if not attempts.peaks:
                return None, error
            return None, attempts.refusal(f"the eager plan for {target} bytes failed: {error}")
        if tried.peak_bytes <= budget_bytes:
            return tried, None
        floor = tried.module.plan.min_feasible_bytes
        if target <= floor:
            return None, attempts.refusal("the eager floor's plan was tried")
        target = tightened_target(
            target, tried.peak_bytes - budget_bytes, budget_bytes, floor, last_next=attempt_index == COMPILE_ATTEMPTS - 2
        )
        del tried  # its compiled graphs hold memory the next attempt's measurement would count
    return None, attempts.refusal(f"after {COMPILE_ATTEMPTS} plans, the eager floor's the last")


def _structural(attempts: _CompiledAttempts) -> _Compiled | None:
    """The first structural plan whose compiled step keeps the budget, None when none does (or the graph has no
    repeated blocks)."""
    for strategy in STRUCTURAL_PLANS:
        plan = attempts.planner.structural_plan(strategy)
        if plan is None:
            continue
        tried = attempts.compiled(attempts.planner.apply(plan), f"structural plan {strategy}", plan.predicted_peak_bytes)
        if tried.peak_bytes <= attempts.budget_bytes:
            return tried
        del tried
    return None
