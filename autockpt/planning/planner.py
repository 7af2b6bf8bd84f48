"""Planner: plans a captured, traced step at any budget from values (graph, step trace, action prices, options),
scores given regions, and rewrites and measures the model for the entry points (``api.py``).

``Planner(graph, trace, costs, options, step=...)`` is the planner over values: where the trace came from (a real
step, fake tensors, a roofline) is the trace source's business (``measure/sources.py``), and the solvers and the
rewriter see only the values. ``Planner.from_model(model, ...)`` captures, traces (``MeasuredTrace`` by default) and
prices the actions on the model's device, then builds it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn

from autockpt.core.devices import DeviceSpec
from autockpt.core.simulate import memory_curve, simulate
from autockpt.core.solve.base import Problem, SolveResult, recompute_actions, region_actions
from autockpt.core.solve.baselines import baseline_regions
from autockpt.core.solve.joint import JointProblem
from autockpt.errors import InfeasibleBudgetError
from autockpt.measure.chunked_tail import captured_program, copied_graph
from autockpt.measure.loop import with_foreign_bytes
from autockpt.measure.sources import StepInputs
from autockpt.measure.step import (
    StepMeasurement,
    alternating_step_seconds,
    foreign_bytes,
    measure_compiled_step,
    measure_step,
)
from autockpt.measure.trace import step_tensors
from autockpt.planning import loss_chunks, solving
from autockpt.planning.build import BuiltStep, built_step, refuse_offload, solves_by_blocks
from autockpt.planning.courses import with_other_courses
from autockpt.planning.options import (
    PlanOptions,
    budget_to_bytes,
    checkpoint_choice,
    pareto_budgets,
    pool_bytes_of,
    resolve_options,
)
from autockpt.planning.policy import PlanningContext, assemble_plan
from autockpt.planning.shapes import attach_shape_variants
from autockpt.planning.verify import verified_module
from autockpt.record_types import ParetoPoint, Provenance
from autockpt.records.fingerprint import check_fingerprint, model_fingerprint
from autockpt.records.plan import Plan
from autockpt.runtime.model_state import enter_training_modes, preserved_model_state
from autockpt.runtime.offload import available_host_bytes
from autockpt.runtime.rewrite import OptimizedModule, rewrite
from autockpt.types import (
    Action,
    CaptureKind,
    CostModel,
    Graph,
    Placement,
    Region,
    StepTrace,
    describe_value,
)

logger = logging.getLogger(__name__)

class Planner:
    """Plan one training step at any budget; score any regions; apply plans.

        planner = autockpt.Planner.from_model(model, example_inputs=(x,))   # capture, trace and price once
        plans = [planner.plan(budget_gb=b) for b in (2, 4, 6)]              # then plan at any budget
        module = planner.apply(plans[0])                                    # rewrite, without measuring

        planner = autockpt.Planner(graph, trace, costs, options, step=step) # the same, from values

    ``step`` (``StepInputs``: the model, example call and loss the graph was captured on) is what the plan's
    fingerprint, the rewrite and a measured step read. ``on_stage(name)`` is called as each stage starts ("capture",
    "profile", "solve", "rewrite", "measure"), for progress displays. The model is left as it was after every call
    (weights, buffers, gradients, RNG, modes). ``trace`` and ``costs`` may be replaced before a plan (the problems
    derived from them are made again).

    The budget is the device's: bytes on it that the step does not own (on CUDA everything else allocated: another
    model, a cache, leftovers, kernel workspaces; on CPU the tensors named by ``autockpt.measure.step.held_beside_step``)
    count. They are read again whenever a plan is solved (``foreign_bytes_now``), and the trace moves by the
    difference (``trace.foreign_bytes``, ``Plan.foreign_bytes``): a plan is for the device as it is when it is made.
    """

    def __init__(
        self,
        graph: Graph,
        trace: StepTrace | None = None,
        costs: CostModel | None = None,
        options: PlanOptions | None = None,
        *,
        step: StepInputs | None = None,
        on_stage: Callable[[str], None] | None = None,
        capture_time_s: float = 0.0,
        profile_time_s: float = 0.0,
        notes: tuple[str, ...] = (),
        provenance: Provenance | None = None,
        **unexpected: Any,
    ) -> None:
        if isinstance(graph, nn.Module):  # the 0.1 call, removed in 0.3
            raise TypeError(
                f"Planner({type(graph).__name__}(...), ...) was removed in 0.3: a Planner is made from captured values "
                "(Planner(graph, trace, costs, options, step=...)); to plan a model, use "
                "autockpt.Planner.from_model(model, example_inputs=...)"
            )
        if unexpected:
            raise TypeError(f"Planner() got unexpected keyword arguments {sorted(unexpected)}")
        if not isinstance(graph, Graph) or not isinstance(trace, StepTrace) or not isinstance(costs, CostModel):
            raise TypeError(
                "Planner(graph, trace, costs, options, step=...) takes a captured Graph, a StepTrace and a CostModel, "
                f"got {type(graph).__name__}, {type(trace).__name__}, {type(costs).__name__}; to plan a model, use "
                "autockpt.Planner.from_model(model, example_inputs=...)"
            )
        if not isinstance(step, StepInputs):
            raise TypeError(
                f"step must be the StepInputs the graph was captured on (StepInputs.check(model, example_inputs, "
                f"example_kwargs, loss_fn)), got {describe_value(step)}"
            )
        self.options = options if options is not None else PlanOptions()
        self.request = step
        self.graph = graph
        self.trace = trace
        self.costs = costs
        self.capture_time_s, self.profile_time_s = capture_time_s, profile_time_s
        self.notes = tuple(notes)  # every plan carries them (from_model: how the times were made)
        self.provenance = provenance  # which trace and timing, for which device: every plan records it
        self.target: DeviceSpec | None = None  # from_model's target: the device planned for (roofline timing)
        self.example_values = True  # False: made from a meta model or meta/fake inputs: no real step can be measured
        self.gradient_accumulation_steps = self.options.gradient_accumulation_steps
        self.optimizer = self.options.optimizer  # what measure_step copies to step the loop as it runs
        self.host_pool_bytes = pool_bytes_of(self.options.host_pool_gb, available_host_bytes)
        self.solver_options = self.options.solver
        # the recompute actions plans are made for, in order of preference on a tie
        self.actions = recompute_actions(checkpoint_choice(self.options), graph.kind)
        self._on_stage = on_stage or (lambda stage: None)
        # a model on the meta device is planned for the CPU, where its fake step ran and actions are priced
        self._device = torch.device("cpu") if step.device.type == "meta" else step.device
        if self.host_pool_bytes > 0:
            self._check_offload_possible(self.options.host_pool_gb)
        # the device as the step will find it: profiling held copies of the buffers and the user's gradients aside
        self._follow_foreign_bytes()
        self.fingerprint = model_fingerprint(step.model, graph, step.args, step.kwargs)
        # rewriting edits an executable in place: each rewrite takes a copy of graph.executable (or, for a capture
        # per module call, which has no fx graph, the graph the first time and a new capture afterwards)
        self._executable_used = False
        self._problems: dict[Action, Problem] = {}  # per action: scored candidates and floors, shared by every budget
        self._joint: dict[int, JointProblem] = {}  # per pool capacity: every recompute action's candidates and offload
        self._context: PlanningContext | None = None
        # the program this planner plans: the loss in chunks of this many tokens (0: as captured); the chunked
        # programs it weighs besides its own (``loss_chunks.py``; from_model sets them)
        self.loss_chunk_tokens = 0
        self.loss_programs: loss_chunks.LossPrograms | None = None

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        *,
        example_inputs: Any = (),
        example_kwargs: Any = None,
        loss_fn: Callable[[Any], Any] | None = None,
        options: PlanOptions | None = None,
        on_stage: Callable[[str], None] | None = None,
        **option_keywords: Any,
    ) -> Planner:
        """Capture ``model`` on the example call, trace the step and price the actions; then plan from those values
        (``build.py``). Options: ``options=PlanOptions(...)`` or its fields as keyword arguments (``PlanOptions``);
        ``trace_source=`` is ``trace``'s older spelling.

        ``trace``: "measured" runs the unmodified step on the model's device; "fake" runs it on fake tensors (no real
        step, exact memory; a model on the meta device stays there); "auto" (default) is fake when the model or
        inputs are on the meta device or when the fake trace predicts the unmodified step above the device memory,
        measured otherwise; or a ``TraceSource``. ``device_memory_bytes``: the memory of the device planned for
        (default: the target's; on CUDA the free memory plus what the step's tensors hold); it is ``plan()``'s budget
        when none is given.

        ``timing`` ("auto", "measured", "benchmark", "roofline", or a ``measure.timing.Timing``) gives the trace its
        times, for ``target`` (a table name such as "h100-sxm-80gb" or an ``autockpt.DeviceSpec``; None: the model's
        device). "auto": measured with a measured trace, benchmark (each op alone on the local device) with a fake
        one, roofline for a target. The plans record which trace and timing made them (``Plan.provenance``)."""
        options = resolve_options(options, option_keywords, entry_point="Planner.from_model")
        step = StepInputs.check(model, example_inputs, example_kwargs, loss_fn)
        built = built_step(step, options, on_stage=on_stage)
        return loss_chunks.planner_of_programs(
            built, options, lambda made, chunk_tokens: cls._of_built(made, options, on_stage, chunk_tokens),
            loss_outside=loss_fn is not None, on_stage=on_stage,
        )

    @classmethod
    def _of_built(
        cls, built: BuiltStep, options: PlanOptions, on_stage: Callable[[str], None] | None, chunk_tokens: int,
    ) -> Planner:
        planner = cls(
            built.graph, built.trace, built.costs, options, step=built.step, on_stage=on_stage, notes=built.notes,
            capture_time_s=built.capture_time_s, profile_time_s=built.profile_time_s, provenance=built.provenance,
        )
        planner.target, planner.example_values = built.target, built.example_values
        planner.loss_chunk_tokens = chunk_tokens
        return planner

    @property
    def device_memory_bytes(self) -> int | None:
        """The memory of the device planned for (``Plan.provenance``), when known."""
        return self.provenance.device_memory_bytes if self.provenance is not None else None

    @property
    def model(self) -> nn.Module:
        return self.request.model

    def plan(self, budget_gb: float | None = None, *, budget_bytes: int | None = None, pareto_points: int = 0) -> Plan:
        """The cheapest plan under the budget (GB = 10^9 bytes). ``pareto_points`` > 0 also solves that many budgets
        from the smallest feasible peak to the unmodified peak and stores them in ``Plan.pareto``. Without a budget,
        the memory of the device the planner was made for (``from_model(target=..., device_memory_bytes=...)``)."""
        if budget_gb is None and budget_bytes is None and self.device_memory_bytes is not None:
            budget_bytes = self.device_memory_bytes
        budget = budget_to_bytes(budget_gb, budget_bytes)
        if loss_chunks.weighs(self, budget):
            the_plan = loss_chunks.chosen(self, budget, lambda program: [program.own_plan(budget, pool_hint=False)])[0]
        else:
            the_plan = self.own_plan(budget)
        if pareto_points > 0:
            the_plan = dataclasses.replace(the_plan, pareto=self.pareto(pareto_budgets(the_plan, pareto_points)))
        return the_plan

    def own_plan(self, budget_bytes: int, *, pool_hint: bool = True) -> Plan:
        """The cheapest plan of this planner's own program (no other loss chunking weighed) under the budget
        (``pool_hint``: ``solving.solve_each``'s)."""
        results, solve_time_s = solving.solve_each(self, budget_bytes, pool_hint=pool_hint)
        action = min(results, key=lambda a: results[a].timeline.overhead_ms)  # the first action on a tie
        if len(results) > 1:
            logger.info(
                "checkpoint: %s (predicted overhead %s)", action.value,
                ", ".join(f"{a.value} {r.timeline.overhead_ms:.2f} ms" for a, r in results.items()),
            )
        return self._plan_of(results[action], budget_bytes, solve_time_s)

    def pareto(self, budgets: Sequence[int]) -> tuple[ParetoPoint, ...]:
        """Predicted peak and overhead of the plan for each budget in bytes (None where it is infeasible): the plan
        ``plan`` returns there, the loss's chunked programs weighed as it weighs them."""
        points = []
        for budget in map(int, budgets):
            try:
                the_plan = self.plan(budget_bytes=budget)
            except InfeasibleBudgetError:
                points.append(ParetoPoint(budget_bytes=budget, predicted_peak_bytes=None, predicted_overhead=None,
                                          regions=0))
                continue
            points.append(ParetoPoint(
                budget_bytes=budget, predicted_peak_bytes=the_plan.predicted_peak_bytes,
                predicted_overhead=the_plan.predicted_overhead, regions=len(the_plan.regions),
            ))
        return tuple(points)

    def plan_for_regions(self, regions: Sequence[Region], *, strategy: str, action: Action | None = None) -> Plan:
        """Score given regions (a baseline policy, a hand-made plan) with the same simulator as solved plans, under
        ``action`` (default: the first of the planner's actions, torch's checkpoint unless another was asked for).

        The plan's ``status`` is ``given`` and its budget is its own predicted peak.
        """
        action = action or self.actions[0]
        solving.price(self, action)
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
        chunk_tokens = the_plan.loss_chunk_tokens
        if chunk_tokens != self.loss_chunk_tokens and self.loss_programs is not None and (
            chunk_tokens in self.loss_programs.chunk_tokens
        ):
            return self.loss_programs.planner(chunk_tokens).apply(the_plan)  # the planner of that program
        with self._model_state():
            if chunk_tokens == self.loss_chunk_tokens:
                check_fingerprint(the_plan, self.fingerprint, self.graph.units)
                graph = self._fresh_graph()
            else:  # a program of the loss this planner does not weigh (a plan file's): made as apply_plan makes it
                graph = captured_program(self.model, self.request.args, self.request.kwargs, chunk_tokens)
                fingerprint = model_fingerprint(self.model, graph, self.request.args, self.request.kwargs)
                check_fingerprint(the_plan, fingerprint, graph.units)
            self._on_stage("rewrite")
            module = rewrite(graph, the_plan.policy, self.request.args, self.request.kwargs, plan=the_plan)
        attach_shape_variants(module, graph, (self.request.args, self.request.kwargs))
        module.training = self.model.training
        return module

    def optimize(self, budget_gb: float | None = None, *, budget_bytes: int | None = None) -> OptimizedModule:
        """Plan, rewrite, measure one real step; tighten by the overshoot while the measured peak is over budget.

        When plans are made for more than one recompute action ("auto") and more than one keeps the budget when
        measured, their steps are timed against each other and the faster is returned (``Plan.notes`` says by how
        much): the predicted overheads of the actions are too close for their errors on some devices. The module
        is ``strict`` as ``options.strict`` says; ``options.compiled`` is ``autockpt.optimize``'s (it compiles).
        """
        if self.options.compiled is not False:
            raise ValueError(
                f"Planner.optimize does not compile (options.compiled={self.options.compiled!r}); use "
                "autockpt.optimize(model, ..., compiled=True), which measures the compiled step"
            )
        if not self.example_values:
            raise ValueError(
                f"Planner.optimize measures the optimized step, but this planner was made from a model or example "
                f"inputs without values (meta device or fake tensors): {type(self.model).__name__} has no step to "
                "measure. Use planner.plan(...) and save it, then autockpt.apply_plan on the real model and inputs"
            )
        if budget_gb is None and budget_bytes is None and self.device_memory_bytes is not None:
            budget_bytes = self.device_memory_bytes
        module = verified_module(self, budget_to_bytes(budget_gb, budget_bytes))
        module.strict = self.options.strict
        return with_other_courses(module, self)

    # -------------------------------------------------------------------------------- what verify.py calls

    def plans_under(self, target_bytes: int, budget_bytes: int) -> list[Plan]:
        """One plan per action with a plan predicted under ``target_bytes``, recorded as made for ``budget_bytes``, of
        the program (the loss as captured or in chunks: ``loss_chunks.chosen``) predicted fastest."""
        if loss_chunks.weighs(self, target_bytes):
            return loss_chunks.chosen(
                self, target_bytes, lambda program: program.own_plans_under(target_bytes, budget_bytes, pool_hint=False))
        return self.own_plans_under(target_bytes, budget_bytes)

    def own_plans_under(self, target_bytes: int, budget_bytes: int, *, pool_hint: bool = True) -> list[Plan]:
        results, solve_time_s = solving.solve_each(self, target_bytes, pool_hint=pool_hint)
        return [self._plan_of(result, budget_bytes, solve_time_s) for result in results.values()]

    def floor_plans(self, floor_bytes: int, budget_bytes: int) -> list[Plan]:
        """The floor's own plans, chosen by bytes alone (``solving.floor_plans``): what a refusal measures to state
        its smallest budget and what verification tries last. Those of the program with the lowest floor."""
        program = loss_chunks.lowest_floor_program(self)
        plans = solving.floor_plans(program, floor_bytes, budget_bytes)
        if program is self:
            return plans
        return [loss_chunks.as_planned_by(self, the_plan, program.loss_chunk_tokens) for the_plan in plans]

    def measured_peak_bytes(self, module: OptimizedModule) -> int:
        return self.measure(module).peak_bytes

    def measure(self, module: OptimizedModule) -> StepMeasurement:
        """One real step of ``module`` as the plan's loop runs it (``autockpt.measure_step``), the model's state put
        back afterwards."""
        self._on_stage("measure")
        with self._model_state():
            module.training = True  # the module follows the user's train/eval flag, restored after measuring
            measurement = measure_step(module, **self._measured_step())
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
            measurement = measure_compiled_step(compiled, static_from=module, **self._measured_step())
        module.training = self.model.training
        return measurement

    def _measured_step(self) -> dict[str, Any]:
        """The example step in the plan's loop, as ``measure_step`` and ``measure_compiled_step`` take it."""
        return {"example_inputs": self.request.args, "example_kwargs": self.request.kwargs, "loss_fn": self.request.loss,
                "optimizer": self.optimizer, "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "output_held": self.options.output_held}

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
                memory_before=memory_curve(self.trace, self.costs, ()), notes=self.notes, provenance=self.provenance,
                loss_chunk_tokens=self.loss_chunk_tokens,
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
        """The traced graph with an executable of its own (the fx graph copied, the parameters shared): rewriting
        edits the executable in place, and ``self.graph`` stays the captured program for every later plan, rewrite
        and trace of it (a new capture would cost the seconds an export takes). An executable that is no fx graph is
        the traced graph's the first time, and a new capture's afterwards."""
        if isinstance(self.graph.executable, fx.GraphModule):
            return copied_graph(self.graph)
        if not self._executable_used:
            self._executable_used = True
            return self.graph
        graph = captured_program(self.model, self.request.args, self.request.kwargs, self.loss_chunk_tokens)
        if len(graph.units) != len(self.graph.units):
            raise RuntimeError(
                f"capturing {type(self.model).__name__} a second time gave {len(graph.units)} units instead "
                f"of {len(self.graph.units)} (the model's forward is not deterministic?); create a new Planner, or "
                "use autockpt.plan to inspect the first plan"
            )
        return graph

    def _solves_by_blocks(self) -> bool:
        return solves_by_blocks(self.options, self.graph)

    def _follow_foreign_bytes(self) -> None:
        """Move the trace to the device bytes the step does not own now (``loop.with_foreign_bytes``: every event by
        the difference, as the loop's optimizer states raise them); the prepared problems are made again if it moved."""
        now = self.foreign_bytes_now()
        if now != self.trace.foreign_bytes:
            logger.info(
                "device bytes the step does not own: %d counted by the trace, %d now; planning for %d",
                self.trace.foreign_bytes, now, now,
            )
            self.trace = with_foreign_bytes(self.trace, now)

    def _check_offload_possible(self, host_pool_gb: float | str) -> None:
        if self.graph.kind is CaptureKind.MODULE:
            refuse_offload(host_pool_gb, self.model, self.graph)


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
