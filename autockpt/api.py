"""The public entry points: optimize, plan, get_plan. Validates input, runs the stages, assembles the Plan."""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autockpt._state import preserved_model_state
from autockpt.capture import capture
from autockpt.profile import profile
from autockpt.rewrite import OptimizedModule, rewrite
from autockpt.solve.candidates import candidate_regions
from autockpt.solve.ilp import SolverOptions, solve
from autockpt.simulate import unit_regions
from autockpt.errors import InfeasibleBudgetError
from autockpt.measure import measure_step
from autockpt.report import GB, format_bytes
from autockpt.types import Decision, Graph, NodePlan, Plan, PlanStatus, Profile, describe_value

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
) -> nn.Module:
    """Return a module that trains like ``model`` with a step peak of at most the budget (GB = 10^9 bytes).

    The returned module shares ``model``'s parameters and buffers (same ``state_dict`` keys) and returns the same
    outputs and gradients. Before returning, one real training step on the example inputs is measured; if it went
    over the budget, the plan is tightened by the overshoot and checked again. ``autockpt.get_plan(result)`` tells
    what was decided and what was measured.
    """
    request = _Request.check(model, budget_gb, budget_bytes, example_inputs, example_kwargs, loss_fn, solver_options)
    with preserved_model_state(model, request.args, request.kwargs):
        model.train()
        module = _optimize_and_verify(request)
    module.training = model.training  # the module mirrors the model's mode, which the context just restored
    return module


def _optimize_and_verify(request: _Request) -> OptimizedModule:
    """Plan, rewrite, measure one real step; tighten by the overshoot while the measured peak is over budget."""
    graph, measured, timings = _capture_and_profile(request)
    target = request.budget
    tightenings: list[str] = []
    for attempt in range(_VERIFY_ATTEMPTS):
        if attempt > 0:
            graph = capture(request.model, request.args, request.kwargs)  # the previous executable was rewritten
            if len(graph.units) != len(measured.units):
                raise RuntimeError(
                    f"capturing {type(request.model).__name__} a second time gave {len(graph.units)} units instead "
                    f"of {len(measured.units)} (the model's forward is not deterministic?); call optimize again, or "
                    "use autockpt.plan to inspect the first plan"
                )
        try:
            the_plan = _solve_plan(request, graph, measured, timings, target)
        except InfeasibleBudgetError as error:
            if attempt == 0:
                raise
            raise InfeasibleBudgetError(
                f"the budget {format_bytes(request.budget)} was not kept when measured ({tightenings[-1]} bytes) "
                f"and no tighter plan exists (smallest predicted peak {error.min_feasible_bytes} bytes). Use a "
                f"budget of at least {peak} bytes (the measured peak) or a smaller batch.",
                budget_bytes=request.budget,
                min_feasible_bytes=peak,
            ) from error
        module = rewrite(graph, the_plan, request.args, request.kwargs)
        if the_plan.status is PlanStatus.IDENTITY:
            return module
        peak = measure_step(module, request.args, request.kwargs, request.loss).peak_bytes
        module.set_plan(dataclasses.replace(the_plan, budget_bytes=request.budget, measured_peak_bytes=peak))
        if peak <= request.budget:
            return module
        tightenings.append(f"predicted {the_plan.predicted_peak_bytes}, measured {peak}")
        logger.info("measured peak %d bytes is over the budget %d; tightening the plan", peak, request.budget)
        target -= peak - request.budget + max(1, request.budget // 1000)
    raise InfeasibleBudgetError(
        f"the budget {format_bytes(request.budget)} was not kept when measured after {_VERIFY_ATTEMPTS} plans "
        f"(bytes: {'; '.join(tightenings)}). Use a budget of at least {peak} bytes (the last measured peak) or a "
        "smaller batch.",
        budget_bytes=request.budget,
        min_feasible_bytes=peak,
    )


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
    """Like ``optimize`` but only plans (no rewrite, no verification step): returns the Plan."""
    request = _Request.check(model, budget_gb, budget_bytes, example_inputs, example_kwargs, loss_fn, solver_options)
    with preserved_model_state(model, request.args, request.kwargs):
        model.train()
        graph, measured, timings = _capture_and_profile(request)
    return _solve_plan(request, graph, measured, timings, request.budget)


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
        raise ValueError(
            f"the model's output has no floating-point tensor that requires grad (got {type(output).__name__}); "
            "pass loss_fn=lambda output: ... that returns the scalar loss to backpropagate."
        )
    return sum(t.sum() for t in leaves)


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
    result = int(round(float(value) * GB)) if name == "budget_gb" else int(value)
    if result <= 0:
        raise ValueError(f"{name}={value!r} is less than one byte; give the budget in {'GB' if name == 'budget_gb' else 'bytes'}")
    return result


_VERIFY_ATTEMPTS = 3


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Request:
    """A checked call of optimize/plan."""

    model: nn.Module
    budget: int
    args: tuple
    kwargs: dict
    loss: Callable[[Any], torch.Tensor]
    solver_options: SolverOptions | None

    @staticmethod
    def check(
        model: Any,
        budget_gb: Any,
        budget_bytes: Any,
        example_inputs: Any,
        example_kwargs: Any,
        loss_fn: Any,
        solver_options: Any,
    ) -> _Request:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(model, OptimizedModule):
            raise TypeError(
                "model was already optimized by autockpt; pass the original model (module.original_module)"
            )
        budget = budget_to_bytes(budget_gb, budget_bytes)
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
            model=model, budget=budget, args=args, kwargs=kwargs, loss=loss_fn or default_loss, solver_options=solver_options
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Timed:
    capture_s: float
    profile_s: float


def _capture_and_profile(request: _Request) -> tuple[Graph, Profile, _Timed]:
    started = time.perf_counter()
    graph = capture(request.model, request.args, request.kwargs)
    captured = time.perf_counter()
    measured = profile(graph, request.args, request.kwargs, request.loss)
    return graph, measured, _Timed(capture_s=captured - started, profile_s=time.perf_counter() - captured)


def _solve_plan(request: _Request, graph: Graph, measured: Profile, timings: _Timed, target_bytes: int) -> Plan:
    segments, candidates = candidate_regions(graph, measured)
    result = solve(measured, segments, candidates, target_bytes, request.solver_options)
    logger.info(
        "plan: %s, %d regions, predicted peak %d bytes (target %d), solve %.1fs",
        result.status.value, len(result.regions), result.timeline.peak_bytes, target_bytes, result.solve_time_s,
    )
    region_of = unit_regions(len(graph.units), result.regions)
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
        )
        for unit, cost in zip(graph.units, measured.units)
    )
    return Plan(
        budget_bytes=request.budget,
        predicted_peak_bytes=result.timeline.peak_bytes,
        baseline_peak_bytes=result.baseline.peak_bytes,
        min_feasible_bytes=result.min_feasible_bytes,
        static_bytes=measured.static_bytes,
        predicted_overhead=result.timeline.recompute_ms / measured.step_ms if measured.step_ms > 0 else 0.0,
        recompute_ms=result.timeline.recompute_ms,
        baseline_step_ms=measured.step_ms,
        capture=graph.kind,
        status=result.status,
        solver=result.solver,
        solve_time_s=result.solve_time_s,
        capture_time_s=timings.capture_s,
        profile_time_s=timings.profile_s,
        regions=result.regions,
        nodes=nodes,
        notes=graph.notes,
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
    return example_inputs, dict(example_kwargs)
