"""Trace sources: where a ``StepTrace`` comes from. The planner is built from values (graph, trace, prices), so a new
way of knowing the step (fake tensors, per-op benchmarks, a device roofline) is one class here that produces the same
``StepTrace``; nothing in the solvers, the simulator or the rewriter changes.

``StepInputs`` is the checked model, example call and loss a source traces (and the planner later rewrites and
measures); ``MeasuredTrace`` runs the real step on the model's device, as autockpt always has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autockpt.measure.loop import (
    OptimizerSpec,
    measure_optimizer_step,
    optimizer_factory,
    step_in_loop,
)
from autockpt.measure.loss import checked_loss, default_loss
from autockpt.measure.step import owned_bytes
from autockpt.measure.trace import device_of, step_tensors, trace_step
from autockpt.runtime.rewrite import OptimizedModule
from autockpt.types import Graph, OptimizerStepCost, StepTrace, TrainingLoop


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepInputs:
    """The model, the example call (positional and keyword arguments) and the loss of one training step, checked."""

    model: nn.Module
    args: tuple
    kwargs: dict
    loss: Callable[[Any], torch.Tensor]

    @staticmethod
    def check(model: Any, example_inputs: Any, example_kwargs: Any, loss_fn: Any) -> StepInputs:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(model, OptimizedModule):
            raise TypeError(
                "model was already optimized by autockpt; pass the original model (module.original_module)"
            )
        args, kwargs = example_arguments(example_inputs, example_kwargs)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (output -> scalar tensor), got {type(loss_fn).__name__}")
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                f"{type(model).__name__} has no parameter that requires grad: there is no training step to plan"
            )
        return StepInputs(model=model, args=args, kwargs=kwargs, loss=checked_loss(loss_fn or default_loss))

    @property
    def device(self) -> torch.device:
        return device_of(self.model, self.args, self.kwargs)

    @property
    def model_device(self) -> torch.device:
        """The device of the model's first parameter (or buffer); the CPU for a model without either."""
        return next((t.device for t in (*self.model.parameters(), *self.model.buffers())), torch.device("cpu"))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TraceRequest:
    """What the planner needs of a trace besides the step itself."""

    time_repeated_blocks_once: bool  # the solver plans repeated blocks per family: one timing per family suffices
    gradient_lifetimes: bool  # autockpt's own recompute is planned for: record when each parameter's gradient lands
    optimizer: OptimizerSpec | None = None  # the loop's optimizer: its states and step raise every event
    gradient_accumulation_steps: int = 1
    output_held: bool = True  # False: the loop drops the model's output before backward (``TrainingLoop``)
    # the device type the step is planned for, when it is not the traced tensors' own (a fake CPU trace for a CUDA
    # target): the optimizer runs torch's default implementation for it (``loop.measure_optimizer_step``)
    planned_device_type: str | None = None
    # the optimizer's step measured already on these parameters (another program of the same step: the loss in
    # chunks), used as it is: it depends on the parameters alone, and measuring it again took seconds per program
    optimizer_step: OptimizerStepCost | None = None
    # False: the timing planned with replaces every time a trace takes (roofline, benchmark: ``uses_measured_times``),
    # so a trace that runs the real step tracks its memory without the timed steps (three steps, and markers put in)
    times_used: bool = True


class TraceSource(Protocol):
    """Produces the step's ``StepTrace`` for a captured graph: memory events (bytes and lifetimes) and unit times,
    as the training loop runs the step (``TrainingLoop``), with ``foreign_bytes`` (what the device holds that the
    step does not own) set."""

    name: str

    def trace(self, graph: Graph, step: StepInputs, request: TraceRequest) -> StepTrace: ...


class MeasuredTrace:
    """Runs the unmodified step on the model's device: a warm-up, a tracked step and timed steps (``trace.py``);
    the optimizer's states and step measured on a copy (``loop.py``)."""

    name = "measured"

    def trace(self, graph: Graph, step: StepInputs, request: TraceRequest) -> StepTrace:
        trace = trace_step(
            graph, step.args, step.kwargs, step.loss,
            time_repeated_blocks_once=request.time_repeated_blocks_once,
            gradient_lifetimes=request.gradient_lifetimes, output_held=request.output_held, timed=request.times_used,
        )
        trace = with_foreign_bytes_counted(trace, step.device, step.model, step.args, step.kwargs)
        if request.optimizer is None or request.optimizer_step is not None:
            return in_the_loop(trace, request.optimizer_step, request)
        make_optimizer = optimizer_factory(step.model, request.optimizer)
        cost = measure_optimizer_step(
            make_optimizer, step.model, step.device, implementation_of=request.planned_device_type
        )
        return in_the_loop(trace, cost, request)


def with_foreign_bytes_counted(
    trace: StepTrace, device: torch.device, model: nn.Module, args: tuple, kwargs: dict
) -> StepTrace:
    """``trace`` with ``foreign_bytes``: what it counted beyond the step's own tensors (the model's parameters,
    buffers and gradients, the inputs); on CUDA everything else allocated on the device."""
    owned = owned_bytes(device, step_tensors(model, args, kwargs))
    return dataclasses.replace(trace, foreign_bytes=max(0, trace.events[0].start_bytes - owned))


def in_the_loop(trace: StepTrace, optimizer_step: OptimizerStepCost | None, request: TraceRequest) -> StepTrace:
    """The step as the loop runs it (``loop.step_in_loop``: what the loop keeps alive raises every event), or
    ``trace`` itself when there is no optimizer to cover and no accumulation."""
    if request.optimizer is None and request.gradient_accumulation_steps == 1 and request.output_held:
        return trace
    loop = TrainingLoop(
        optimizer=optimizer_step, gradient_accumulation_steps=request.gradient_accumulation_steps,
        output_held=request.output_held,
    )
    return step_in_loop(trace, loop)


def example_arguments(example_inputs: Any, example_kwargs: Any) -> tuple[tuple, dict]:
    """The example call as (args, kwargs), checked: a tensor alone is one argument, a list a tuple."""
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
