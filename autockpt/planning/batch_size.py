"""The largest batch whose optimized training step, measured, stays under a memory budget.

    result = autockpt.max_batch_size(lambda: MyModel(), lambda n: ExampleBatch(args=(torch.randn(n, 512),)),
                                     budget_gb=2.0)
    result.batch_size, result.plan, result.measured_peak_bytes

The search doubles the batch until it no longer fits, then bisects, assuming that a batch that does not fit is not
followed by a larger one that does (the peak grows with the batch). How a batch is judged (``trace=``):

* ``"fake"`` (and ``"auto"``, the default): each batch tried is traced on fake tensors (``FakeTrace``: the step's
  exact memory, no real step) and fits when the strategy's plan is *predicted* at most the budget; only the answer
  is then measured for real (``autockpt.measure_step``; for autockpt the optimized module, verified as ``optimize``
  does), and when it measures over the budget the next smaller predicted fit is measured, and so on. A model on the
  meta device cannot be measured: the answer stays a prediction, and the result says so. "auto" measures every
  batch instead when the fake trace cannot run the step (tensor values in its Python control flow).
* ``"measured"``: every batch tried is captured, profiled, planned, applied and measured for real; it fits only when
  the measured peak is at most the budget.

``BatchTrial.measured`` says which trials were measured; ``BatchSizeResult.note`` says how the answer was found.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn

from autockpt.core.solve.baselines import parse_strategy
from autockpt.errors import FakeStepError, InfeasibleBudgetError
from autockpt.measure.step import measure_step
from autockpt.planning.build import model_on_meta
from autockpt.planning.options import TRACES, PlanOptions, budget_to_bytes, resolve_options
from autockpt.planning.planner import Planner, baseline_plan
from autockpt.records.plan import Plan
from autockpt.types import describe_value

logger = logging.getLogger(__name__)

AUTOCKPT = "autockpt"


@dataclass(frozen=True, kw_only=True, slots=True)
class ExampleBatch:
    """What ``input_factory(batch_size)`` returns: the model's positional and keyword inputs, and the loss."""

    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    loss_fn: Callable[[Any], torch.Tensor] | None = None  # None: autockpt.measure.loss.default_loss


class TrialOutcome(str, Enum):
    FITS = "fits"  # measured peak at most the budget
    OVER_BUDGET = "over_budget"  # the plan ran but measured above the budget
    INFEASIBLE = "infeasible"  # no plan was found (InfeasibleBudgetError), or static memory alone is over
    FAILED = "failed"  # the step could not run (e.g. out of memory); ``detail`` says why


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchTrial:
    batch_size: int
    strategy: str
    outcome: TrialOutcome
    measured_peak_bytes: int | None  # the measured peak, or the predicted one when ``measured`` is False
    seconds: float
    detail: str = ""
    measured: bool = True  # False: judged by the fake trace's prediction (``measured_peak_bytes`` is predicted)


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSizeResult:
    """The largest batch found to fit (0: not even ``start``), its plan and measured peak, and every trial."""

    strategy: str
    budget_bytes: int
    batch_size: int
    plan: Plan | None  # the plan at ``batch_size`` (None when nothing fits)
    measured_peak_bytes: int | None
    first_over_batch: int | None  # smallest batch tried that did not fit (None: the search hit ``limit``)
    trials: tuple[BatchTrial, ...]
    note: str = ""  # how the answer was found: searched on predictions and measured, or every batch measured

    @property
    def exact(self) -> bool:
        """True when the next batch up was tried and did not fit (the answer is the true maximum)."""
        return self.first_over_batch is not None and self.first_over_batch == self.batch_size + 1


def max_batch_size(
    model_factory: Callable[[], nn.Module],
    input_factory: Callable[[int], ExampleBatch | tuple],
    *,
    budget_gb: float | None = None,
    budget_bytes: int | None = None,
    strategy: str = AUTOCKPT,
    start: int = 1,
    limit: int = 1 << 16,
    precision: int = 1,
    options: PlanOptions | None = None,
    **option_keywords: Any,
) -> BatchSizeResult:
    """The largest batch size whose step under ``strategy`` measures at most the budget (GB = 10^9 bytes).

    ``strategy`` is "autockpt" (``Planner.optimize``: plan, rewrite, measure, tighten) or a baseline policy name
    (``autockpt.core.solve.baselines``: "none", "every_1", "sqrt_n", ...), whose plan is applied and measured.
    ``model_factory()`` is called once; ``input_factory(n)`` returns an ``ExampleBatch`` (or a tuple of positional
    inputs) of batch size ``n``. The search stops when the largest fitting and the smallest non-fitting batch are at
    most ``precision`` apart (1: exact). Options: ``PlanOptions``, or its fields as keyword arguments; ``trace``:
    "auto" / "fake" search on fake traces and measure only the answer, "measured" measures every batch tried (module
    docstring). ``strict``, ``compiled`` and ``target`` are refused (every answer is measured here, eagerly).
    """
    return max_batch_sizes(
        model_factory, input_factory, budget_gb=budget_gb, budget_bytes=budget_bytes, strategies=(strategy,),
        start=start, limit=limit, precision=precision, options=options, **option_keywords,
    )[strategy]


def max_batch_sizes(
    model_factory: Callable[[], nn.Module],
    input_factory: Callable[[int], ExampleBatch | tuple],
    *,
    budget_gb: float | None = None,
    budget_bytes: int | None = None,
    strategies: Iterable[str] = (AUTOCKPT,),
    start: int = 1,
    limit: int = 1 << 16,
    precision: int = 1,
    on_trial: Callable[[BatchTrial], None] | None = None,
    options: PlanOptions | None = None,
    **option_keywords: Any,
) -> dict[str, BatchSizeResult]:
    """``max_batch_size`` for several strategies, sharing one capture and profile per batch size tried."""
    options = resolve_options(
        options, option_keywords, entry_point="autockpt.max_batch_size", refused=("strict", "compiled", "target")
    )
    budget = budget_to_bytes(budget_gb, budget_bytes)
    if not isinstance(options.trace, str):
        raise TypeError(
            f"max_batch_size switches between the fake and the measured trace: give trace as one of {', '.join(TRACES)}"
            f", not {type(options.trace).__name__}"
        )
    strategies = tuple(strategies)
    if not strategies:
        raise ValueError("give at least one strategy, e.g. strategies=('autockpt', 'every_1')")
    for name in strategies:
        if name != AUTOCKPT:
            parse_strategy(name)  # raises with the list of known strategies
    for name, value in (("start", start), ("limit", limit), ("precision", precision)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {describe_value(value)}")
    if start > limit:
        raise ValueError(f"start ({start}) is larger than limit ({limit})")
    model = model_factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_factory() must return an nn.Module, got {type(model).__name__}")
    searcher = _Searcher(model, input_factory, budget, options, on_trial)
    return {name: searcher.search(name, start, limit, precision) for name in strategies}


class _Searcher:
    """Runs trials, keeping one Planner per batch size for all strategies."""

    def __init__(
        self,
        model: nn.Module,
        input_factory: Callable[[int], ExampleBatch | tuple],
        budget: int,
        options: PlanOptions,
        on_trial: Callable[[BatchTrial], None] | None,
    ) -> None:
        self.trace = options.trace  # "measured": every trial measured; "fake"/"auto": predicted, the answer measured
        self.model = model
        self.input_factory = input_factory
        self.budget = budget
        self.options = options
        self.on_trial = on_trial or (lambda trial: None)
        self.planners: dict[int, tuple[Planner | None, ExampleBatch, str]] = {}

    @property
    def predicts(self) -> bool:
        """Whether trials are judged by the fake trace's prediction (the answer measured afterwards)."""
        return self.trace != "measured"

    def search(self, strategy: str, start: int, limit: int, precision: int) -> BatchSizeResult:
        trials: list[BatchTrial] = []
        best: tuple[int, Plan | None, int | None] = (0, None, None)
        low, high = 0, None  # largest fitting, smallest not fitting
        size = start
        while size <= limit:  # doubling
            trial, the_plan = self.trial(size, strategy)
            trials.append(trial)
            if trial.outcome is not TrialOutcome.FITS:
                high = size
                break
            low, best = size, (size, the_plan, trial.measured_peak_bytes)
            if size == limit:
                break
            size = min(size * 2, limit)
        while low > 0 and high is not None and high - low > precision:
            middle = (low + high) // 2
            trial, the_plan = self.trial(middle, strategy)
            trials.append(trial)
            if trial.outcome is TrialOutcome.FITS:
                low, best = middle, (middle, the_plan, trial.measured_peak_bytes)
            else:
                high = middle
        if self.predicts and low > 0:
            return self._measured_answer(strategy, trials, high)
        note = "every batch tried was measured" if low > 0 else f"not even batch {start} fits"
        return BatchSizeResult(
            strategy=strategy, budget_bytes=self.budget, batch_size=best[0], plan=best[1],
            measured_peak_bytes=best[2], first_over_batch=high if low > 0 else start, trials=tuple(trials), note=note,
        )

    def trial(self, size: int, strategy: str) -> tuple[BatchTrial, Plan | None]:
        """One batch size judged: its plan predicted (``predicts``) or applied and measured."""
        started = time.perf_counter()
        planner, batch, error = self._planner(size)
        if planner is None:
            return self._record(size, strategy, TrialOutcome.FAILED, None, started, error), None
        if planner.trace.static_bytes > self.budget:
            detail = f"static bytes {planner.trace.static_bytes} alone are over the budget"
            return self._record(size, strategy, TrialOutcome.INFEASIBLE, None, started, detail), None
        if not self.predicts:
            return self._measured_trial(size, strategy, planner, batch, started)
        try:
            the_plan = planner.plan(budget_bytes=self.budget) if strategy == AUTOCKPT else baseline_plan(planner, strategy)
        except (InfeasibleBudgetError, ValueError) as refused:
            return self._record(size, strategy, TrialOutcome.INFEASIBLE, None, started, str(refused)[:200]), None
        peak = the_plan.predicted_peak_bytes
        outcome = TrialOutcome.FITS if peak <= self.budget else TrialOutcome.OVER_BUDGET
        return self._record(size, strategy, outcome, peak, started, "predicted", measured=False), the_plan

    def _measured_trial(
        self, size: int, strategy: str, planner: Planner, batch: ExampleBatch, started: float
    ) -> tuple[BatchTrial, Plan | None]:
        try:
            if strategy == AUTOCKPT:
                try:
                    module = planner.optimize(budget_bytes=self.budget)
                except InfeasibleBudgetError as infeasible:
                    return self._record(size, strategy, TrialOutcome.INFEASIBLE, None, started, str(infeasible)[:200]), None
                the_plan = module.plan
                peak = the_plan.measured_peak_bytes
                if peak is None:  # identity plan: optimize does not measure it
                    peak = measure_step(module, batch.args, dict(batch.kwargs), batch.loss_fn).peak_bytes
            else:
                try:
                    the_plan = baseline_plan(planner, strategy)
                except ValueError as unavailable:
                    return self._record(size, strategy, TrialOutcome.INFEASIBLE, None, started, str(unavailable)), None
                module = planner.apply(the_plan)
                peak = measure_step(module, batch.args, dict(batch.kwargs), batch.loss_fn).peak_bytes
        except (RuntimeError, MemoryError) as failure:  # out of memory and the like
            return self._record(size, strategy, TrialOutcome.FAILED, None, started, f"{type(failure).__name__}: {failure}"[:200]), None
        finally:
            for param in self.model.parameters():
                param.grad = None
        outcome = TrialOutcome.FITS if peak <= self.budget else TrialOutcome.OVER_BUDGET
        return self._record(size, strategy, outcome, peak, started, ""), the_plan

    def _measured_answer(self, strategy: str, trials: list[BatchTrial], high: int | None) -> BatchSizeResult:
        """Measure the largest predicted fit; while it measures over the budget, the next smaller predicted fit."""
        predicted = sorted({t.batch_size for t in trials if t.outcome is TrialOutcome.FITS}, reverse=True)
        searched = f"searched on fake traces ({len(trials)} batches predicted, none run)"
        first_over = high
        if model_on_meta(self.model):
            size = predicted[0]
            fit = next(t for t in trials if t.batch_size == size and t.outcome is TrialOutcome.FITS)
            planner = self._planner(size)[0]
            the_plan = planner.plan(budget_bytes=self.budget) if strategy == AUTOCKPT else baseline_plan(planner, strategy)
            return BatchSizeResult(
                strategy=strategy, budget_bytes=self.budget, batch_size=size, plan=the_plan, measured_peak_bytes=None,
                first_over_batch=first_over, trials=tuple(trials),
                note=f"{searched}; the model is on the meta device, so the answer ({fit.measured_peak_bytes:,} B "
                "predicted) was not measured",
            )
        for size in predicted:
            started = time.perf_counter()
            planner, batch, _ = self._planner(size)
            assert planner is not None  # it was planned as a fit
            trial, the_plan = self._measured_trial(size, strategy, planner, batch, started)
            trials.append(trial)
            if trial.outcome is TrialOutcome.FITS:
                return BatchSizeResult(
                    strategy=strategy, budget_bytes=self.budget, batch_size=size, plan=the_plan,
                    measured_peak_bytes=trial.measured_peak_bytes, first_over_batch=first_over, trials=tuple(trials),
                    note=f"{searched}; the answer measured ({trial.measured_peak_bytes:,} B)",
                )
            first_over = size
        return BatchSizeResult(
            strategy=strategy, budget_bytes=self.budget, batch_size=0, plan=None, measured_peak_bytes=None,
            first_over_batch=first_over, trials=tuple(trials),
            note=f"{searched}; every predicted fit measured over the budget",
        )

    def _planner(self, size: int) -> tuple[Planner | None, ExampleBatch, str]:
        if size not in self.planners:
            batch = _as_batch(self.input_factory(size), size)
            try:
                planner = self._make_planner(batch)
                self.planners[size] = (planner, batch, "")
            except FakeStepError:
                raise  # the step cannot run on fakes (trace="fake", or a meta model): no batch can be judged
            except (RuntimeError, MemoryError) as failure:
                self.planners[size] = (None, batch, f"capture/profile failed: {type(failure).__name__}: {failure}"[:200])
            # keep memory bounded: planners of sizes far from the frontier are not needed again
            if len(self.planners) > 6:
                oldest = next(iter(self.planners))
                if oldest != size:
                    del self.planners[oldest]
        return self.planners[size]

    def _make_planner(self, batch: ExampleBatch) -> Planner:
        def make(trace: str) -> Planner:
            return Planner.from_model(
                self.model, example_inputs=batch.args, example_kwargs=dict(batch.kwargs), loss_fn=batch.loss_fn,
                options=dataclasses.replace(self.options, trace=trace),
            )

        if not self.predicts:
            return make("measured")
        try:
            return make("fake")
        except FakeStepError as error:
            if self.trace == "fake" or model_on_meta(self.model):
                raise
            logger.info("max_batch_size: the fake trace cannot run the step (%s); measuring every batch", error.op)
            self.trace = "measured"
            self.planners.clear()
            return make("measured")

    def _record(
        self, size: int, strategy: str, outcome: TrialOutcome, peak: int | None, started: float, detail: str,
        *, measured: bool = True,
    ) -> BatchTrial:
        trial = BatchTrial(
            batch_size=size, strategy=strategy, outcome=outcome, measured_peak_bytes=peak,
            seconds=time.perf_counter() - started, detail=detail, measured=measured,
        )
        logger.info("batch %d, %s: %s (peak %s bytes, budget %d)", size, strategy, outcome.value, peak, self.budget)
        self.on_trial(trial)
        return trial


def _as_batch(value: ExampleBatch | tuple, size: int) -> ExampleBatch:
    if isinstance(value, ExampleBatch):
        return value
    if isinstance(value, torch.Tensor):
        return ExampleBatch(args=(value,))
    if isinstance(value, tuple):
        return ExampleBatch(args=value)
    raise TypeError(
        f"input_factory({size}) must return an autockpt.planning.batch_size.ExampleBatch(args=..., kwargs=..., loss_fn=...) or a tuple of "
        f"positional inputs, got {type(value).__name__}"
    )

