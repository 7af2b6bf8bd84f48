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
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.utils import _pytree as pytree

from autockpt.records import plan_io
from autockpt.planning.options import UNSET, PlanOptions, resolve_options, unsupported
from autockpt.planning.planner import Planner, budget_to_bytes
from autockpt.measure.capture import capture
from autockpt.errors import CaptureError, InfeasibleBudgetError
from autockpt.measure.loss import checked_loss
from autockpt.runtime.model_state import enter_training_modes, preserved_model_state
from autockpt.records.plan import Plan, presentation_writer
from autockpt.core.simulate import memory_curve
from autockpt.core.solve.base import SolverOptions
from autockpt.core.solve.split import Split, SplitProblem, StageOption, exhaustive_split, solve_split, step_ms
from autockpt.pipeline.stage_graphs import (
    StageGraph,
    crossing,
    crossing_tensors,
    cut_problem,
    graph_values,
    shared_parameters,
    stage_graph,
)
from autockpt.measure.trace import trace_step, unique_storage_bytes
from autockpt.record_types import ModelFingerprint, PipelineStageRecord, SharedParameter
from autockpt.types import (
    CaptureKind,
    Graph,
    Phase,
    PipelineSchedule,
    RegionAction,
)
from autockpt.units import format_bytes

logger = logging.getLogger(__name__)

# a split given by name instead of solved (the baselines of the benchmark)
SPLIT_STRATEGIES = ("autockpt", "exhaustive", "even-layers", "parameter-balanced")
# PlanOptions the pipeline planner does not plan yet: given, they are refused, never ignored
PIPELINE_UNSUPPORTED_OPTIONS = ("optimizer", "host_pool_gb", "gradient_accumulation_steps", "strict", "compiled")


@dataclass(frozen=True, kw_only=True, slots=True, repr=False)
class PipelinePlan:
    """What ``plan_pipeline`` decided: the cuts, and per stage its units, modules, plan and predictions."""

    num_stages: int
    microbatches: int
    schedule: PipelineSchedule
    return_outputs: bool
    cuts: tuple[int, ...]  # the step is cut after these units
    stages: tuple[PipelineStageRecord, ...]
    stage_plans: tuple[Plan, ...]  # each stage's recompute plan, over the stage's own units
    shared_parameters: tuple[SharedParameter, ...]
    predicted_step_ms: float  # the schedule's: (microbatches + stages - 1) x slowest stage + transfers
    link_gb_per_s: float  # what sending activations between stages was priced at (GB = 10^9 bytes)
    strategy: str  # "autockpt" (the split program), or the baseline split it was given
    capture: CaptureKind
    fingerprint: ModelFingerprint  # the whole model on one microbatch
    candidate_cuts: tuple[int, ...] = ()
    plan_time_s: float = 0.0
    notes: tuple[str, ...] = ()

    def summary(self) -> str:
        lines = [
            f"pipeline plan ({self.strategy}): {self.num_stages} stages, {self.microbatches} microbatches, "
            f"schedule {self.schedule.value}; predicted step {self.predicted_step_ms:.2f} ms "
            f"(link priced at {self.link_gb_per_s:.1f} GB/s)"
        ]
        for stage, the_plan in zip(self.stages, self.stage_plans):
            modules = ", ".join(stage.module_paths[:4]) + (" ..." if len(stage.module_paths) > 4 else "")
            lines.append(
                f"  stage {stage.index}: units {stage.first_unit}-{stage.last_unit} ({modules}); parameters "
                f"{format_bytes(stage.parameter_bytes)}; budget {format_bytes(stage.budget_bytes)}; predicted peak "
                f"{format_bytes(stage.predicted_peak_bytes)} ({stage.microbatches_in_flight} microbatches in flight x "
                f"{format_bytes(stage.retained_bytes)} kept for backward, schedule buffers "
                f"{format_bytes(stage.schedule_buffer_bytes)}); {len(the_plan.regions)} regions recomputed; "
                f"{stage.predicted_microbatch_ms:.2f} ms per microbatch"
            )
        for shared in self.shared_parameters:
            lines.append(
                f"  parameter {shared.name} ({format_bytes(shared.nbytes)}) is held by stages "
                f"{', '.join(map(str, shared.stages))}: its gradients are summed across them after each step"
            )
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON (no pickle); ``autockpt.load_pipeline_plan`` reads it back."""
        plan_io.save_plan(self, path, schema=PIPELINE_SCHEMA)

    def report(self, path: str | os.PathLike[str]) -> None:
        """Write a self-contained report: HTML when ``path`` ends in .html/.htm (one memory timeline per stage and
        the schedule's chart), markdown otherwise."""
        presentation_writer("autockpt.present.pipeline_report:write_pipeline_report")(self, path)

    def __repr__(self) -> str:
        return (
            f"PipelinePlan(strategy={self.strategy!r}, cuts={self.cuts}, schedule={self.schedule.value}, "
            f"predicted_step_ms={self.predicted_step_ms:.2f}, predicted_peaks="
            f"{[s.predicted_peak_bytes for s in self.stages]})"
        )


PIPELINE_SCHEMA = "autockpt.pipeline_plan"


def load_pipeline_plan(path: str | os.PathLike[str]) -> PipelinePlan:
    """Read a plan written by ``PipelinePlan.save``."""
    return plan_io.read_plan(path, PipelinePlan, schema=PIPELINE_SCHEMA)


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
    solver_options: Any = UNSET,
    checkpoint: Any = UNSET,
) -> PipelinePlan:
    """Split ``model`` into ``num_stages`` pipeline stages and plan each stage's recompute, so that every device
    keeps its budget (one for all, or a list with one per stage; GB = 10^9 bytes) under ``schedule`` with
    ``microbatches`` microbatches, at the least predicted step time.

    ``example_inputs``/``example_kwargs``/``example_target`` are the whole batch: tensors whose dim 0 is the batch
    are split into microbatches. ``loss_fn(output, target)`` is the loss of one microbatch, as
    ``torch.distributed.pipelining`` calls it (gradients are averaged over microbatches). ``split``: "autockpt"
    (the split program), "exhaustive" (every split over the candidate cuts), "even-layers", "parameter-balanced", or
    the units to cut after. ``max_cut_candidates``: block boundaries the program and the exhaustive search choose
    from (spread over the model; given and baseline cuts are added). ``link_gb_per_s``: what sending activations
    between stages is priced at (default: the device's copy bandwidth). Raises ``InfeasibleBudgetError`` with the
    smallest per-device budget that a split keeps when none keeps the given one.

    ``options`` (``PlanOptions``; or its keyword spelling ``solver_options=``, ``checkpoint=``): the stages are
    planned with its checkpoint choice and solver options; an optimizer, host pool, gradient accumulation, strict or
    compiled option is refused (``ValueError``): the pipeline planner does not plan them yet.
    """
    (result,) = compare_pipeline_splits(
        model, num_stages, budget_gb, splits=(split,), budget_bytes=budget_bytes, microbatches=microbatches,
        schedule=schedule, example_inputs=example_inputs, example_kwargs=example_kwargs, example_target=example_target,
        loss_fn=loss_fn, return_outputs=return_outputs, max_cut_candidates=max_cut_candidates,
        link_gb_per_s=link_gb_per_s, options=options, solver_options=solver_options, checkpoint=checkpoint,
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
    solver_options: Any = UNSET,
    checkpoint: Any = UNSET,
) -> dict[str, PipelinePlan | InfeasibleBudgetError]:
    """``plan_pipeline`` for several splits on one profile of the step (one capture, one timing, one planner per
    candidate stage), so that their predictions share one cost model: by split name ("autockpt", "exhaustive",
    "even-layers", "parameter-balanced", or the cuts written as "after 12, 40"), the plan or the
    ``InfeasibleBudgetError`` that says the smallest budget that split keeps. ``plan_time_s`` of each plan counts
    from the start of this call."""
    started = time.perf_counter()
    options = resolve_options(options, solver_options=solver_options, checkpoint=checkpoint)
    unsupported(options, "plan_pipeline", PIPELINE_UNSUPPORTED_OPTIONS)
    request = _PipelineRequest.check(
        model, num_stages, budget_gb, budget_bytes, microbatches, schedule, example_inputs, example_kwargs,
        example_target, loss_fn, splits, return_outputs,
    )
    results: dict[str, PipelinePlan | InfeasibleBudgetError] = {}
    with preserved_model_state(model, request.microbatch_args, request.microbatch_kwargs):
        enter_training_modes(model)
        graph = capture(model, request.microbatch_args, request.microbatch_kwargs)
        if graph.kind not in (CaptureKind.FX, CaptureKind.EXPORT):
            raise CaptureError(
                f"{type(model).__name__} could only be captured module by module ({'; '.join(graph.notes)}); a "
                "pipeline split needs the whole forward as one graph (torch.fx or torch.export)"
            )
        table = _StageTable(request, graph, max_cut_candidates, options)
        link = link_gb_per_s if link_gb_per_s is not None else _device_copy_gb_per_s(model)
        fingerprint = plan_io.model_fingerprint(model, graph, request.microbatch_args, request.microbatch_kwargs)
        for split in request.splits:
            chosen = _choose_split(table, split, link, options.solver)
            if chosen is None:
                results[split_name(split)] = _infeasible(table, request, link, split)
                continue
            graphs = [table.graph_of(o.first_unit, o.last_unit, index=o.stage) for o in chosen.options]
            results[split_name(split)] = PipelinePlan(
                num_stages=request.num_stages, microbatches=request.microbatches, schedule=request.schedule,
                return_outputs=request.return_outputs, cuts=chosen.cuts,
                stages=tuple(table.record(option) for option in chosen.options),
                stage_plans=tuple(table.entry(option).plan for option in chosen.options),
                shared_parameters=shared_parameters(graphs), predicted_step_ms=chosen.predicted_step_ms,
                link_gb_per_s=link, strategy=split if isinstance(split, str) else "given",
                capture=graph.kind, fingerprint=fingerprint, candidate_cuts=table.candidates,
                plan_time_s=time.perf_counter() - started, notes=graph.notes,
            )
    return results


def split_name(split: str | tuple[int, ...]) -> str:
    return split if isinstance(split, str) else "after " + ", ".join(map(str, split))


# ------------------------------------------------------------------------------------------------ the request


@dataclass(frozen=True, kw_only=True, slots=True)
class _PipelineRequest:
    model: nn.Module
    num_stages: int
    budgets_bytes: tuple[int, ...]  # one per stage
    microbatches: int
    schedule: PipelineSchedule
    microbatch_args: tuple  # the first microbatch: what is captured and measured
    microbatch_kwargs: dict
    microbatch_target: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]
    splits: tuple[str | tuple[int, ...], ...]
    return_outputs: bool
    batch_input_bytes: int  # the whole batch's tensors (stage 0 holds them) and target (the last stage)
    batch_target_bytes: int

    @staticmethod
    def check(
        model: Any, num_stages: Any, budget_gb: Any, budget_bytes: Any, microbatches: Any, schedule: Any,
        example_inputs: Any, example_kwargs: Any, example_target: Any, loss_fn: Any, splits: Any, return_outputs: bool,
    ) -> _PipelineRequest:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 2:
            raise ValueError(f"num_stages must be an int >= 2 (one stage per device), got {num_stages!r}")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
        try:
            schedule = PipelineSchedule(schedule)
        except ValueError:
            raise ValueError(
                f"schedule must be one of {[s.value for s in PipelineSchedule]}, got {schedule!r}"
            ) from None
        if schedule is PipelineSchedule.ONE_F_ONE_B and microbatches < num_stages:
            raise ValueError(
                f"schedule 1F1B needs at least as many microbatches as stages; got {microbatches} microbatches for "
                f"{num_stages} stages: raise microbatches or use schedule='GPipe'"
            )
        if loss_fn is None or not callable(loss_fn):
            raise TypeError(
                "loss_fn must be given: a callable (output, target) -> scalar loss of one microbatch, as "
                "torch.distributed.pipelining calls it"
            )
        budgets = _budgets(budget_gb, budget_bytes, num_stages)
        checked_splits = []
        for split in splits:
            if isinstance(split, str):
                if split not in SPLIT_STRATEGIES:
                    raise ValueError(
                        f"split must be one of {SPLIT_STRATEGIES} or the units to cut after, got {split!r}"
                    )
            else:
                split = tuple(int(u) for u in split)
                if len(split) != num_stages - 1:
                    raise ValueError(
                        f"a given split needs {num_stages - 1} cuts for {num_stages} stages, got {list(split)}"
                    )
            checked_splits.append(split)
        args, kwargs = _as_call(example_inputs, example_kwargs)
        arg_chunks, kwarg_chunks = _split_batch(args, kwargs, microbatches, "example inputs")
        target_chunks = (
            [None] * microbatches if example_target is None
            else [chunk[0] for chunk in _split_batch((example_target,), {}, microbatches, "example_target")[0]]
        )
        return _PipelineRequest(
            model=model, num_stages=num_stages, budgets_bytes=budgets, microbatches=microbatches,
            schedule=schedule, microbatch_args=arg_chunks[0], microbatch_kwargs=kwarg_chunks[0],
            microbatch_target=target_chunks[0], loss_fn=loss_fn, splits=tuple(checked_splits), return_outputs=bool(return_outputs),
            batch_input_bytes=unique_storage_bytes(_tensors((args, kwargs))),
            batch_target_bytes=unique_storage_bytes(_tensors(example_target)),
        )


def _budgets(budget_gb: Any, budget_bytes: Any, num_stages: int) -> tuple[int, ...]:
    given = budget_gb if budget_gb is not None else budget_bytes
    if isinstance(given, (list, tuple)):
        if len(given) != num_stages:
            raise ValueError(f"give one budget per stage: {num_stages} stages, {len(given)} budgets ({list(given)})")
        return tuple(
            budget_to_bytes(b, None) if budget_gb is not None else budget_to_bytes(None, b) for b in given
        )
    return (budget_to_bytes(budget_gb, budget_bytes),) * num_stages


def _as_call(example_inputs: Any, example_kwargs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError(f"example_inputs must be a tuple of positional arguments, got {type(example_inputs).__name__}")
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise TypeError(f"example_kwargs must be a dict, got {type(example_kwargs).__name__}")
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    if not args and not kwargs:
        raise ValueError("give example_inputs and/or example_kwargs: the whole batch the schedule will be stepped on")
    return args, kwargs


def _split_batch(args: tuple, kwargs: dict, microbatches: int, what: str) -> tuple[list[tuple], list[dict]]:
    """Microbatches as ``torch.distributed.pipelining`` makes them (dim 0 of every tensor); equal sizes required."""
    try:
        arg_chunks, kwarg_chunks = split_args_kwargs_into_chunks(args, kwargs, microbatches)
    except Exception as error:
        raise ValueError(f"the {what} do not split into {microbatches} microbatches: {error}") from error
    first_shapes = [tuple(t.shape) for t in _tensors((arg_chunks[0], kwarg_chunks[0]))]
    for index, chunk in enumerate(zip(arg_chunks, kwarg_chunks)):
        shapes = [tuple(t.shape) for t in _tensors(chunk)]
        if shapes != first_shapes:
            raise ValueError(
                f"the {what} split into microbatches of different shapes (microbatch 0: {first_shapes}, microbatch "
                f"{index}: {shapes}); give a batch whose dim 0 is a multiple of microbatches={microbatches}"
            )
    return list(arg_chunks), list(kwarg_chunks)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


# ------------------------------------------------------------------------------------------------ the table


@dataclass(frozen=True, kw_only=True, slots=True)
class _StageEntry:
    """A stage's best plan for one run of units at one position (None plan: no plan keeps the budget)."""

    plan: Plan
    retained_bytes: int
    buffer_bytes: int
    predicted_peak_bytes: int
    microbatch_ms: float


class _StageTable:
    """Candidate cuts, and per run of units between them and stage position, the stage's best plan."""

    def __init__(
        self, request: _PipelineRequest, graph: Graph, max_candidates: int, options: PlanOptions
    ) -> None:
        self.request = request
        self.graph = graph
        self.options = options
        self.solver_options = options.solver
        self.num_units = len(graph.units)
        args, kwargs = request.microbatch_args, request.microbatch_kwargs
        values = graph_values(graph, args, kwargs)
        assert isinstance(graph.executable, fx.GraphModule)
        self.values = values
        boundaries = block_boundaries(graph)
        self.legal_cuts = tuple(p for p in boundaries if not cut_problem(graph.executable, values, p))
        if len(self.legal_cuts) < request.num_stages - 1:
            raise ValueError(
                f"{type(request.model).__name__} has {len(self.legal_cuts)} places to cut between its blocks where "
                f"only tensors cross ({len(boundaries)} block boundaries); {request.num_stages} stages need "
                f"{request.num_stages - 1}"
            )
        # the splits given by name or by cuts, over every legal cut (the program and the exhaustive search choose
        # among the candidates, which include these)
        self.given_cuts: dict[str | tuple[int, ...], tuple[int, ...]] = {
            split: _checked_cuts(split, graph, values, self.legal_cuts) if isinstance(split, tuple)
            else baseline_cuts(self, split)
            for split in request.splits if split not in ("autockpt", "exhaustive")
        }
        given = {cut for cuts in self.given_cuts.values() for cut in cuts}
        self.candidates = tuple(sorted({*_spread(list(self.legal_cuts), max_candidates), *given}))
        self._crossing = crossing_tensors(graph, args, kwargs, self.candidates)
        # stage times come from one trace of the whole step: timings of tiny stages traced one by one are noisy,
        # and every split must be compared on the same numbers
        target, loss_fn = request.microbatch_target, request.loss_fn
        # (the median of three: one trace on a busy machine gave the same split 13 ms and 3763 ms)
        traces = [trace_step(graph, args, kwargs, checked_loss(lambda output: loss_fn(output, target))) for _ in range(3)]
        self.unit_ms = [statistics.median(t.units[u].forward_ms for t in traces) for u in range(self.num_units)]
        self.backward_ratio = max(statistics.median(t.step_ms / max(t.forward_ms, 1e-9) for t in traces) - 1.0, 0.0)
        self._planners: dict[tuple[int, int], Planner] = {}
        self._entries: dict[tuple[int, int, int], _StageEntry | None] = {}
        self._output_bytes: dict[int, int] = {}  # per stage planner (they live as long as the table)
        self._floors: dict[tuple[int, int, int], int | None] = {}  # per stage position and units

    # the runs a stage may take: from one candidate boundary (or the start) to a later one (or the end)
    def runs(self) -> list[tuple[int, int]]:
        starts = [0, *(c + 1 for c in self.candidates)]
        ends = [*self.candidates, self.num_units - 1]
        return [(a, b) for a in starts for b in ends if a <= b]

    def can_hold(self, stage: int, first: int, last: int) -> bool:
        """Whether stage position ``stage`` may run units ``first .. last``: the first stage starts at unit 0, the last
        ends at the last unit, and no other does either."""
        return (stage == 0) == (first == 0) and (stage == self.request.num_stages - 1) == (last == self.num_units - 1)

    def at_budget(self, budget: int) -> _StageTable:
        """This table with every device's budget ``budget``: the same capture, crossings and stage planners, its
        stage plans solved again."""
        trial = copy.copy(self)
        trial.request = dataclasses.replace(self.request, budgets_bytes=(budget,) * self.request.num_stages)
        trial._entries = {}
        return trial

    def graph_of(self, first: int, last: int, *, index: int = 0) -> StageGraph:
        return stage_graph(self.graph, first, last, index=index)

    def trains_parameters(self, first: int, last: int) -> bool:
        return any(p.requires_grad for p in self.graph_of(first, last).module.parameters())

    def planner(self, first: int, last: int) -> Planner:
        key = (first, last)
        if key not in self._planners:
            stage = self.graph_of(first, last)
            args, kwargs = self.stage_inputs(stage)
            self._planners[key] = Planner.from_model(
                stage.module, example_inputs=args, example_kwargs=kwargs, loss_fn=self.stage_loss(stage),
                # every microbatch after the first runs its backward with the step's gradients alive, and each
                # accumulation makes a new gradient beside the old one: the loop of gradient accumulation
                options=dataclasses.replace(self.options, gradient_accumulation_steps=self.request.microbatches),
            )
        return self._planners[key]

    def stage_inputs(self, stage: StageGraph) -> tuple[tuple, dict]:
        if stage.first_unit == 0:
            return self.request.microbatch_args, self.request.microbatch_kwargs
        return tuple(self._crossing[name] for name in stage.input_names), {}

    def stage_loss(self, stage: StageGraph) -> Callable[[Any], torch.Tensor]:
        if stage.last_unit == self.num_units - 1:
            target, loss_fn = self.request.microbatch_target, self.request.loss_fn
            return lambda output: loss_fn(output, target)
        return seeded_backward(stage_outputs=[self._crossing[name] for name in stage.output_names])

    def entry(self, option: StageOption) -> _StageEntry:
        found = self.entry_at(option.stage, option.first_unit, option.last_unit)
        assert found is not None
        return found

    def entry_at(self, stage: int, first: int, last: int) -> _StageEntry | None:
        """Stage position ``stage`` running units ``first .. last``: its best plan at its budget (None: none keeps
        it), solved once."""
        key = (stage, first, last)
        if key not in self._entries:
            self._entries[key] = self._solve(stage, first, last)
        return self._entries[key]

    def _solve(self, stage: int, first: int, last: int) -> _StageEntry | None:
        """The fastest plan whose peak for one microbatch, plus the other microbatches in flight, plus the
        schedule's buffers, stays under the stage's budget. What a microbatch in flight keeps depends on the plan,
        so the budget left for one microbatch is found by a short fixed point, starting from what the unmodified
        stage keeps (the most any plan keeps: the first answer always fits)."""
        request = self.request
        if not self.trains_parameters(first, last):
            # nothing to train there (e.g. only the position encodings before the first layer): torch's pipelining
            # could run it, but it holds a device for no parameters; the Planner has no training step to plan
            logger.debug("no stage runs units %d..%d alone: they train no parameter", first, last)
            return None
        planner = self.planner(first, last)
        in_flight = request.schedule.in_flight(stage, request.num_stages, request.microbatches)
        buffers = self.buffer_bytes(first, last, planner)
        budget = request.budgets_bytes[stage]
        kept = retained_bytes(planner, ())  # the unmodified stage: the most any plan keeps
        best: _StageEntry | None = None
        for _ in range(3):
            target = budget - buffers - (in_flight - 1) * kept
            try:
                the_plan = planner.plan(budget_bytes=target) if target > 0 else None
            except InfeasibleBudgetError:
                the_plan = None
            if the_plan is None:
                break
            kept_now = retained_bytes(planner, the_plan.policy.region_actions)
            peak = max(the_plan.predicted_peak_bytes + (in_flight - 1) * kept_now + buffers, self.end_of_step_bytes(first, last, planner))
            if peak <= budget:
                ms = self.microbatch_ms(first, last, the_plan)
                if best is None or ms < best.microbatch_ms:
                    best = _StageEntry(
                        plan=the_plan, retained_bytes=kept_now, buffer_bytes=buffers, predicted_peak_bytes=peak,
                        microbatch_ms=ms,
                    )
            if kept_now == kept:
                break
            kept = kept_now
        return best

    def microbatch_ms(self, first: int, last: int, the_plan: Plan) -> float:
        """Forward, backward and recomputation of one microbatch on units ``first .. last``, in the whole step's
        unit times (the stage's units are the whole graph's, in order) plus the plan's checkpoint machinery."""
        forward = sum(self.unit_ms[first:last + 1])
        recomputed = sum(
            self.unit_ms[first + node.index] for node in the_plan.nodes
            if node.recompute_ms > 0 and first + node.index <= last
        )
        return forward * (1 + self.backward_ratio) + recomputed + the_plan.machinery_ms

    def floor_at(self, stage: int, first: int, last: int) -> int | None:
        """The least budget this stage position keeps: its plan's smallest one-microbatch peak, its buffers and the
        other microbatches in flight at what the unmodified stage keeps (None: units that train nothing are no
        stage, as in ``_solve``)."""
        key = (stage, first, last)
        if key not in self._floors:  # no budget enters it: trial tables share it (``at_budget``)
            self._floors[key] = self._floor(stage, first, last)
        return self._floors[key]

    def _floor(self, stage: int, first: int, last: int) -> int | None:
        request = self.request
        if not self.trains_parameters(first, last):
            return None
        planner = self.planner(first, last)
        in_flight = request.schedule.in_flight(stage, request.num_stages, request.microbatches)
        try:
            one = planner.plan(budget_bytes=1).predicted_peak_bytes
        except InfeasibleBudgetError as error:
            one = error.min_feasible_bytes
        return max(
            one + self.buffer_bytes(first, last, planner) + (in_flight - 1) * retained_bytes(planner, ()),
            self.end_of_step_bytes(first, last, planner),
        )

    def buffer_bytes(self, first: int, last: int, planner: Planner) -> int:
        """The schedule's tensors on this stage beside one microbatch's step: receive buffers for the inputs of every
        microbatch (the stage's own trace counts one as its input), the gradients of its inputs from the previous
        microbatch's backward (1F1B keeps them referenced in its list of sends until the next send: measured +16 384 B
        on a GPT-2-style last stage without them), receive buffers for the gradients of what it sends, the rest of
        the batch on stage 0, the target and (when returned) the outputs of every other microbatch on the last
        stage."""
        request = self.request
        m = request.microbatches
        stage = self.graph_of(first, last)
        total = 0
        if first == 0:
            total += request.batch_input_bytes - planner.trace.input_bytes
        else:
            total += (m - 1) * planner.trace.input_bytes
            total += sum(
                self._crossing[name].untyped_storage().nbytes() for name in stage.input_names
                if self._crossing[name].requires_grad
            )
        if last < self.num_units - 1:
            total += m * sum(
                self._crossing[name].untyped_storage().nbytes() for name in stage.output_names
                if self._crossing[name].is_floating_point()
            )
        else:
            total += request.batch_target_bytes
            if request.return_outputs:  # the schedule keeps every microbatch's output to return them
                total += (m - 1) * self.output_bytes(planner)
        return max(total, 0)

    def end_of_step_bytes(self, first: int, last: int, planner: Planner) -> int:
        """The last stage's bytes when ``step`` returns the outputs: the schedule concatenates every microbatch's
        output into the batch's while it still holds them (twice the outputs, beside parameters and gradients)."""
        if last < self.num_units - 1 or not self.request.return_outputs:
            return 0
        m = self.request.microbatches
        return (
            planner.trace.static_bytes + (m - 1) * planner.trace.input_bytes + self.request.batch_target_bytes
            + 2 * m * self.output_bytes(planner)
        )

    def output_bytes(self, planner: Planner) -> int:
        """Bytes of the last stage's output for one microbatch (what the schedule keeps to return); one forward per
        stage planner, remembered: every budget tried asks again."""
        if id(planner) not in self._output_bytes:
            args, kwargs = planner.request.args, planner.request.kwargs
            with torch.no_grad(), torch.random.fork_rng():
                self._output_bytes[id(planner)] = unique_storage_bytes(_tensors(planner.model(*args, **kwargs)))
        return self._output_bytes[id(planner)]

    def problem(self, link_gb_per_s: float, cuts: tuple[int, ...] | None = None) -> SplitProblem:
        """Every stage a split may use, with its time (given cuts: their own stages only)."""
        options = []
        runs = self.runs() if cuts is None else _pieces(list(cuts), self.num_units)
        for (first, last), stage in itertools.product(runs, range(self.request.num_stages)):
            if not self.can_hold(stage, first, last):
                continue
            entry = self.entry_at(stage, first, last)
            if entry is not None:
                options.append(StageOption(stage=stage, first_unit=first, last_unit=last, microbatch_ms=entry.microbatch_ms))
        transfer = {c: 2 * self.sent_bytes(c) / (link_gb_per_s * 1e6) for c in self.candidates}
        return SplitProblem(
            num_units=self.num_units, num_stages=self.request.num_stages, microbatches=self.request.microbatches,
            options=tuple(options), transfer_ms=transfer,
        )

    def sent_bytes(self, after_unit: int) -> int:
        assert isinstance(self.graph.executable, fx.GraphModule)
        return sum(
            self._crossing[node.name].untyped_storage().nbytes()
            for node in crossing(self.graph.executable, after_unit) if node.name in self._crossing
        )

    def record(self, option: StageOption) -> PipelineStageRecord:
        entry = self.entry(option)
        stage = self.graph_of(option.first_unit, option.last_unit, index=option.stage)
        parameters = {id(p): p for p in stage.module.parameters()}
        return PipelineStageRecord(
            index=option.stage, first_unit=option.first_unit, last_unit=option.last_unit,
            module_paths=stage.module_paths, parameter_names=stage.parameter_names,
            parameter_bytes=sum(p.nbytes for p in parameters.values()),
            budget_bytes=self.request.budgets_bytes[option.stage],
            microbatches_in_flight=self.request.schedule.in_flight(option.stage, self.request.num_stages, self.request.microbatches),
            retained_bytes=entry.retained_bytes, schedule_buffer_bytes=entry.buffer_bytes,
            predicted_peak_bytes=entry.predicted_peak_bytes, predicted_microbatch_ms=entry.microbatch_ms,
            input_names=stage.input_names, output_names=stage.output_names,
            sent_bytes=0 if option.last_unit == self.num_units - 1 else self.sent_bytes(option.last_unit),
        )


def retained_bytes(planner: Planner, region_actions: Sequence[RegionAction]) -> int:
    """Bytes a microbatch's forward leaves alive for its backward under these regions (none: the unmodified stage):
    the forward tensors alive at the end of the last forward event, by the simulator (they wait there while other
    microbatches run)."""
    curve = memory_curve(planner.trace, planner.costs, region_actions)
    forward = [i for i, phase in enumerate(curve.phases) if phase is Phase.FORWARD]
    return curve.activation_bytes[forward[-1]] if forward else 0


class _SeededBackward(torch.autograd.Function):
    """A scalar whose backward hands the given gradients to the stage's outputs: the backward a middle stage runs
    when the next stage sends gradients back (``torch.autograd.backward(outputs, grads)``), with no extra tensor."""

    @staticmethod
    def forward(ctx: Any, grads: tuple[torch.Tensor, ...], *outputs: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return outputs[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[Any, ...]:
        return (None, *ctx.grads)


def seeded_backward(stage_outputs: Sequence[torch.Tensor]) -> Callable[[Any], torch.Tensor]:
    """A loss function for a stage that is not the last: backward starts from gradients of its outputs."""
    generator = torch.Generator().manual_seed(0)
    grads = tuple(
        torch.randn(t.shape, generator=generator, dtype=t.dtype).to(t.device) if t.is_floating_point() else None
        for t in stage_outputs
    )

    def loss(output: Any) -> torch.Tensor:
        flat = output if isinstance(output, tuple) else (output,)
        pairs = [(o, g) for o, g in zip(flat, grads) if g is not None and o.requires_grad]
        return _SeededBackward.apply(tuple(g for _, g in pairs), *(o for o, _ in pairs))

    return loss


# ------------------------------------------------------------------------------------------------ choosing


def _choose_split(
    table: _StageTable, split: str | tuple[int, ...], link: float, options: SolverOptions | None
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


def baseline_cuts(table: _StageTable, strategy: str) -> tuple[int, ...]:
    """The cuts of a baseline split over every legal cut: as many layers per stage ("even-layers", torchtitan's
    default: what precedes the first layer stays with it, what follows the last with it), or as many parameter
    bytes per stage ("parameter-balanced", DeepSpeed's default)."""
    num_stages = table.request.num_stages
    legal = list(table.legal_cuts)
    pieces = _pieces(legal, table.num_units)
    if strategy == "even-layers":
        blocks = unit_blocks(table.graph)
        weights = [float(len({blocks[u].path for u in range(a, b + 1) if blocks[u].is_layer})) for a, b in pieces]
        if not any(weights):  # no stack of layers: every piece between blocks counts as one
            weights = [1.0] * len(pieces)
    else:
        weights = [float(_parameter_bytes(table, first, last)) for first, last in pieces]
    total = sum(weights)
    cuts, running = [], 0.0
    for index, weight in enumerate(weights[:-1]):
        running += weight
        if len(cuts) < num_stages - 1 and running >= total * (len(cuts) + 1) / num_stages - 1e-9:
            cuts.append(legal[index])
    while len(cuts) < num_stages - 1:  # too few pieces reached a share: take the last cuts left
        cuts.append(next(c for c in reversed(legal) if c not in cuts))
        cuts.sort()
    return tuple(cuts)


def _checked_cuts(cuts: tuple[int, ...], graph: Graph, values: dict, legal: tuple[int, ...]) -> tuple[int, ...]:
    """Cuts the user gave: ascending, inside the graph, and where only tensors cross (else a ValueError that says
    why and where the model can be cut)."""
    num_units = len(graph.units)
    if list(cuts) != sorted(set(cuts)) or cuts[0] < 0 or cuts[-1] >= num_units - 1:
        raise ValueError(
            f"split cuts must be ascending unit indices from 0 to {num_units - 2} (cut after that unit), got "
            f"{list(cuts)}; the model's block boundaries where it can be cut: {list(legal)}"
        )
    assert isinstance(graph.executable, fx.GraphModule)
    for cut in cuts:
        if problem := cut_problem(graph.executable, values, cut):
            raise ValueError(
                f"the model cannot be cut after unit {cut}: {problem} (torch.distributed.pipelining sends only "
                f"tensors between stages); block boundaries where it can be cut: {list(legal)}"
            )
    return cuts


def _pieces(cuts: list[int], num_units: int) -> list[tuple[int, int]]:
    bounds = [-1, *cuts, num_units - 1]
    return [(a + 1, b) for a, b in zip(bounds, bounds[1:])]


def _parameter_bytes(table: _StageTable, first: int, last: int) -> int:
    stage = table.graph_of(first, last)
    return sum(p.nbytes for p in {id(p): p for p in stage.module.parameters()}.values())


@dataclass(frozen=True, slots=True)
class _Block:
    path: str  # module path of the block a unit runs in ("" for glue ops at the root)
    is_layer: bool  # one of a stack's layers (a child of a ModuleList/Sequential), not a top-level module


def unit_blocks(graph: Graph) -> list[_Block]:
    """The block each unit runs in: the outermost child of a ``ModuleList``/``Sequential`` on its module path (a
    transformer layer, a ResNet stage's block, a UNet's down block: the MLP ``Sequential`` inside a layer is part of
    the layer), else the top-level module it runs in; glue ops at the root are their own block."""
    model = graph.model
    containers = {name for name, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))}

    def block_of(path: str) -> _Block:
        parts = path.split(".") if path else []
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if ".".join(parts[: depth - 1]) in containers and prefix not in containers:
                return _Block(prefix, True)
        return _Block(parts[0] if parts else "", False)

    return [block_of(unit.module_path) for unit in graph.units]


def block_boundaries(graph: Graph) -> list[int]:
    """Unit boundaries between blocks (``unit_blocks``). Cut after unit p = between units p and p+1."""
    keys = [block.path for block in unit_blocks(graph)]
    return [p for p in range(len(keys) - 1) if keys[p] != keys[p + 1]]


def _spread(points: list[int], limit: int) -> list[int]:
    """At most ``limit`` of the points, evenly spaced (all of them when few)."""
    if len(points) <= limit:
        return points
    step = (len(points) - 1) / (limit - 1)
    return sorted({points[round(i * step)] for i in range(limit)})


def _device_copy_gb_per_s(model: nn.Module) -> float:
    """Copy bandwidth on the model's device, GB/s: what sends between stages are priced at when not given."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    source = torch.empty(16 * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    timings = []
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - started)
    return source.nbytes / min(timings) / 1e9


def _infeasible(
    table: _StageTable, request: _PipelineRequest, link: float, split: str | tuple[int, ...]
) -> InfeasibleBudgetError:
    """No split keeps every budget: the smallest uniform per-device budget a split keeps. Each stage position's
    floor is its plan's smallest one-microbatch peak plus its buffers plus the other microbatches in flight at what
    the unmodified stage keeps (``_StageTable._solve``'s first try, so a budget at the floor finds that plan); the
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


def _some_split_keeps(table: _StageTable, budget: int, link: float, split: str | tuple[int, ...]) -> bool:
    trial = table.at_budget(budget)
    return _choose_split(trial, split, link, trial.solver_options) is not None
