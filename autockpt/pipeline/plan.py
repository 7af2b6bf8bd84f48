"""Pipeline plans: split a model into stages across devices and choose each stage's recompute, in one process.

    pplan = autockpt.plan_pipeline(model, num_stages=2, budget_gb=20, microbatches=4, schedule="1F1B",
                                   example_inputs=(ids,), example_target=labels, loss_fn=loss_fn)

The whole batch is split into microbatches (``torch.distributed.pipelining.microbatch``) and the model captured on
one microbatch. Candidate cuts are the unit boundaries between the model's blocks (children of the root module and
of every ``ModuleList``/``Sequential``) where everything crossing is a tensor. For every run of units from one
candidate to another that a stage could hold, the single-device planner (``api.Planner``) measures that stage's own
step (its inputs are what crosses the cut before it, its backward is seeded with gradients for what it sends on, the
last stage's with the user's loss) and finds the fastest recompute plan under that device's budget with the
schedule's microbatches in flight (``types.PipelineSchedule.in_flight``) and the schedule's buffers. The split
program (``solve/split.py``) then picks the stages. ``pipeline_run.pipeline_schedule`` runs the plan on
``torch.distributed.pipelining``.

A model no device holds (built on the meta device, or predicted over the device memory) is planned on fake tensors:
``trace=``, ``timing=``, ``target=`` and ``device_memory_bytes=`` mean what they mean for ``Planner.from_model``
(``whole_step.py`` chooses for the whole step; the stage planners follow).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from autockpt.core.solve.base import SolverOptions
from autockpt.core.solve.split import Split, SplitProblem, StageOption, exhaustive_split, solve_split, step_ms
from autockpt.errors import CaptureError, InfeasibleBudgetError
from autockpt.measure.capture import capture
from autockpt.pipeline.last_stage import OUTPUTS_NOTE
from autockpt.pipeline.request import SPLIT_STRATEGIES, PipelineRequest, stage_budgets
from autockpt.pipeline.stage_graphs import (
    shared_parameters,
)
from autockpt.pipeline.stage_table import StageTable
from autockpt.pipeline.whole_step import WholeStep, check_trace
from autockpt.planning.options import PlanOptions, resolve_options
from autockpt.records.fingerprint import model_fingerprint
from autockpt.records.pipeline_plan import PipelinePlan
from autockpt.runtime.model_state import enter_training_modes, preserved_model_state
from autockpt.types import CaptureKind, PipelineSchedule, describe_value
from autockpt.units import format_bytes

logger = logging.getLogger(__name__)

# a split given by name instead of solved (the baselines of the benchmark)
# PlanOptions the pipeline planner does not plan yet: given, they are refused, never ignored
PIPELINE_REFUSED = ("optimizer", "host_pool_gb", "gradient_accumulation_steps", "strict", "compiled", "output_held")


def pipeline_options(options: PlanOptions | None, option_keywords: Mapping[str, Any]) -> PlanOptions:
    """The options of a pipeline plan: ``PlanOptions`` less what it refuses, its trace a name."""
    resolved = resolve_options(options, option_keywords, entry_point="plan_pipeline", refused=PIPELINE_REFUSED)
    check_trace(resolved.trace)
    return resolved


def plan_pipeline(
    model: nn.Module,
    num_stages: int = 2,
    budget_gb: float | Sequence[float] | None = None,
    *,
    budget_bytes: int | Sequence[int] | None = None,
    microbatches: int = 4,
    schedule: PipelineSchedule | str = PipelineSchedule.ONE_F_ONE_B,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    example_target: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    return_outputs: bool = True,
    split: str | Sequence[int] = "autockpt",
    max_cut_candidates: int = 16,
    link_gb_per_s: float | None = None,
    options: PlanOptions | None = None,
    **option_keywords: Any,
) -> PipelinePlan:
    """Split ``model`` into ``num_stages`` pipeline stages and plan each stage's recompute, so that every device
    keeps its budget (one for all, or a list with one per stage; GB = 10^9 bytes) under ``schedule`` with
    ``microbatches`` microbatches, at the least predicted step time.

    ``example_inputs``/``example_kwargs``/``example_target`` are the whole batch: tensors whose dim 0 is the batch
    are split into microbatches. ``loss_fn(output, target)`` is the loss of one microbatch, as
    ``torch.distributed.pipelining`` calls it (gradients are averaged over microbatches). ``split``: "autockpt"
    (the split program), "exhaustive" (every split over the candidate cuts), "even-layers", "parameter-balanced", or
    the units to cut after. ``max_cut_candidates``: block boundaries the program and the exhaustive search choose
    from (spread over the model; given and baseline cuts are added; at least ``num_stages - 1``).
    ``link_gb_per_s``: what sending activations between stages is priced at (default: the device's copy bandwidth; a
    target's is its memory bandwidth over two).
    Raises ``InfeasibleBudgetError`` with the smallest per-device budget that a split keeps when none keeps the given
    one.

    Options: ``options=PlanOptions(...)`` or its fields as keyword arguments. ``trace``, ``timing``, ``target``,
    ``device_memory_bytes``: as for ``Planner.from_model`` (``trace`` a name: a ``TraceSource`` is for one device).
    ``trace="auto"`` traces
    the whole step on fake tensors (no real step, no weights read; exact memory) when the model or its inputs are on
    the meta device (``with torch.device("meta"): model = ...``) or when the fake trace predicts the unmodified step
    above the device memory (given, the target's, or on CUDA what is free), and then traces every stage on fakes
    too; it measures on real values otherwise, as before. ``"fake"`` and ``"measured"`` choose (``"measured"`` on a
    meta model is a ``ValueError``). Unit times come from ``timing``: measured (the median of three real steps),
    roofline on a ``target`` such as "h100-sxm-80gb", or each op benchmarked alone on this machine for a fake trace
    without a target. The user's model is left as it was (a meta model stays on meta);
    the plan's notes say which trace and timing made it, and each stage plan's ``provenance`` too.

    The stages are planned with the options' checkpoint choice and solver options; an optimizer, host pool, gradient
    accumulation, loop, strict or compiled option is refused by name (``ValueError``): the pipeline planner does not
    plan them yet (``PIPELINE_REFUSED``).
    """
    (result,) = compare_pipeline_splits(
        model, num_stages, budget_gb, splits=(split,), budget_bytes=budget_bytes, microbatches=microbatches,
        schedule=schedule, example_inputs=example_inputs, example_kwargs=example_kwargs, example_target=example_target,
        loss_fn=loss_fn, return_outputs=return_outputs, max_cut_candidates=max_cut_candidates,
        link_gb_per_s=link_gb_per_s, options=options, **option_keywords,
    ).values()
    if isinstance(result, InfeasibleBudgetError):
        raise result
    return result


def compare_pipeline_splits(
    model: nn.Module,
    num_stages: int = 2,
    budget_gb: float | Sequence[float] | None = None,
    *,
    splits: Sequence[str | Sequence[int]] = SPLIT_STRATEGIES,
    budget_bytes: int | Sequence[int] | None = None,
    microbatches: int = 4,
    schedule: PipelineSchedule | str = PipelineSchedule.ONE_F_ONE_B,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    example_target: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    return_outputs: bool = True,
    max_cut_candidates: int = 16,
    link_gb_per_s: float | None = None,
    options: PlanOptions | None = None,
    **option_keywords: Any,
) -> dict[str, PipelinePlan | InfeasibleBudgetError]:
    """``plan_pipeline`` for several splits on one profile of the step (one capture, one timing, one planner per
    candidate stage), so that their predictions share one cost model: by split name ("autockpt", "exhaustive",
    "even-layers", "parameter-balanced", or the cuts written as "after 12, 40"), the plan or the
    ``InfeasibleBudgetError`` that says the smallest budget that split keeps. ``plan_time_s`` of each plan counts
    from the start of this call."""
    common = {
        "microbatches": microbatches, "schedule": schedule, "example_inputs": example_inputs,
        "example_kwargs": example_kwargs, "example_target": example_target, "loss_fn": loss_fn,
        "return_outputs": return_outputs,
    }
    resolved = pipeline_options(options, option_keywords)  # refused before the budget is read
    PipelineRequest.check(model, num_stages, budget_gb, budget_bytes, splits=splits, **common)  # before capture
    planner = PipelinePlanner.from_model(
        model, num_stages, splits=splits, max_cut_candidates=max_cut_candidates, link_gb_per_s=link_gb_per_s,
        options=resolved, **common,
    )
    return planner.compare(budget_gb, budget_bytes=budget_bytes)


class PipelinePlanner:
    """One model's pipeline step captured and profiled once, with a single-device planner per candidate stage
    (``from_model``); ``compare`` and ``plan`` answer any number of budgets from it, each stage planner's floor
    found once (``compare_pipeline_splits`` is ``PipelinePlanner.from_model(...).compare(budget)``)."""

    def __init__(self, table: StageTable, graph: Any, whole: WholeStep, link_gb_per_s: float,
                 fingerprint: Any, setup_s: float) -> None:
        self.table, self.graph, self.whole, self.link_gb_per_s = table, graph, whole, link_gb_per_s
        self.fingerprint, self.setup_s = fingerprint, setup_s

    @classmethod
    def from_model(
        cls, model: nn.Module, num_stages: int = 2, *, microbatches: int = 4,
        schedule: PipelineSchedule | str = PipelineSchedule.ONE_F_ONE_B, example_inputs: Any = (),
        example_kwargs: Mapping[str, Any] | None = None, example_target: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, return_outputs: bool = True,
        splits: Sequence[str | Sequence[int]] = ("autockpt",), max_cut_candidates: int = 16,
        link_gb_per_s: float | None = None, options: PlanOptions | None = None, **option_keywords: Any,
    ) -> PipelinePlanner:
        """Capture, profile and tabulate the step for ``splits`` (the arguments are ``plan_pipeline``'s, checked
        here; no budget yet)."""
        started = time.perf_counter()
        options = pipeline_options(options, option_keywords)
        request = PipelineRequest.check(
            model, num_stages, None, 1, microbatches, schedule, example_inputs, example_kwargs, example_target,
            loss_fn, splits, return_outputs,
        )  # a budget of 1 B until ``compare`` gives one
        _check_max_cut_candidates(max_cut_candidates, request.num_stages)
        with preserved_model_state(model, request.microbatch_args, request.microbatch_kwargs):
            enter_training_modes(model)
            graph = capture(model, request.microbatch_args, request.microbatch_kwargs)
            if graph.kind not in (CaptureKind.FX, CaptureKind.EXPORT):
                raise CaptureError(
                    f"{type(model).__name__} could only be captured module by module ({'; '.join(graph.notes)}); a "
                    "pipeline split needs the whole forward as one graph (torch.fx or torch.export)"
                )
            whole = WholeStep.profile(
                request, graph, trace=options.trace, timing=options.timing, target=options.target,
                device_memory_bytes=options.device_memory_bytes,
            )
            table = StageTable(request, graph, max_cut_candidates, options, whole)
            link = link_gb_per_s if link_gb_per_s is not None else whole.link_gb_per_s()
            fingerprint = model_fingerprint(model, graph, request.microbatch_args, request.microbatch_kwargs)
        return cls(table, graph, whole, link, fingerprint, time.perf_counter() - started)

    def plan(self, budget_gb: float | Sequence[float] | None = None, *,
             budget_bytes: int | Sequence[int] | None = None) -> PipelinePlan:
        """The first split's plan (``from_model``'s ``splits``) at this budget, one for all devices or one per stage
        (GB = 10^9 bytes); ``InfeasibleBudgetError`` with the smallest budget a split keeps when none keeps it.
        The other splits are not planned."""
        (result,) = self._answers(budget_gb, budget_bytes, self.table.request.splits[:1]).values()
        if isinstance(result, InfeasibleBudgetError):
            raise result
        return result

    def compare(self, budget_gb: float | Sequence[float] | None = None, *,
                budget_bytes: int | Sequence[int] | None = None) -> dict[str, PipelinePlan | InfeasibleBudgetError]:
        """Every split's plan (or refusal) at this budget, by split name; ``plan_time_s``: the setup and this call."""
        return self._answers(budget_gb, budget_bytes, self.table.request.splits)

    def _answers(self, budget_gb: Any, budget_bytes: Any,
                 splits: Sequence[str | tuple[int, ...]]) -> dict[str, PipelinePlan | InfeasibleBudgetError]:
        started = time.perf_counter()
        table = self.table.with_budgets(stage_budgets(budget_gb, budget_bytes, self.table.request.num_stages))
        request, graph, link = table.request, self.graph, self.link_gb_per_s
        results: dict[str, PipelinePlan | InfeasibleBudgetError] = {}
        with preserved_model_state(request.model, request.microbatch_args, request.microbatch_kwargs):
            enter_training_modes(request.model)
            for split in splits:
                chosen = _choose_split(table, split, link, table.solver_options)
                if chosen is None:
                    results[split_name(split)] = _infeasible(table, request, link, split)
                    continue
                graphs = [table.graph_of(o.first_unit, o.last_unit, index=o.stage) for o in chosen.options]
                stage_plans = tuple(table.entry(option).plan for option in chosen.options)
                records = tuple(table.record(option) for option in chosen.options)
                with_loss = (OUTPUTS_NOTE,) if records[-1].with_loss else ()
                results[split_name(split)] = PipelinePlan(
                    num_stages=request.num_stages, microbatches=request.microbatches, schedule=request.schedule,
                    return_outputs=request.return_outputs, cuts=chosen.cuts,
                    stages=records, stage_plans=stage_plans,
                    shared_parameters=shared_parameters(graphs), predicted_step_ms=chosen.predicted_step_ms,
                    link_gb_per_s=link, strategy=split if isinstance(split, str) else "given",
                    capture=graph.kind, fingerprint=self.fingerprint, candidate_cuts=table.candidates,
                    plan_time_s=self.setup_s + time.perf_counter() - started, notes=(*graph.notes, *self.whole.notes, *with_loss),
                    provenance=stage_plans[0].provenance,
                )
        return results


def split_name(split: str | tuple[int, ...]) -> str:
    return split if isinstance(split, str) else "after " + ", ".join(map(str, split))


# ------------------------------------------------------------------------------------------------ the request


# ------------------------------------------------------------------------------------------------ the table


# ------------------------------------------------------------------------------------------------ choosing


def _choose_split(
    table: StageTable, split: str | tuple[int, ...], link: float, options: SolverOptions | None
) -> Split | None:
    if split == "autockpt":
        return solve_split(table.problem(link), options)
    if split == "exhaustive":
        return exhaustive_split(table.problem(link))
    cuts = table.given_cuts[split]  # among the candidates: each of its stages is offered unless no plan keeps it
    problem = table.problem(link, cuts)
    bounds = [-1, *cuts, table.num_units - 1]
    chosen = []
    for stage in range(table.request.num_stages):
        first, last = bounds[stage] + 1, bounds[stage + 1]
        match = [o for o in problem.options if (o.stage, o.first_unit, o.last_unit) == (stage, first, last)]
        if not match:
            return None
        chosen.append(match[0])
    return Split(cuts=tuple(cuts), options=tuple(chosen), predicted_step_ms=step_ms(problem, chosen))


def _infeasible(
    table: StageTable, request: PipelineRequest, link: float, split: str | tuple[int, ...]
) -> InfeasibleBudgetError:
    """No split keeps every budget: the smallest uniform per-device budget a split keeps. Each stage position's
    floor is its plan's smallest one-microbatch peak plus its buffers plus the other microbatches in flight at what
    the unmodified stage keeps (``StageTable._solve``'s first try, so a budget at the floor finds that plan); the
    answer is the least over splits of the largest floor, checked by solving the table at that budget."""
    floors = {}
    given = table.given_cuts.get(split)
    if given is not None:  # a given split: its own stages' floors
        bounds = [-1, *given, table.num_units - 1]
        runs = [((bounds[k] + 1, bounds[k + 1]), k) for k in range(request.num_stages)]
    else:
        runs = list(itertools.product(table.runs(), range(request.num_stages)))
    for (first, last), stage in runs:
        if table.can_hold(stage, first, last) and (floor := table.floor_at(stage, first, last)) is not None:
            floors[(stage, first, last)] = floor
    problem = SplitProblem(
        num_units=table.num_units, num_stages=request.num_stages, microbatches=request.microbatches,
        # the "time" of an option is its floor: the split minimising the largest floor, by the same enumerator
        options=tuple(StageOption(stage=s, first_unit=f, last_unit=l, microbatch_ms=float(b)) for (s, f, l), b in floors.items()),
        transfer_ms=dict.fromkeys(range(table.num_units), 0.0),
    )
    best = exhaustive_split(problem)
    smallest = int(max(o.microbatch_ms for o in best.options)) if best is not None else None
    for _ in range(8):  # the floor is checked by planning at it; rounding in the solver may need a little more
        if smallest is None or _some_split_keeps(table, smallest, link, split):
            break
        smallest = int(smallest * 1.01) + 1
    budgets = ", ".join(format_bytes(b) for b in sorted(set(request.budgets_bytes)))
    if smallest is None:
        return InfeasibleBudgetError(
            f"no split of {type(request.model).__name__} into {request.num_stages} stages keeps {budgets} per device",
            min_feasible_bytes=0, budget_bytes=min(request.budgets_bytes),
        )
    return InfeasibleBudgetError(
        f"no split of {type(request.model).__name__} into {request.num_stages} stages with {request.microbatches} "
        f"microbatches ({request.schedule.value}; split: {split_name(split)}) keeps {budgets} per device; the smallest "
        f"budget {'a split' if given is None else 'this split'} keeps on every device is {format_bytes(smallest)} ({smallest} bytes). Give that budget, more stages, or more, "
        "smaller microbatches",
        min_feasible_bytes=smallest, budget_bytes=min(request.budgets_bytes),
    )


def _some_split_keeps(table: StageTable, budget: int, link: float, split: str | tuple[int, ...]) -> bool:
    trial = table.at_budget(budget)
    return _choose_split(trial, split, link, trial.solver_options) is not None


def _check_max_cut_candidates(max_cut_candidates: Any, num_stages: int) -> None:
    """The split chooses ``num_stages - 1`` cuts among the candidates: fewer candidates leave it nothing to choose."""
    cuts = num_stages - 1  # num_stages >= 2: PipelineRequest.check
    if isinstance(max_cut_candidates, bool) or not isinstance(max_cut_candidates, int) or max_cut_candidates < cuts:
        raise ValueError(
            f"max_cut_candidates must be an integer >= {cuts} ({num_stages} stages are cut at {cuts} of the "
            f"candidate block boundaries), got {describe_value(max_cut_candidates)}; the default is 16"
        )
