"""The public entry points: optimize, plan, apply_plan, Planner, get_plan, baseline_plan.

``Planner`` coordinates the stages (capture -> trace -> costs -> solve -> policy -> rewrite); verifying a plan on a
real step and racing the recompute actions against each other is ``verify.py``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import numbers
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autockpt.measure.capture import capture
from autockpt.planning.compiled import compiled_module
from autockpt.measure.costs import calibrate
from autockpt.errors import InfeasibleBudgetError
from autockpt.measure.loop import (
    OptimizerSpec,
    check_accumulation_steps,
    measure_optimizer_step,
    optimizer_factory,
    step_in_loop,
    with_foreign_bytes,
)
from autockpt.measure.loss import checked_loss, default_loss
from autockpt.measure.step import (
    StepMeasurement,
    alternating_step_seconds,
    foreign_bytes,
    measure_compiled_step,
    measure_step,
    owned_bytes,
)
from autockpt.runtime.model_state import enter_training_modes, preserved_model_state
from autockpt.runtime.offload import available_host_bytes
from autockpt.records.plan import Plan
from autockpt.records.plan_inputs import in_recorded_form, recorded_inputs
from autockpt.records.plan_io import check_fingerprint, model_fingerprint
from autockpt.planning.policy import PlanningContext, assemble_plan
from autockpt.runtime.rewrite import OptimizedModule, rewrite
from autockpt.planning.shapes import attach_shape_variants
from autockpt.core.simulate import memory_curve, simulate
from autockpt.core.solve.base import Problem, SolveResult, SolverOptions, recompute_actions, region_actions
from autockpt.core.solve.baselines import baseline_regions, baseline_seed_plans
from autockpt.core.solve.candidates import candidate_regions
from autockpt.core.solve.default import solve_prepared
from autockpt.core.solve.joint import JointProblem, solve_joint, unbounded_pool
from autockpt.core.solve.prepare import prepare
from autockpt.core.structure import find_repeated_blocks
from autockpt.measure.trace import device_of, step_tensors, trace_step
from autockpt.record_types import ParetoPoint
from autockpt.types import Action, CaptureKind, Graph, Placement, Region, TrainingLoop, describe_value
from autockpt.units import GB, format_bytes
from autockpt.planning.verify import verified_module

logger = logging.getLogger(__name__)


def optimize(
    model: nn.Module,
    budget_gb: float | None = None,
    *,
    budget_bytes: int | None = None,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    solver_options: SolverOptions | None = None,
    checkpoint: Action | str | None = None,
    host_pool_gb: float | str = 0,
    strict: bool = False,
    optimizer: OptimizerSpec | None = None,
    gradient_accumulation_steps: int = 1,
    compiled: bool | Mapping[str, Any] = False,
) -> nn.Module:
    """Return a module that trains like ``model`` with a step peak of at most the budget (GB = 10^9 bytes).

    The returned module shares ``model``'s parameters and buffers (same ``state_dict`` keys) and returns the same
    outputs and gradients. Before returning, one real training step on the example inputs is measured; if it went
    over the budget, the plan is tightened by the overshoot and checked again. With the default checkpoint choice
    (``checkpoint="auto"``) a plan is made for each recompute action, and when more than one keeps the budget their
    steps are timed against each other and the faster is returned. ``autockpt.get_plan(result)`` tells what was
    decided and what was measured.

    ``host_pool_gb`` (GB = 10^9 bytes): the most host memory the plan may offload saved tensors into (one buffer,
    allocated once, pinned on CUDA, sized by the plan); the program then chooses per region between keeping,
    recomputing and offloading. 0 (default): recompute only. ``"auto"``: up to half the host memory available now.
    On CPU the pool is ordinary host memory: the step's device peak is then what MemTracker counts minus the pool.

    Inputs: a step whose tensors are no larger than the example's in every dimension (same rank and dtype; other
    arguments equal; extra arguments of at most one element such as a loop's ``num_items_in_batch``) runs under the
    plan, captured at its shapes the first time (``OptimizedModule.shape_variants()``). A larger step runs the
    original model with a warning, over the budget; ``strict=True`` raises ``UnplannedStepError`` instead.

    The loop: with ``optimizer`` (the optimizer over ``model``'s parameters that will train it, or a function making
    one from a list of parameters, e.g. ``torch.optim.AdamW``) the budget covers ``optimizer.step()`` too, its states
    alive through every step and its temporaries; the optimizer is copied to measure it, never stepped. With
    ``gradient_accumulation_steps`` > 1 it covers micro-steps that start with the earlier ones' gradients alive
    (also the setting for a loop that zeroes gradients in place instead of setting them to None).

    ``compiled=True`` (or a dict of ``torch.compile`` keyword arguments): return ``torch.compile`` of the optimized
    module, with the budget kept by the *compiled* step (the partitioner re-decides what is saved, so the eager plan's
    peak does not carry over): the compiled step is measured (``torch.cuda.max_memory_allocated``; on CPU the
    allocator's events in ``torch.profiler``, which count more than MemTracker) and planned tighter while it is over;
    of the plans whose compiled step fits, the fastest compiled step is kept (timed against each other;
    ``autockpt.planning.compiled``). ``autockpt.get_plan(result)`` is the plan. The optimizer and gradient accumulation are measured as in eager mode
    (the optimizer step itself runs uncompiled). Not with a host pool.
    """
    budget = budget_to_bytes(budget_gb, budget_bytes)
    if not isinstance(compiled, (bool, Mapping)):
        raise TypeError(
            f"compiled={compiled!r}: give True, False, or a dict of torch.compile keyword arguments "
            "(e.g. compiled={'mode': 'max-autotune'})"
        )
    if compiled is not False and host_pool_to_bytes(host_pool_gb) > 0:
        raise ValueError(
            f"compiled={compiled!r} with host_pool_gb={host_pool_gb!r}: offloading is not measured under torch.compile; "
            "give host_pool_gb=0 to compile, or compiled=False to offload"
        )
    planner = Planner(
        model, example_inputs=example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
        solver_options=solver_options, checkpoint=checkpoint, host_pool_gb=host_pool_gb, optimizer=optimizer,
        gradient_accumulation_steps=gradient_accumulation_steps,
    )
    if compiled is not False:
        options = compiled if isinstance(compiled, Mapping) else {}
        result = compiled_module(planner, budget, options)
        result._orig_mod.strict = strict
        return result
    module = planner.optimize(budget_bytes=budget)
    module.strict = strict
    return module


def plan(
    model: nn.Module,
    budget_gb: float | None = None,
    *,
    budget_bytes: int | None = None,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    solver_options: SolverOptions | None = None,
    checkpoint: Action | str | None = None,
    host_pool_gb: float | str = 0,
    optimizer: OptimizerSpec | None = None,
    gradient_accumulation_steps: int = 1,
) -> Plan:
    """Like ``optimize`` but only plans (no rewrite, no verification step): returns the Plan. With the default
    checkpoint choice ("auto") it is the plan with the smaller *predicted* overhead of the recompute actions
    (``optimize`` times them instead)."""
    budget = budget_to_bytes(budget_gb, budget_bytes)
    planner = Planner(
        model, example_inputs=example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
        solver_options=solver_options, checkpoint=checkpoint, host_pool_gb=host_pool_gb, optimizer=optimizer,
        gradient_accumulation_steps=gradient_accumulation_steps,
    )
    return planner.plan(budget_bytes=budget)


def apply_plan(
    model: nn.Module,
    the_plan: Plan,
    *,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    strict: bool = False,
) -> nn.Module:
    """Rewrite ``model`` to run a saved plan (``autockpt.load_plan``) without profiling or solving again.

    The model is captured on the example inputs (same shapes and dtypes as when the plan was made; positional or by
    keyword, as the optimized module takes them) and its fingerprint compared with the plan's: a different graph,
    parameter or input is refused with ``PlanMismatchError`` saying what differs. Without example inputs they are
    built from the inputs the plan records (``plan_inputs.py``: random values of the recorded shapes and dtypes,
    integers in the recorded range, on the device of the model's parameters). Nothing is measured;
    ``autockpt.measure_step`` does that.
    """
    if not isinstance(the_plan, Plan):
        raise TypeError(f"apply_plan expects an autockpt.Plan (autockpt.load_plan(path)), got {type(the_plan).__name__}")
    if isinstance(example_inputs, tuple) and not example_inputs and not example_kwargs:
        example_inputs, example_kwargs = recorded_inputs(model, the_plan)
    request = _Request.check(model, example_inputs, example_kwargs, None, None)
    args, kwargs = in_recorded_form(model, the_plan, request.args, request.kwargs)
    with preserved_model_state(model, args, kwargs):
        enter_training_modes(model)
        graph = capture(model, args, kwargs)
        check_fingerprint(the_plan, model_fingerprint(model, graph, args, kwargs), graph.units)
        module = rewrite(graph, the_plan.policy, args, kwargs, plan=the_plan)
    attach_shape_variants(module, graph, (args, kwargs))
    module.training = model.training
    module.strict = strict
    return module


class Planner:
    """Capture and trace a model once; then plan at any budget, score any regions, and apply plans.

        planner = autockpt.Planner(model, example_inputs=(x,))
        plans = [planner.plan(budget_gb=b) for b in (2, 4, 6)]      # one capture and trace for all
        module = planner.apply(plans[0])                            # rewrite, without measuring

    ``on_stage(name)`` is called as each stage starts ("capture", "profile", "solve", "rewrite", "measure"), for
    progress displays. The model is left as it was after every call (weights, buffers, gradients, RNG, modes).
    ``trace`` (what was measured) and ``costs`` (the actions' prices) may be replaced before the first plan, e.g. with
    modelled times in experiments.

    The budget is the device's: bytes on it that the step does not own (on CUDA everything else allocated: another
    model, a cache, leftovers, kernel workspaces; on CPU the tensors named by ``autockpt.measure.step.held_beside_step``)
    count. They are read again whenever a plan is solved (``foreign_bytes_now``), and the trace moves by the
    difference (``trace.foreign_bytes``, ``Plan.foreign_bytes``): a plan is for the device as it is when it is made.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        example_inputs: Any = (),
        example_kwargs: Mapping[str, Any] | None = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        solver_options: SolverOptions | None = None,
        checkpoint: Action | str | None = None,
        host_pool_gb: float | str = 0,
        on_stage: Callable[[str], None] | None = None,
        optimizer: OptimizerSpec | None = None,
        gradient_accumulation_steps: int = 1,
    ) -> None:
        self.request = _Request.check(model, example_inputs, example_kwargs, loss_fn, solver_options)
        self.gradient_accumulation_steps = check_accumulation_steps(gradient_accumulation_steps)
        self.optimizer = optimizer  # what measure_step copies to step the loop as it runs
        make_optimizer = optimizer_factory(model, optimizer) if optimizer is not None else None
        self.host_pool_bytes = host_pool_to_bytes(host_pool_gb)  # the most the plan's host pool may hold
        self.solver_options = self.request.solver_options or SolverOptions()
        # the checkpoint choice steers profiling and rewriting; SolverOptions(checkpoint=) is its older spelling
        choice = checkpoint if checkpoint is not None else self.solver_options.checkpoint
        self._on_stage = on_stage or (lambda stage: None)
        self._device = device_of(model, self.request.args, self.request.kwargs)
        with self._model_state():
            self._on_stage("capture")
            started = time.perf_counter()
            self.graph: Graph = capture(model, self.request.args, self.request.kwargs)
            captured = time.perf_counter()
            self._on_stage("profile")
            # the recompute actions plans are made for, in order of preference on a tie
            self.actions = recompute_actions(choice, self.graph.kind)
            self.trace = trace_step(
                self.graph, self.request.args, self.request.kwargs, self.request.loss,
                time_repeated_blocks_once=self._solves_by_blocks(),
                gradient_lifetimes=Action.RECOMPUTE_OWN in self.actions,
            )
            # what the trace counted beyond the step's own tensors (on CUDA: everything else allocated on the device)
            owned = owned_bytes(self._device, step_tensors(model, self.request.args, self.request.kwargs))
            self.trace = dataclasses.replace(self.trace, foreign_bytes=max(0, self.trace.events[0].start_bytes - owned))
            if make_optimizer is not None or self.gradient_accumulation_steps > 1:
                # the step as the loop runs it: what the loop keeps alive raises every event (``loop.py``)
                cost = measure_optimizer_step(make_optimizer, model, self._device) if make_optimizer else None
                loop = TrainingLoop(optimizer=cost, gradient_accumulation_steps=self.gradient_accumulation_steps)
                self.trace = step_in_loop(self.trace, loop)
                logger.info("%s", loop.describe())
            if self.host_pool_bytes > 0:
                self._check_offload_possible(host_pool_gb)
            offload = (Action.OFFLOAD,) if self.host_pool_bytes > 0 else ()
            self.costs = calibrate(self._device, (*self.actions, *offload))
        self.capture_time_s = captured - started
        self.profile_time_s = time.perf_counter() - captured
        # the device as the step will find it: profiling held copies of the buffers and the user's gradients aside
        self._follow_foreign_bytes()
        self.fingerprint = model_fingerprint(model, self.graph, self.request.args, self.request.kwargs)
        self._executable_used = False  # rewriting edits graph.executable; later rewrites capture again
        self._problems: dict[Action, Problem] = {}  # per action: scored candidates and floors, shared by every budget
        self._joint: dict[int, JointProblem] = {}  # per pool capacity: every recompute action's candidates and offload
        self._context: PlanningContext | None = None

    @property
    def model(self) -> nn.Module:
        return self.request.model

    @property
    def checkpoint_kinds(self) -> tuple[Action, ...]:
        """The recompute actions plans are made for (the name from before the actions)."""
        return self.actions

    def plan(self, budget_gb: float | None = None, *, budget_bytes: int | None = None, pareto_points: int = 0) -> Plan:
        """The cheapest plan under the budget (GB = 10^9 bytes). ``pareto_points`` > 0 also solves that many budgets
        from the smallest feasible peak to the unmodified peak and stores them in ``Plan.pareto``."""
        budget = budget_to_bytes(budget_gb, budget_bytes)
        results, solve_time_s = self._solve_each(budget)
        action = min(results, key=lambda a: results[a].timeline.overhead_ms)  # the first action on a tie
        if len(results) > 1:
            logger.info(
                "checkpoint: %s (predicted overhead %s)", action.value,
                ", ".join(f"{a.value} {r.timeline.overhead_ms:.2f} ms" for a, r in results.items()),
            )
        the_plan = self._plan_of(results[action], budget, solve_time_s)
        if pareto_points > 0:
            the_plan = dataclasses.replace(the_plan, pareto=self.pareto(pareto_budgets(the_plan, pareto_points)))
        return the_plan

    def pareto(self, budgets: Sequence[int]) -> tuple[ParetoPoint, ...]:
        """Predicted peak and overhead of the plan for each budget in bytes (None where it is infeasible)."""
        points = []
        for budget in budgets:
            try:
                results, _ = self._solve_each(int(budget))
            except InfeasibleBudgetError:
                points.append(
                    ParetoPoint(budget_bytes=int(budget), predicted_peak_bytes=None, predicted_overhead=None, regions=0)
                )
                continue
            result = min(results.values(), key=lambda r: r.timeline.overhead_ms)
            points.append(
                ParetoPoint(
                    budget_bytes=int(budget), predicted_peak_bytes=result.timeline.peak_bytes,
                    predicted_overhead=self.context.overhead(result.timeline.overhead_ms), regions=len(result.regions),
                )
            )
        return tuple(points)

    def plan_for_regions(self, regions: Sequence[Region], *, strategy: str, action: Action | None = None) -> Plan:
        """Score given regions (a baseline policy, a hand-made plan) with the same simulator as solved plans, under
        ``action`` (default: the first of the planner's actions, torch's checkpoint unless another was asked for).

        The plan's ``status`` is ``given`` and its budget is its own predicted peak.
        """
        action = action or self.actions[0]
        self._price(action)
        self._follow_foreign_bytes()
        ordered = region_actions(sorted(regions, key=lambda r: r.first_unit), action)
        timeline = simulate(self.trace, self.costs, ordered)
        return assemble_plan(self.context, ordered, action, timeline.peak_bytes, timeline, strategy=strategy)

    def structural_plan(self, strategy: str) -> Plan | None:
        """``baseline_plan(self, strategy)`` when the graph has what it needs (repeated blocks for ``every_k``) and it
        checkpoints something, else None."""
        try:
            the_plan = baseline_plan(self, strategy)
        except ValueError as unavailable:
            logger.info("no %s plan: %s", strategy, unavailable)
            return None
        return the_plan if the_plan.regions else None

    def apply(self, the_plan: Plan) -> OptimizedModule:
        """Rewrite the model to run ``the_plan`` (made by this planner, or loaded from a file); nothing is measured.

        A plan whose fingerprint does not match this model and these inputs is refused (``PlanMismatchError``).
        """
        check_fingerprint(the_plan, self.fingerprint, self.graph.units)
        self._on_stage("rewrite")
        with self._model_state():
            graph = self._fresh_graph()
            module = rewrite(graph, the_plan.policy, self.request.args, self.request.kwargs, plan=the_plan)
        attach_shape_variants(module, graph, (self.request.args, self.request.kwargs))
        module.training = self.model.training
        return module

    def optimize(self, budget_gb: float | None = None, *, budget_bytes: int | None = None) -> OptimizedModule:
        """Plan, rewrite, measure one real step; tighten by the overshoot while the measured peak is over budget.

        When plans are made for more than one recompute action ("auto") and more than one keeps the budget when
        measured, their steps are timed against each other and the faster is returned (``Plan.notes`` says by how
        much): the predicted overheads of the actions are too close for their errors on some devices.
        """
        return verified_module(self, budget_to_bytes(budget_gb, budget_bytes))

    # -------------------------------------------------------------------------------- what verify.py calls

    def plans_under(self, target_bytes: int, budget_bytes: int) -> list[Plan]:
        """One plan per action with a plan predicted under ``target_bytes``, recorded as made for ``budget_bytes``."""
        results, solve_time_s = self._solve_each(target_bytes)
        return [self._plan_of(result, budget_bytes, solve_time_s) for result in results.values()]

    def measured_peak_bytes(self, module: OptimizedModule) -> int:
        return self.measure(module).peak_bytes

    def measure(self, module: OptimizedModule) -> StepMeasurement:
        """One real step of ``module`` as the plan's loop runs it (``autockpt.measure_step``), the model's state put
        back afterwards."""
        self._on_stage("measure")
        with self._model_state():
            module.training = True  # the module follows the user's train/eval flag, restored after measuring
            measurement = measure_step(
                module, self.request.args, self.request.kwargs, self.request.loss, optimizer=self.optimizer,
                gradient_accumulation_steps=self.gradient_accumulation_steps,
            )
        module.training = self.model.training
        return measurement

    def measure_compiled(self, compiled: nn.Module, module: OptimizedModule) -> StepMeasurement:
        """One step of ``compiled`` (``torch.compile`` of ``module``) as it runs compiled, after a first step that
        compiles it (``autockpt.measure.step.measure_compiled_step``), the model's state put back afterwards."""
        self._on_stage("measure")
        with self._model_state():
            module.training = True
            for param in self.model.parameters():
                param.grad = None
            self.request.loss(compiled(*self.request.args, **self.request.kwargs)).backward()  # compiles
            measurement = measure_compiled_step(
                compiled, self.request.args, self.request.kwargs, self.request.loss, static_from=module,
                optimizer=self.optimizer, gradient_accumulation_steps=self.gradient_accumulation_steps,
            )
        module.training = self.model.training
        return measurement

    def foreign_bytes_now(self) -> int:
        """Bytes on the model's device now that the step does not own (``autockpt.measure.step.foreign_bytes``): on
        CUDA what is allocated beyond the model's parameters, buffers, gradients and the example inputs; on CPU the
        tensors named by ``autockpt.measure.step.held_beside_step``."""
        return foreign_bytes(self._device, step_tensors(self.model, self.request.args, self.request.kwargs))

    def alternating_step_seconds(self, modules: Sequence[nn.Module]) -> list[list[float]]:
        """Each module's training step timed in alternating rounds (``autockpt.measure.step.alternating_step_seconds``),
        in train mode whatever mode the model is in (an optimized module in eval mode runs the original model), the
        model's state and each module's mode put back afterwards."""
        self._on_stage("measure")
        optimized = [getattr(module, "_orig_mod", module) for module in modules]  # torch.compile's wrapper: its module
        modes = [module.training for module in optimized]
        with self._model_state():
            for module in optimized:
                module.training = True  # an OptimizedModule's own flag: its submodules are the model's
            try:
                return alternating_step_seconds(modules, self.request.args, self.request.kwargs, self.request.loss)
            finally:
                for module, mode in zip(optimized, modes):
                    module.training = mode

    # ------------------------------------------------------------------------------------------- internals

    @property
    def context(self) -> PlanningContext:
        """What every plan shares; made at the first plan, so that ``trace`` and ``costs`` may be replaced before."""
        if self._context is None or self._context.trace is not self.trace or self._context.costs is not self.costs:
            self._problems.clear()
            self._joint.clear()
            self._context = PlanningContext(
                graph=self.graph, trace=self.trace, costs=self.costs,
                placement=Placement.single_device(len(self.graph.units), str(self._device)),
                fingerprint=self.fingerprint, capture_time_s=self.capture_time_s, profile_time_s=self.profile_time_s,
                memory_before=memory_curve(self.trace, self.costs, ()),
            )
        return self._context

    def _plan_of(self, result: SolveResult, budget_bytes: int, solve_time_s: float) -> Plan:
        return assemble_plan(
            self.context, result.region_actions, result.action, budget_bytes, result.timeline, result=result,
            solve_time_s=solve_time_s,
        )

    @contextlib.contextmanager
    def _model_state(self) -> Iterator[None]:
        with preserved_model_state(self.model, self.request.args, self.request.kwargs):
            enter_training_modes(self.model)
            yield

    def _fresh_graph(self) -> Graph:
        """The traced graph the first time; a new capture afterwards (rewriting edits the executable in place)."""
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
        return self.solver_options.repeated_blocks and self.graph.kind is not CaptureKind.MODULE

    def _solve_each(self, target_bytes: int) -> tuple[dict[Action, SolveResult], float]:
        """Per action with a plan under ``target_bytes``: its cheapest plan, and the seconds all of it took
        (preparing each action's problem the first time, floors, every action's solve). With a host pool, one joint
        plan (each region its own action), keyed by the action of its recompute-only rival. Each result's
        ``min_feasible_bytes`` is the lowest over all actions; raises ``InfeasibleBudgetError`` when no action has
        a plan. The device bytes the step does not own are read again first: the plan is for the device as it is."""
        self._on_stage("solve")
        started = time.perf_counter()
        self._follow_foreign_bytes()
        context = self.context
        results: dict[Action, SolveResult] = {}
        infeasible: list[InfeasibleBudgetError] = []
        solves = (
            [functools.partial(solve_joint, self._joint_for(self.host_pool_bytes))] if self.host_pool_bytes > 0
            else [functools.partial(solve_prepared, self._problem_for(action, context)) for action in self.actions]
        )
        for solve in solves:
            try:
                result = solve(target_bytes, self.solver_options)
                results[result.action] = result
            except InfeasibleBudgetError as error:
                infeasible.append(error)
        if not results:
            lowest = min(infeasible, key=lambda error: error.min_feasible_bytes)  # the action that gets lowest
            raise self._with_pool_needed(lowest, target_bytes)
        floor = min([r.min_feasible_bytes for r in results.values()] + [e.min_feasible_bytes for e in infeasible])
        complete = all(r.floor_complete for r in results.values())  # an infeasible action ran the full search
        for action, result in results.items():
            results[action] = dataclasses.replace(result, min_feasible_bytes=floor, floor_complete=complete)
            logger.info(
                "plan (%s): %s, %d regions, predicted peak %d bytes (target %d), solve %.1fs", action.value,
                result.status.value, len(result.regions), result.timeline.peak_bytes, target_bytes, result.solve_time_s,
            )
        return results, time.perf_counter() - started

    def _follow_foreign_bytes(self) -> None:
        """Move the trace to the device bytes the step does not own now (``loop.with_foreign_bytes``: every event by
        the difference, as the loop's optimizer states raise them); the prepared problems are made again when it
        moved."""
        now = self.foreign_bytes_now()
        if now != self.trace.foreign_bytes:
            logger.info(
                "device bytes the step does not own: %d counted by the trace, %d now; planning for %d",
                self.trace.foreign_bytes, now, now,
            )
            self.trace = with_foreign_bytes(self.trace, now)

    def _price(self, action: Action) -> None:
        """Calibrate ``action`` when the cost model has no price for it (offload, for a planner made without a pool).
        The problems prepared so far stay: the prices they use are unchanged."""
        if action in self.costs.actions:
            return
        self.costs = calibrate(self._device, (*self.costs.actions, action))
        if self._context is not None:
            self._context = dataclasses.replace(self._context, costs=self.costs)

    def _joint_for(self, pool_capacity_bytes: int) -> JointProblem:
        """The joint problem over every recompute action planned for (each region its own) and offload."""
        if pool_capacity_bytes not in self._joint:
            context = self.context
            self._joint[pool_capacity_bytes] = JointProblem(
                tuple(self._problem_for(a, context) for a in self.actions), self._problem_for(Action.OFFLOAD, context),
                pool_capacity_bytes,
            )
        return self._joint[pool_capacity_bytes]

    def _check_offload_possible(self, host_pool_gb: float | str) -> None:
        if self.graph.kind is CaptureKind.MODULE:
            raise ValueError(
                f"host_pool_gb={host_pool_gb!r}: offloading needs a graph capture, but {type(self.model).__name__} "
                f"fell to the module-level capture ({self.graph.notes[0] if self.graph.notes else 'no graph'}); "
                "plan it without a pool (host_pool_gb=0), which recomputes only"
            )

    def _with_pool_needed(self, error: InfeasibleBudgetError, target_bytes: int) -> InfeasibleBudgetError:
        """``error``, saying which host pool would make ``target_bytes`` feasible when a pool (or a larger one) would
        (found by planning with a pool that holds every offload candidate; nothing changes when none would)."""
        if self.graph.kind is CaptureKind.MODULE or target_bytes < self.trace.static_bytes:
            return error
        self._price(Action.OFFLOAD)
        self._on_stage("solve")
        joint = unbounded_pool(self._joint_for(self.host_pool_bytes))
        if joint.pool_capacity_bytes <= self.host_pool_bytes:
            return error
        try:
            needed = solve_joint(joint, target_bytes, self.solver_options).timeline.host_pool_bytes
        except InfeasibleBudgetError:
            return error
        pool_gb = math.ceil(needed / GB * 1000) / 1000
        return InfeasibleBudgetError(
            f"{error} A host pool makes it feasible: with host_pool_gb={pool_gb} ({format_bytes(needed)}), the plan "
            f"offloads saved tensors to host memory instead.",
            budget_bytes=error.budget_bytes, min_feasible_bytes=error.min_feasible_bytes, host_pool_bytes_needed=needed,
        )

    def _problem_for(self, action: Action, context: PlanningContext) -> Problem:
        if action not in self._problems:
            structure = find_repeated_blocks(self.graph, self.trace) if self._solves_by_blocks() else None
            self._problems[action] = prepare(
                self.trace, self.costs, action, *candidate_regions(self.graph, self.trace),
                seed_plans=baseline_seed_plans(self.graph, self.trace), structure=structure,
            )
        return self._problems[action]


def host_pool_to_bytes(host_pool_gb: Any) -> int:
    """Check the host pool argument (GB = 10^9 bytes, or "auto": half of the host memory available now)."""
    if host_pool_gb == "auto":
        return available_host_bytes() // 2
    if isinstance(host_pool_gb, bool) or not isinstance(host_pool_gb, numbers.Real) or not math.isfinite(host_pool_gb) \
            or host_pool_gb < 0:
        raise ValueError(
            f"host_pool_gb must be a number of GB (10^9 bytes) >= 0 or 'auto', got {describe_value(host_pool_gb)}; "
            "0 (the default) offloads nothing"
        )
    return int(float(host_pool_gb) * GB)


def baseline_plan(planner: Planner, strategy: str, *, action: Action | None = None) -> Plan:
    """Score ``strategy``'s regions with the planner's simulator: a Plan with status ``given``.

    Raises ``ValueError`` when the policy cannot be expressed on this graph (e.g. ``sqrt_n`` on a module-level
    capture); the message says why.
    """
    chosen = baseline_regions(planner.graph, planner.trace, strategy)
    if not chosen.available:
        raise ValueError(f"baseline {strategy!r} on {type(planner.model).__name__}: {'; '.join(chosen.notes)}")
    the_plan = planner.plan_for_regions(chosen.regions, strategy=strategy, action=action)
    notes = tuple(f"{strategy}: {note}" for note in chosen.notes)
    return dataclasses.replace(the_plan, notes=the_plan.notes + notes)


def pareto_budgets(the_plan: Plan, points: int) -> list[int]:
    """``points`` budgets evenly spaced from the smallest feasible peak to the unmodified peak (both included)."""
    low, high = the_plan.min_feasible_bytes, the_plan.baseline_peak_bytes
    if points == 1 or high <= low:
        return [low]
    return [int(round(low + (high - low) * i / (points - 1))) for i in range(points)]


def get_plan(module: nn.Module) -> Plan:
    """The Plan behind a module returned by ``autockpt.optimize`` (also when ``torch.compile`` wraps it)."""
    module = getattr(module, "_orig_mod", module)  # torch.compile's wrapper: the module it compiled
    if not isinstance(module, OptimizedModule):
        raise TypeError(
            f"get_plan expects a module returned by autockpt.optimize, got {type(module).__name__}. "
            "Call autockpt.optimize(model, ...) first, or autockpt.plan(...) to get a Plan without rewriting."
        )
    return module.plan


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
            model=model, args=args, kwargs=kwargs, loss=checked_loss(loss_fn or default_loss), solver_options=solver_options
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
