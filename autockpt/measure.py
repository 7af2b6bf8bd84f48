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
    """Run forward + backward once (gradients are left on the parameters) and return the peak bytes.

    On CPU the peak is MemTracker's; MemTracker cannot track a module with frozen parameters (it hooks every
    parameter's gradient), so such modules are measured with autockpt's own tracker, which counts the same storages.
    On CUDA it is ``torch.cuda.max_memory_allocated``: everything the process holds on the device counts.
    """
    from autockpt.api import default_loss
    from autockpt.profile import StorageTracker, device_of, step_tensors

    kwargs = dict(example_kwargs or {})
    loss_fn = loss_fn or default_loss
    for param in module.parameters():
        param.grad = None
    device = device_of(module, example_inputs, kwargs)
    static = step_tensors(module, example_inputs, kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        output = module(*example_inputs, **kwargs)
        loss = loss_fn(output)
        loss.backward()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        return StepMeasurement(peak_bytes=peak, loss=float(loss.detach()), device=str(device))

    if all(p.requires_grad for p in module.parameters()):
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(module, *[t for t in static if not isinstance(t, nn.Parameter)])
        with tracker:
            output = module(*example_inputs, **kwargs)
            loss = loss_fn(output)
            loss.backward()
        peak = tracker.get_tracker_snapshot("peak")[device]["Total"]
    else:
        own = StorageTracker(device, static)
        with own:
            output = module(*example_inputs, **kwargs)
            loss = loss_fn(output)
            loss.backward()
        peak = max(event.peak_bytes for event in own.events)
    return StepMeasurement(peak_bytes=int(peak), loss=float(loss.detach()), device=str(device))

