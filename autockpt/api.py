"""The public entry points: optimize, plan, Planner, get_plan. Validates input, runs the stages, assembles the Plan."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import numbers
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autockpt._state import enter_training_modes, preserved_model_state
from autockpt.capture import capture
from autockpt.errors import InfeasibleBudgetError, LossFunctionError
from autockpt.measure import alternating_step_seconds, measure_step
from autockpt.plan_io import check_fingerprint, model_fingerprint
from autockpt.profile import device_of, for_checkpoint, profile
from autockpt.report import GB, format_bytes
from autockpt.rewrite import OptimizedModule, rewrite
from autockpt.simulate import memory_curve, simulate, unit_regions
from autockpt.solve.baselines import baseline_seed_plans
from autockpt.solve.candidates import candidate_regions
from autockpt.solve.ilp import PreparedProblem, SolveResult, SolverOptions, prepare, solve_prepared
from autockpt.solve.structure import find_repeated_blocks
from autockpt.types import (
    CaptureKind,
    CheckpointKind,
    Decision,
    Graph,
    NodePlan,
    ParetoPoint,
    Plan,
    PlanStatus,
    Profile,
    Region,
    Timeline,
    describe_value,
)

logger = logging.getLogger(__name__)

_VERIFY_ATTEMPTS = 3


def optimize(
    model: nn.Module,
    budget_gb: float | None = None,
    *,
    budget_bytes: int | None = None,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    solver_options: SolverOptions | None = None,
) -> nn.Module:
    """Return a module that trains like ``model`` with a step peak of at most the budget (GB = 10^9 bytes).

    The returned module shares ``model``'s parameters and buffers (same ``state_dict`` keys) and returns the same
    outputs and gradients. Before returning, one real training step on the example inputs is measured; if it went
    over the budget, the plan is tightened by the overshoot and checked again. With the default checkpoint choice
    (``SolverOptions(checkpoint="auto")``) a plan is made for each checkpoint kind, and when more than one keeps the
    budget their steps are timed against each other and the faster is returned. ``autockpt.get_plan(result)`` tells
    what was decided and what was measured.
    """
    budget = budget_to_bytes(budget_gb, budget_bytes)
    planner = Planner(
        model, example_inputs=example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
        solver_options=solver_options,
    )
    return planner.optimize(budget_bytes=budget)


def plan(
    model: nn.Module,
    budget_gb: float | None = None,
    *,
    budget_bytes: int | None = None,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    solver_options: SolverOptions | None = None,
) -> Plan:
    """Like ``optimize`` but only plans (no rewrite, no verification step): returns the Plan. With the default
    checkpoint choice ("auto") it is the plan with the smaller *predicted* overhead of the kinds (``optimize``
    times them instead)."""
    budget = budget_to_bytes(budget_gb, budget_bytes)
    planner = Planner(
        model, example_inputs=example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
        solver_options=solver_options,
    )
    return planner.plan(budget_bytes=budget)


def apply_plan(
    model: nn.Module,
    the_plan: Plan,
    *,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Rewrite ``model`` to run a saved plan (``autockpt.load_plan``) without profiling or solving again.

    The model is captured on the example inputs (same shapes and dtypes as when the plan was made) and its
    fingerprint compared with the plan's: a different graph, parameter or input is refused with
    ``PlanMismatchError`` saying what differs. Nothing is measured; ``autockpt.measure_step`` does that.
    """
    if not isinstance(the_plan, Plan):
        raise TypeError(f"apply_plan expects an autockpt.Plan (autockpt.load_plan(path)), got {type(the_plan).__name__}")
    request = _Request.check(model, example_inputs, example_kwargs, None, None)
    with preserved_model_state(model, request.args, request.kwargs):
        enter_training_modes(model)
        graph = capture(model, request.args, request.kwargs)
        check_fingerprint(the_plan, model_fingerprint(model, graph, request.args, request.kwargs), graph.units)
        module = rewrite(graph, the_plan, request.args, request.kwargs)
    module.training = model.training
    return module


class Planner:
    """Capture and profile a model once; then plan at any budget, score any regions, and apply plans.

        planner = autockpt.Planner(model, example_inputs=(x,))
        plans = [planner.plan(budget_gb=b) for b in (2, 4, 6)]      # one capture and profile for all
        module = planner.apply(plans[0])                            # rewrite, without measuring

    ``on_stage(name)`` is called as each stage starts ("capture", "profile", "solve", "rewrite", "measure"), for
    progress displays. The model is left as it was after every call (weights, buffers, gradients, RNG, modes).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        example_inputs: Any = (),
        example_kwargs: Mapping[str, Any] | None = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        solver_options: SolverOptions | None = None,
        on_stage: Callable[[str], None] | None = None,
    ) -> None:
        self.request = _Request.check(model, example_inputs, example_kwargs, loss_fn, solver_options)
        self._on_stage = on_stage or (lambda stage: None)
        with self._model_state():
            self._on_stage("capture")
            started = time.perf_counter()
            self.graph: Graph = capture(model, self.request.args, self.request.kwargs)
            captured = time.perf_counter()
            self._on_stage("profile")
            # the checkpoints plans are made for; the profile is calibrated for the first, the others derive from it
            self.checkpoint_kinds = (self.request.solver_options or SolverOptions()).checkpoint_kinds(self.graph.kind)
            self.profile = profile(
                self.graph, self.request.args, self.request.kwargs, self.request.loss,
                time_repeated_blocks_once=self._solves_by_blocks(),
                checkpoint_kind=self.checkpoint_kinds[0],
                gradient_lifetimes=CheckpointKind.RECOMPUTE_FUNCTION in self.checkpoint_kinds,
            )
        self.capture_time_s = captured - started
        self.profile_time_s = time.perf_counter() - captured
        self.fingerprint = model_fingerprint(model, self.graph, self.request.args, self.request.kwargs)
        self._executable_used = False  # rewriting edits graph.executable; later rewrites capture again
        self._memory_before = memory_curve(self.profile, ())  # the same for every plan of this planner
        self._device = device_of(model, self.request.args, self.request.kwargs)
        # per checkpoint kind: scored candidates and floors, shared by every budget
        self._problems: dict[CheckpointKind, PreparedProblem] = {}

    @property
    def model(self) -> nn.Module:
        return self.request.model

    def plan(self, budget_gb: float | None = None, *, budget_bytes: int | None = None, pareto_points: int = 0) -> Plan:
        """The cheapest plan under the budget (GB = 10^9 bytes). ``pareto_points`` > 0 also solves that many budgets
        from the smallest feasible peak to the unmodified peak and stores them in ``Plan.pareto``."""
        budget = budget_to_bytes(budget_gb, budget_bytes)
        result, kind = self._solve(budget)
        the_plan = self._assemble(result.regions, budget, result.timeline, kind, result=result)
        if pareto_points > 0:
            the_plan = dataclasses.replace(the_plan, pareto=self.pareto(pareto_budgets(the_plan, pareto_points)))
        return the_plan

    def pareto(self, budgets: Sequence[int]) -> tuple[ParetoPoint, ...]:
        """Predicted peak and overhead of the plan for each budget in bytes (None where it is infeasible)."""
        points = []
        for budget in budgets:
            try:
                result, _ = self._solve(int(budget))
            except InfeasibleBudgetError:
                points.append(
                    ParetoPoint(budget_bytes=int(budget), predicted_peak_bytes=None, predicted_overhead=None, regions=0)
                )
                continue
            points.append(
                ParetoPoint(
                    budget_bytes=int(budget), predicted_peak_bytes=result.timeline.peak_bytes,
                    predicted_overhead=self._overhead(result.timeline.overhead_ms), regions=len(result.regions),
                )
            )
        return tuple(points)

    def plan_for_regions(self, regions: Sequence[Region], *, strategy: str) -> Plan:
        """Score given regions (a baseline policy, a hand-made plan) with the same simulator as solved plans, for the
        first of the planner's checkpoint kinds (torch's, unless another was asked for).

        The plan's ``status`` is ``given`` and its budget is its own predicted peak.
        """
        ordered = tuple(sorted(regions, key=lambda r: r.first_unit))
        timeline = simulate(self.profile, ordered)
        return self._assemble(ordered, timeline.peak_bytes, timeline, self.profile.checkpoint_kind, strategy=strategy)

    def apply(self, the_plan: Plan) -> OptimizedModule:
        """Rewrite the model to run ``the_plan`` (made by this planner, or loaded from a file); nothing is measured.

        A plan whose fingerprint does not match this model and these inputs is refused (``PlanMismatchError``).
        """
        check_fingerprint(the_plan, self.fingerprint, self.graph.units)
        self._on_stage("rewrite")
        with self._model_state():
            module = rewrite(self._fresh_graph(), the_plan, self.request.args, self.request.kwargs)
        module.training = self.model.training
        return module

    def optimize(self, budget_gb: float | None = None, *, budget_bytes: int | None = None) -> OptimizedModule:
        """Plan, rewrite, measure one real step; tighten by the overshoot while the measured peak is over budget.

        When plans are made for more than one checkpoint kind ("auto") and more than one keeps the budget when
        measured, their steps are timed against each other and the faster is returned (``Plan.notes`` says by how
        much): the predicted overheads of the kinds are too close for their errors on some devices.
        """
        budget = budget_to_bytes(budget_gb, budget_bytes)
        target = budget
        tightenings: list[str] = []
        peak = 0
        for attempt in range(_VERIFY_ATTEMPTS):
            try:
                results = self._solve_each(target)
            except InfeasibleBudgetError as error:
                if attempt == 0:
                    raise
                raise InfeasibleBudgetError(
                    f"the budget {format_bytes(budget)} was not kept when measured ({tightenings[-1]} bytes) "
                    f"and no tighter plan exists (smallest predicted peak {error.min_feasible_bytes} bytes). Use a "
                    f"budget of at least {peak} bytes (the measured peak) or a smaller batch.",
                    budget_bytes=budget,
                    min_feasible_bytes=peak,
                ) from error
            kept: list[OptimizedModule] = []
            overshoot = 0
            for kind, result in results.items():
                the_plan = self._assemble(result.regions, budget, result.timeline, kind, result=result)
                module = self.apply(the_plan)
                if the_plan.status is PlanStatus.IDENTITY:
                    return module
                self._on_stage("measure")
                with self._model_state():
                    module.training = True  # the module follows the user's train/eval flag, restored after measuring
                    peak = measure_step(module, self.request.args, self.request.kwargs, self.request.loss).peak_bytes
                module.training = self.model.training
                module.set_plan(dataclasses.replace(the_plan, measured_peak_bytes=peak))
                if peak <= budget:
                    kept.append(module)
                    continue
                overshoot = max(overshoot, peak - budget)
                tightenings.append(f"{kind.value}: predicted {the_plan.predicted_peak_bytes}, measured {peak}")
                logger.info("measured peak %d bytes is over the budget %d (%s)", peak, budget, kind.value)
            if kept:
                return kept[0] if len(kept) == 1 else self._faster(kept)
            logger.info("no plan kept the budget %d when measured; tightening", budget)
            target -= overshoot + max(1, budget // 1000)
        raise InfeasibleBudgetError(
            f"the budget {format_bytes(budget)} was not kept when measured after {_VERIFY_ATTEMPTS} rounds of plans "
            f"(bytes: {'; '.join(tightenings)}). Use a budget of at least {peak} bytes (the last measured peak) or a "
            "smaller batch.",
            budget_bytes=budget,
            min_feasible_bytes=peak,
        )

    def _faster(self, modules: list[OptimizedModule]) -> OptimizedModule:
        """The module whose training step is fastest, timed in alternating rounds (median of per-round times); the
        choice and the measured ratios go into its plan's notes."""
        self._on_stage("measure")
        with self._model_state():
            seconds = alternating_step_seconds(modules, self.request.args, self.request.kwargs, self.request.loss)
        # per module: the median over rounds of its step time over the first module's in the same round
        ratios = [statistics.median(t / first for t, first in zip(times, seconds[0])) for times in seconds]
        fastest = min(range(len(modules)), key=ratios.__getitem__)
        chosen = modules[fastest]
        others = ", ".join(
            f"{module.plan.checkpoint_kind.value}'s step took {ratios[i] / ratios[fastest]:.3f}x as long"
            for i, module in enumerate(modules) if i != fastest
        )
        note = (
            f"checkpoint {chosen.plan.checkpoint_kind.value} chosen by measured step time: {others} (median of "
            f"{len(seconds[0])} alternating rounds on the example inputs)"
        )
        logger.info(note)
        chosen.set_plan(dataclasses.replace(chosen.plan, notes=(*chosen.plan.notes, note)))
        return chosen

    @contextlib.contextmanager
    def _model_state(self) -> Iterator[None]:
        with preserved_model_state(self.model, self.request.args, self.request.kwargs):
            enter_training_modes(self.model)
            yield

    def _fresh_graph(self) -> Graph:
        """The profiled graph the first time; a new capture afterwards (rewriting edits the executable in place)."""
        if not self._executable_used:
            self._executable_used = True
            return self.graph
        graph = capture(self.model, self.request.args, self.request.kwargs)
        if len(graph.units) != len(self.graph.units):
            raise RuntimeError(
                f"capturing {type(self.model).__name__} a second time gave {len(graph.units)} units instead "
                f"of {len(self.graph.units)} (the model's forward is not deterministic?); create a new Planner, or "
                "use autockpt.plan to inspect the first plan"
            )
        return graph

    def _solves_by_blocks(self) -> bool:
        """Repeated blocks are solved (and timed) once per family, unless switched off or the capture is module-level
        (which can only checkpoint whole submodule calls: its candidates are those calls)."""
        options = self.request.solver_options or SolverOptions()
        return options.repeated_blocks and self.graph.kind is not CaptureKind.MODULE

    def _solve(self, target_bytes: int) -> tuple[SolveResult, CheckpointKind]:
        """The plan under ``target_bytes`` with the smallest predicted overhead over the planner's checkpoint kinds,
        and its kind."""
        results = self._solve_each(target_bytes)
        kind = min(results, key=lambda k: results[k].timeline.overhead_ms)  # the first kind on a tie
        if len(results) > 1:
            logger.info(
                "checkpoint: %s (predicted overhead %s)", kind.value,
                ", ".join(f"{k.value} {r.timeline.overhead_ms:.2f} ms" for k, r in results.items()),
            )
        return results[kind], kind

    def _solve_each(self, target_bytes: int) -> dict[CheckpointKind, SolveResult]:
        """Per checkpoint kind with a plan under ``target_bytes``: its cheapest plan. Each result's
        ``min_feasible_bytes`` is the lowest over all kinds; raises ``InfeasibleBudgetError`` when no kind has one."""
        self._on_stage("solve")
        results: dict[CheckpointKind, SolveResult] = {}
        infeasible: list[InfeasibleBudgetError] = []
        for kind in self.checkpoint_kinds:
            try:
                results[kind] = solve_prepared(self._problem_for(kind), target_bytes, self.request.solver_options)
            except InfeasibleBudgetError as error:
                infeasible.append(error)
        if not results:
            raise min(infeasible, key=lambda error: error.min_feasible_bytes)  # the kind that gets lowest
        floor = min([r.min_feasible_bytes for r in results.values()] + [e.min_feasible_bytes for e in infeasible])
        for kind, result in results.items():
            results[kind] = dataclasses.replace(result, min_feasible_bytes=floor)
            logger.info(
                "plan (%s): %s, %d regions, predicted peak %d bytes (target %d), solve %.1fs", kind.value,
                result.status.value, len(result.regions), result.timeline.peak_bytes, target_bytes, result.solve_time_s,
            )
        return results

    def _profile_for(self, kind: CheckpointKind) -> Profile:
        return for_checkpoint(self.profile, kind, self._device)

    def _problem_for(self, kind: CheckpointKind) -> PreparedProblem:
        if kind not in self._problems:
            measured = self._profile_for(kind)
            structure = find_repeated_blocks(self.graph, measured) if self._solves_by_blocks() else None
            self._problems[kind] = prepare(
                measured, *candidate_regions(self.graph, measured),
                seed_plans=baseline_seed_plans(self.graph, measured), structure=structure,
            )
        return self._problems[kind]

    def _overhead(self, overhead_ms: float) -> float:
        return overhead_ms / self.profile.step_ms if self.profile.step_ms > 0 else 0.0

    def _assemble(
        self,
        regions: tuple[Region, ...],
        budget: int,
        timeline: Timeline,
        kind: CheckpointKind,
        *,
        result: SolveResult | None = None,
        strategy: str = "autockpt",
    ) -> Plan:
        measured = self._profile_for(kind)
        region_of = unit_regions(len(self.graph.units), regions)
        rerun = set(timeline.rerun_units)
        nodes = tuple(
            NodePlan(
                index=unit.index,
                name=unit.name,
                op=unit.op,
                module_path=unit.module_path,
                saved_bytes=cost.saved_bytes,
                output_bytes=cost.output_bytes,
                forward_ms=cost.forward_ms,
                flops=cost.flops,
                decision=Decision.KEEP if region_of[unit.index] is None else Decision.RECOMPUTE,
                region=region_of[unit.index],
                recompute_ms=cost.forward_ms if unit.index in rerun else 0.0,
                saved_tensors=cost.saved_tensors,
            )
            for unit, cost in zip(self.graph.units, measured.units)
        )
        solved = result is not None
        return Plan(
            budget_bytes=budget,
            predicted_peak_bytes=timeline.peak_bytes,
            baseline_peak_bytes=result.baseline.peak_bytes if solved else measured.baseline_peak_bytes,
            min_feasible_bytes=result.min_feasible_bytes if solved else timeline.peak_bytes,
            static_bytes=measured.static_bytes,
            predicted_overhead=self._overhead(timeline.overhead_ms),
            recompute_ms=timeline.recompute_ms,
            region_overhead_ms=measured.region_overhead_ms,
            saved_tensor_overhead_ms=measured.saved_tensor_overhead_ms,
            machinery_ms=timeline.machinery_ms,
            checkpoint_kind=measured.checkpoint_kind,
            baseline_step_ms=measured.step_ms,
            capture=self.graph.kind,
            status=result.status if solved else PlanStatus.GIVEN,
            solver=result.solver if solved else "none",
            solve_time_s=result.solve_time_s if solved else 0.0,
            capture_time_s=self.capture_time_s,
            profile_time_s=self.profile_time_s,
            regions=regions,
            nodes=nodes,
            notes=self.graph.notes,
            strategy=strategy,
            fingerprint=self.fingerprint,
            solver_stats=result.stats if solved else None,
            memory_before=self._memory_before,
            memory_after=memory_curve(measured, regions),
        )


def pareto_budgets(the_plan: Plan, points: int) -> list[int]:
    """``points`` budgets evenly spaced from the smallest feasible peak to the unmodified peak (both included)."""
    low, high = the_plan.min_feasible_bytes, the_plan.baseline_peak_bytes
    if points == 1 or high <= low:
        return [low]
    return [int(round(low + (high - low) * i / (points - 1))) for i in range(points)]


def get_plan(module: nn.Module) -> Plan:
    """The Plan behind a module returned by ``autockpt.optimize``."""
    if not isinstance(module, OptimizedModule):
        raise TypeError(
            f"get_plan expects a module returned by autockpt.optimize, got {type(module).__name__}. "
            "Call autockpt.optimize(model, ...) first, or autockpt.plan(...) to get a Plan without rewriting."
        )
    return module.plan


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` (Hugging Face), else ``output["loss"]``, else the sum of all floating-point outputs."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise LossFunctionError(
            f"the model's output has no floating-point tensor that requires grad (got {type(output).__name__}); "
            "pass loss_fn=lambda output: ... that returns the scalar loss to backpropagate."
        )
    return sum(t.sum() for t in leaves)


def _checked(loss_fn: Callable[[Any], Any]) -> Callable[[Any], torch.Tensor]:
    """``loss_fn`` with its result checked: a scalar floating-point tensor attached to the graph, or a
    ``LossFunctionError`` that says what came back (instead of backward failing deep inside profiling)."""

    def loss(output: Any) -> torch.Tensor:
        value = loss_fn(output)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point() and value.requires_grad:
            return value
        if isinstance(value, torch.Tensor):
            got = f"a {value.dtype} tensor of shape {tuple(value.shape)} (requires_grad={value.requires_grad})"
        else:
            got = f"{describe_value(value)} ({type(value).__name__})"
        raise LossFunctionError(
            f"loss_fn returned {got}; expected a floating-point tensor with one element that requires grad, computed "
            "from the model's output (e.g. lambda out: out.logits.float().mean()). Reduce it with .mean() or .sum(), "
            "and keep it attached to the graph (no .item(), .detach() or torch.no_grad())."
        )

    return loss


def budget_to_bytes(budget_gb: Any, budget_bytes: Any) -> int:
    """Check the budget arguments; GB = 10^9 bytes."""
    if (budget_gb is None) == (budget_bytes is None):
        raise ValueError(
            f"give exactly one of budget_gb (GB = 10^9 bytes) or budget_bytes; got budget_gb={budget_gb!r}, "
            f"budget_bytes={budget_bytes!r}"
        )
    name, value = ("budget_gb", budget_gb) if budget_gb is not None else ("budget_bytes", budget_bytes)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a positive number, got {describe_value(value)} ({type(value).__name__})")
    if not math.isfinite(float(value)) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if name == "budget_bytes" and float(value) != int(value):
        raise ValueError(f"budget_bytes must be a whole number of bytes, got {value!r}; for GB use budget_gb=")
    result = int(round(float(value) * GB)) if name == "budget_gb" else int(value)
    if result <= 0:
        raise ValueError(f"{name}={value!r} is less than one byte; give the budget in {'GB' if name == 'budget_gb' else 'bytes'}")
    return result



@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Request:
    """Checked model, example inputs and loss of a Planner / optimize / plan call."""

    model: nn.Module
    args: tuple
    kwargs: dict
    loss: Callable[[Any], torch.Tensor]
    solver_options: SolverOptions | None

    @staticmethod
    def check(model: Any, example_inputs: Any, example_kwargs: Any, loss_fn: Any, solver_options: Any) -> _Request:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(model, OptimizedModule):
            raise TypeError(
                "model was already optimized by autockpt; pass the original model (module.original_module)"
            )
        args, kwargs = _example_arguments(example_inputs, example_kwargs)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (output -> scalar tensor), got {type(loss_fn).__name__}")
        if solver_options is not None and not isinstance(solver_options, SolverOptions):
            raise TypeError(f"solver_options must be autockpt.SolverOptions, got {type(solver_options).__name__}")
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                f"{type(model).__name__} has no parameter that requires grad: there is no training step to plan"
            )
        return _Request(
            model=model, args=args, kwargs=kwargs, loss=_checked(loss_fn or default_loss), solver_options=solver_options
        )


def _example_arguments(example_inputs: Any, example_kwargs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, list):
        example_inputs = tuple(example_inputs)
    if isinstance(example_inputs, Mapping):
        raise TypeError(
            f"example_inputs must be a tuple of positional arguments for model(...), got a {type(example_inputs).__name__}"
            f" with keys {list(example_inputs)[:5]}; pass keyword arguments (e.g. a Hugging Face batch) as example_kwargs="
        )
    if not isinstance(example_inputs, tuple):
        raise TypeError(
            f"example_inputs must be a tuple of positional arguments for model(...), got "
            f"{type(example_inputs).__name__}; wrap a single tensor as (tensor,)"
        )
    if example_kwargs is None:
        example_kwargs = {}
    if not isinstance(example_kwargs, Mapping):
        raise TypeError(f"example_kwargs must be a dict of keyword arguments, got {type(example_kwargs).__name__}")
    if not example_inputs and not example_kwargs:
        raise ValueError("give example_inputs and/or example_kwargs: autockpt measures the model on a real step")
    for path, leaf in pytree.tree_flatten_with_path((example_inputs, dict(example_kwargs)))[0]:
        if type(leaf).__module__ == "numpy" and hasattr(leaf, "shape"):
            where = "example_inputs" if path[0].idx == 0 else "example_kwargs"
            raise TypeError(
                f"{where}{pytree.keystr(path[1:])} is a numpy array of shape {tuple(leaf.shape)}: the model is run on "
                "torch tensors; convert it with torch.from_numpy(...) (and .to(device) where the model lives)"
            )
    return example_inputs, dict(example_kwargs)
