"""Measure one real training step: the reference every prediction is checked against.

Peak means the highest total of live tensor bytes on the model's device during forward + ``loss.backward()``,
gradients ``None`` at the start, inputs allocated beforehand. On CPU it is MemTracker's peak "Total" with the module
and the inputs tracked as external; on CUDA it is ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMeasurement:
    peak_bytes: int
    loss: float
    device: str


def measure_step(
    module: nn.Module,
    example_inputs: tuple = (),
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> StepMeasurement:
    """Run forward + backward once (gradients are left on the parameters) and return the peak bytes."""
    from autockpt.api import default_loss

    kwargs = dict(example_kwargs or {})
    loss_fn = loss_fn or default_loss
    for param in module.parameters():
        param.grad = None
    tensors = [t for t in pytree.tree_leaves((example_inputs, kwargs)) if isinstance(t, torch.Tensor)]
    device = next((p.device for p in module.parameters()), tensors[0].device if tensors else torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        output = module(*example_inputs, **kwargs)
        loss = loss_fn(output)
        loss.backward()
        torch.cuda.synchronize(device)
        return StepMeasurement(peak_bytes=torch.cuda.max_memory_allocated(device), loss=float(loss.detach()), device=str(device))

    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(module, *tensors)
    with tracker:
        output = module(*example_inputs, **kwargs)
        loss = loss_fn(output)
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")[device]["Total"]
    return StepMeasurement(peak_bytes=int(peak), loss=float(loss.detach()), device=str(device))
