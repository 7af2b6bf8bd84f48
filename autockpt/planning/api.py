"""The public entry points: optimize, plan, apply_plan, get_plan.

``Planner`` (``planner.py``) coordinates the stages (capture -> trace -> costs -> solve -> policy -> rewrite);
verifying a plan on a real step and racing the recompute actions against each other is ``verify.py``'s. Options come
as one ``PlanOptions`` (``options=``) or as keyword arguments of the same names (``options.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from autockpt.measure.chunked_tail import captured_program
from autockpt.measure.sources import StepInputs
from autockpt.planning.build import without_values
from autockpt.planning.compiled import compiled_module
from autockpt.planning.options import PlanOptions, budget_to_bytes, resolve_options
from autockpt.planning.planner import Planner
from autockpt.planning.shapes import attach_shape_variants
from autockpt.records.fingerprint import check_fingerprint, model_fingerprint
from autockpt.records.plan import Plan
from autockpt.records.plan_inputs import in_recorded_form, recorded_inputs
from autockpt.runtime.model_state import enter_training_modes, preserved_model_state
from autockpt.runtime.rewrite import OptimizedModule, rewrite


def optimize(
    model: nn.Module,
    budget_gb: float | None = None,
    *,
    budget_bytes: int | None = None,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    options: PlanOptions | None = None,
    **option_keywords: Any,
) -> nn.Module:
    """Return a module that trains like ``model`` with a step peak of at most the budget (GB = 10^9 bytes).

    Options: ``options=autockpt.PlanOptions(...)``, or any of its fields as keyword arguments (``checkpoint``,
    ``host_pool_gb``, ``optimizer``, ``gradient_accumulation_steps``, ``output_held``, ``strict``, ``compiled``,
    ``solver``, ``trace``, ``timing``, ``device_memory_bytes``); ``PlanOptions`` documents each. ``target`` is refused:
    the returned module is measured here (plan for another device with ``autockpt.plan``).

    The returned module shares ``model``'s parameters and buffers (same ``state_dict`` keys) and returns the same
    outputs and gradients. Before returning, one real training step on the example inputs is measured; if it went
    over the budget, the plan is tightened by the overshoot and checked again. With the default checkpoint choice
    (``checkpoint="auto"``) a plan is made for each recompute action, and when more than one keeps the budget their
    steps are timed against each other and the faster is returned. ``autockpt.get_plan(result)`` tells what was
    decided and what was measured.

    Inputs: a step whose tensors are no larger than the example's in every dimension (same rank and dtype; other
    arguments equal; extra arguments of at most one element such as a loop's ``num_items_in_batch``) runs under the
    plan, captured at its shapes the first time (``OptimizedModule.shape_variants()``). A larger step runs the
    original model with a warning, over the budget; ``strict=True`` raises ``UnplannedStepError`` instead.

    ``compiled=True`` (or a dict of ``torch.compile`` keyword arguments): return ``torch.compile`` of the optimized
    module, with the budget kept by the *compiled* step (the partitioner re-decides what is saved): the compiled step
    is measured and planned tighter while it is over; of the plans whose compiled step fits, the fastest compiled step
    is kept (``autockpt.planning.compiled``). Not with a host pool.

    A step that does not fit is never run: ``trace="auto"`` plans from a fake trace when it predicts the unmodified
    step above the device memory; then only the optimized step is measured, as always. Without a budget the budget is
    ``device_memory_bytes``. A model on the meta device has no weights to train: ``autockpt.plan`` it instead.
    """
    options = resolve_options(options, option_keywords, entry_point="autockpt.optimize", refused=("target",))
    if budget_gb is None and budget_bytes is None and options.device_memory_bytes is not None:
        budget_bytes = options.device_memory_bytes
    budget = budget_to_bytes(budget_gb, budget_bytes)
    refuse_meta(model, example_inputs, example_kwargs)
    # the planner plans and verifies eager steps; compiling them is compiled_module's (Planner.optimize refuses it)
    planner = Planner.from_model(
        model, example_inputs=example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
        options=dataclasses.replace(options, compiled=False),
    )
    if options.compiled is not False:
        compile_options = options.compiled if isinstance(options.compiled, Mapping) else {}
        result = compiled_module(planner, budget, compile_options)
        result._orig_mod.strict = options.strict
        return result
    module = planner.optimize(budget_bytes=budget)
    module.strict = options.strict
    return module


def plan(
    model: nn.Module,
    budget_gb: float | None = None,
    *,
    budget_bytes: int | None = None,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    options: PlanOptions | None = None,
    **option_keywords: Any,
) -> Plan:
    """Like ``optimize`` but only plans (no rewrite, no verification step): returns the Plan. With the default
    checkpoint choice ("auto") it is the plan with the smaller *predicted* overhead of the recompute actions
    (``optimize`` times them instead). Options as for ``optimize`` (``PlanOptions``), ``target`` included; ``strict``
    and ``compiled`` are refused (they are about the module ``optimize`` returns).

    Planning for a device you do not have: build the model on the meta device (``with torch.device("meta"):``) and
    name the device, ``target="h100-sxm-80gb"`` (``autockpt.core.devices.DEVICE_SPECS``) or an ``autockpt.DeviceSpec``:
    the step is traced on fake tensors (``trace="auto"``), timed by the roofline of the target, and the budget
    defaults to the target's memory (or ``device_memory_bytes``). ``Plan.provenance`` says which trace and timing
    made the plan and for which device."""
    options = resolve_options(options, option_keywords, entry_point="autockpt.plan", refused=("strict", "compiled"))
    if budget_gb is not None or budget_bytes is not None:
        budget_to_bytes(budget_gb, budget_bytes)  # checked before anything is traced
    planner = Planner.from_model(
        model, example_inputs=example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn, options=options,
    )
    return planner.plan(budget_gb, budget_bytes=budget_bytes)  # no budget: the device's memory, when known


def refuse_meta(model: Any, example_inputs: Any, example_kwargs: Any) -> None:
    """``optimize`` returns a module to train and measures its step: a model on the meta device has neither weights
    nor a step to measure."""
    if not isinstance(model, nn.Module):
        return  # StepInputs.check says what was expected
    if without_values(model, example_inputs, example_kwargs):
        raise ValueError(
            f"{type(model).__name__} or its example inputs are on the meta device (or fake tensors): there are no "
            "weights to train and no step to measure. Plan it with autockpt.plan(model, ..., target=...) (no real "
            "step runs), save the plan, and apply it (autockpt.apply_plan) to the materialised model and real inputs"
        )



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
    request = StepInputs.check(model, example_inputs, example_kwargs, None)
    args, kwargs = in_recorded_form(model, the_plan, request.args, request.kwargs)
    with preserved_model_state(model, args, kwargs):
        enter_training_modes(model)
        graph = captured_program(model, args, kwargs, the_plan.loss_chunk_tokens)
        check_fingerprint(the_plan, model_fingerprint(model, graph, args, kwargs), graph.units)
        module = rewrite(graph, the_plan.policy, args, kwargs, plan=the_plan)
    attach_shape_variants(module, graph, (args, kwargs))
    module.training = model.training
    module.strict = strict
    return module


def get_plan(module: nn.Module) -> Plan:
    """The Plan behind a module returned by ``autockpt.optimize`` (also when ``torch.compile`` wraps it)."""
    module = getattr(module, "_orig_mod", module)  # torch.compile's wrapper: the module it compiled
    if not isinstance(module, OptimizedModule):
        raise TypeError(
            f"get_plan expects a module returned by autockpt.optimize, got {type(module).__name__}. "
            "Call autockpt.optimize(model, ...) first, or autockpt.plan(...) to get a Plan without rewriting."
        )
    return module.plan


