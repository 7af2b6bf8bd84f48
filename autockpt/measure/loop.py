"""The training loop around the step: what it keeps on the device between steps, and what ``optimizer.step()`` needs.

A plan's budget covers the step as the loop runs it (issue 23). The trace measures forward + backward with gradients
``None`` at the start and no optimizer; a real loop also keeps

* the optimizer's states (made by the first ``optimizer.step()``, alive through every later step), and the peak of
  ``optimizer.step()`` itself: parameters, gradients, states and the temporaries of the implementation that runs on
  that device (for-loop, foreach or fused);
* with gradient accumulation (or gradients zeroed in place instead of set to None), the gradients of the earlier
  micro-steps, alive from the step's start.

``measure_optimizer_step`` measures the first: a fresh copy of the user's optimizer runs two steps on the model's own
parameters with zero gradients, under the storage tracker; parameter values and gradients are put back afterwards, the
user's optimizer is never stepped. ``step_in_loop`` raises the measured trace by what the loop keeps alive, event by
event, so every solver, the simulator and the floors see the step as the loop runs it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autockpt.measure.storage_tracker import StorageTracker
from autockpt.measure.trace import step_tensors, unique_storage_bytes
from autockpt.runtime.model_state import weights_put_back
from autockpt.types import (
    OUTSIDE_GRAPH_UNIT,
    MemoryEvent,
    OptimizerStepCost,
    Phase,
    StepTrace,
    TrainingLoop,
    describe_value,
)

# What ``optimizer=`` takes: an optimizer over the model's parameters (copied, never stepped), or a function that
# makes one from a list of parameters (``torch.optim.AdamW``, ``functools.partial(torch.optim.SGD, lr=0.1,
# momentum=0.9)``, what ``transformers.Trainer.get_optimizer_cls_and_kwargs`` returns, bound).
OptimizerSpec = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer]


# The optimizers the command line names (``--optimizer``): torch's own, with torch's default implementation for the
# device; hyperparameters do not change what a step holds, except SGD's momentum (one buffer per parameter).
NAMED_OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9),
}


def named_optimizer(name: str) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None:
    """The optimizer ``--optimizer NAME`` stands for ("none": no optimizer step)."""
    if name == "none":
        return None
    if name not in NAMED_OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join([*NAMED_OPTIMIZERS, 'none'])}; got {name!r}")
    return NAMED_OPTIMIZERS[name]


def check_accumulation_steps(gradient_accumulation_steps: Any) -> int:
    if isinstance(gradient_accumulation_steps, bool) or not isinstance(gradient_accumulation_steps, int) \
            or gradient_accumulation_steps < 1:
        raise ValueError(
            f"gradient_accumulation_steps must be an integer >= 1 (micro-steps per optimizer step), got "
            f"{describe_value(gradient_accumulation_steps)}"
        )
    return gradient_accumulation_steps


def optimizer_factory(model: nn.Module, optimizer: Any) -> Callable[[], torch.optim.Optimizer]:
    """A function that makes a fresh optimizer like ``optimizer`` over ``model``'s parameters; ``optimizer`` itself is
    left as it was (an instance is rebuilt from its class, param groups and a copy of its state). A name
    (``NAMED_OPTIMIZERS``) stands for its factory."""
    if isinstance(optimizer, str):
        optimizer = named_optimizer(optimizer)
    params = list(model.parameters())
    if isinstance(optimizer, torch.optim.Optimizer):
        known = {id(p) for p in params}
        foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in known)
        if foreign:
            raise ValueError(
                f"the optimizer ({type(optimizer).__name__}) holds {foreign} parameters that are not "
                f"{type(model).__name__}'s: pass the optimizer made over this model's parameters (autockpt's optimized "
                "module shares them, so the same optimizer trains it)"
            )
        return lambda: _rebuilt(optimizer)
    if isinstance(optimizer, type) or callable(optimizer):
        trainable = [p for p in params if p.requires_grad]

        def make() -> torch.optim.Optimizer:
            made = optimizer(trainable)
            if not isinstance(made, torch.optim.Optimizer):
                raise TypeError(
                    f"optimizer= was called with the model's parameters and returned {type(made).__name__}, not a "
                    "torch.optim.Optimizer"
                )
            return made

        return make
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer over the model's parameters or a function making one from a list "
        f"of parameters (e.g. torch.optim.AdamW), got {describe_value(optimizer)} ({type(optimizer).__name__})"
    )


def _rebuilt(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A new optimizer of the same class, param groups (same Parameters, same settings) and a copy of the state.
    Not ``copy.deepcopy``: an LR scheduler patches ``optimizer.step`` with a function bound to the original, which a
    copy would keep calling."""
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": group["params"]}
              for group in optimizer.param_groups]
    try:
        # the defaults its constructor takes (AdamW's defaults hold a setting its constructor does not accept)
        accepted = inspect.signature(type(optimizer)).parameters
        settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        made = type(optimizer)(groups, **settings)
        made.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    except (TypeError, ValueError, KeyError) as error:
        raise TypeError(
            f"could not make a copy of the {type(optimizer).__name__} to measure its step without stepping yours "
            f"({type(error).__name__}: {error}); pass optimizer= as a function that makes one from the model's "
            "parameters, e.g. functools.partial(torch.optim.AdamW, lr=1e-4)"
        ) from error
    return made


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """Its class and the implementation its settings ask for ("AdamW (fused)"); "default" lets torch choose
    (foreach on CUDA, the for-loop on CPU)."""
    settings = optimizer.param_groups[0] if optimizer.param_groups else optimizer.defaults
    implementation = "fused" if settings.get("fused") else "foreach" if settings.get("foreach") else (
        "for-loop" if settings.get("foreach") is False else "torch's default implementation for the device")
    return f"{type(optimizer).__name__} ({implementation})"


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(list(optimizer.state.values())) if isinstance(leaf, torch.Tensor)]


def measure_optimizer_step(
    make_optimizer: Callable[[], torch.optim.Optimizer], model: nn.Module, device: torch.device,
    *, implementation_of: str | None = None,
) -> OptimizerStepCost:
    """Run two steps of a fresh optimizer on ``model``'s parameters with zero gradients and measure the bytes each
    holds above the parameters and gradients; parameter values and gradients are put back afterwards.

    ``implementation_of``: a device type ("cuda") whose default implementation the steps run where the optimizer
    leaves the choice to torch (``foreach=None``): a step measured on CPU (or fake) tensors for a CUDA device runs
    the foreach implementation torch picks there, whose temporaries (the size of all parameters) the for-loop one,
    torch's choice on the CPU and for fake tensors, does not make."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    try:
        with weights_put_back(params):  # the steps move the weights
            for param in params:
                param.grad = torch.zeros_like(param)
            optimizer = make_optimizer()
            if implementation_of is not None:
                default_implementation_of(optimizer, implementation_of)
            extras = []
            for _ in range(2):  # the first step makes the states, a later one has them
                states_before = state_tensors(optimizer)
                tracker = StorageTracker(device, step_tensors(model, (), {}) + states_before)
                start = tracker.live_bytes - _device_bytes(states_before, device)
                with tracker:
                    optimizer.step()
                extras.append(max(event.peak_bytes for event in tracker.events) - start)
            state_bytes = _device_bytes(state_tensors(optimizer), device)
            description = describe_optimizer(optimizer)
            del optimizer
    finally:
        for param, grad in zip(params, grads):
            param.grad = grad
    return OptimizerStepCost(
        optimizer=description, state_bytes=state_bytes, first_step_extra_bytes=extras[0],
        later_step_extra_bytes=extras[1],
    )


def default_implementation_of(optimizer: torch.optim.Optimizer, device_type: str) -> None:
    """Make the groups that leave the implementation to torch (``foreach=None``, not fused) run what torch chooses for
    tensors on ``device_type``: foreach where torch has foreach kernels for it (CUDA), the for-loop elsewhere."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    if device_type not in _get_foreach_kernels_supported_devices():
        return  # the for-loop: what torch picks there, and for fake tensors anywhere
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused") and not group.get("differentiable"):
            group["foreach"] = True


def _device_bytes(tensors: list[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages of ``tensors`` that live on ``device`` (a step counter on the CPU does not)."""
    return unique_storage_bytes([t for t in tensors if t.device == device])


def step_in_loop(trace: StepTrace, loop: TrainingLoop) -> StepTrace:
    """``trace`` (forward + backward, gradients None at the start) raised by what ``loop`` keeps alive.

    Every event gains the optimizer's states; with gradients alive at the start, also the gradients backward has not
    made again by the event's start (autograd then adds each new gradient into the old one and frees it). The end
    marker event (after backward, the output still held) rises to the optimizer step's peak: the bytes there plus
    what the step holds above parameters and gradients, at the first step or a later one, whichever is more.
    """
    if not trace.events or (trace.events[-1].phase, trace.events[-1].unit) != (Phase.BACKWARD, OUTSIDE_GRAPH_UNIT):
        raise ValueError("the trace has no end marker event (backward, outside the graph): was it made by trace_step?")
    state = loop.optimizer.state_bytes if loop.optimizer is not None else 0
    made = trace.gradient_bytes_by_event or (0,) * len(trace.events)
    events = raised_events(trace.events, [
        state + (trace.gradient_bytes - (made[event.index - 1] if event.index else 0) if loop.gradients_at_start else 0)
        for event in trace.events
    ])
    if loop.optimizer is not None:
        step_peak = trace.events[-1].start_bytes + loop.optimizer.step_extra_bytes
        events[-1] = dataclasses.replace(events[-1], peak_bytes=max(events[-1].peak_bytes, step_peak))
    gradients = (trace.gradient_bytes,) * len(events) if loop.gradients_at_start else trace.gradient_bytes_by_event
    return dataclasses.replace(
        trace, events=tuple(events), baseline_peak_bytes=max(e.peak_bytes for e in events),
        gradient_bytes_by_event=gradients, optimizer_state_bytes=state, loop=loop,
    )


def with_foreign_bytes(trace: StepTrace, foreign_bytes: int) -> StepTrace:
    """``trace`` with ``foreign_bytes`` as the device bytes the step does not own (``StepTrace.foreign_bytes``).

    Those bytes (another model, a cache, tensors the user keeps) are alive through the whole step, like the
    optimizer's states, so every event moves by the difference from what the trace counted; a solve or a prediction
    made on the result is one for the device as it is now rather than as it was when the trace was taken.
    """
    if foreign_bytes < 0:
        raise ValueError(f"foreign_bytes must be >= 0, got {foreign_bytes}")
    moved = foreign_bytes - trace.foreign_bytes
    if moved == 0:
        return trace
    events = tuple(raised_events(trace.events, [moved] * len(trace.events)))
    return dataclasses.replace(
        trace, events=events, baseline_peak_bytes=max(e.peak_bytes for e in events), foreign_bytes=foreign_bytes,
    )


def raised_events(events: tuple[MemoryEvent, ...], extra_bytes: list[int]) -> list[MemoryEvent]:
    """``events`` with each one's start, peak and pack peak raised by its ``extra_bytes`` (lowered when negative)."""
    return [
        dataclasses.replace(
            event, start_bytes=event.start_bytes + extra, peak_bytes=event.peak_bytes + extra,
            pack_peak_bytes=None if event.pack_peak_bytes is None else event.pack_peak_bytes + extra,
        )
        for event, extra in zip(events, extra_bytes, strict=True)
    ]
