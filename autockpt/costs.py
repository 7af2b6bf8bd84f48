"""Costs: device -> CostModel. The price of each action on the device, calibrated there once per process.

The recompute actions add machinery on top of the kernels they re-run: a fixed cost per region (RNG state, the
checkpoint frame, setting up the recomputation) and a cost per tensor the region's units save (torch's checkpoint
passes each through Python hooks three times). Two chains of tiny regions measure both: the machinery does not depend
on the model, so one calibration per device and action serves every plan (``max_batch_size`` profiles a model once
per candidate batch).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence

import torch
from torch import fx, nn

from autockpt.recompute import CheckpointedRegion
from autockpt.trace import synchronizer
from autockpt.types import Action, ActionPrice, CostModel


def calibrate(device: torch.device, actions: Sequence[Action]) -> CostModel:
    """The prices of ``actions`` on ``device`` (each calibrated once per device and process)."""
    return CostModel(device=str(device), prices=tuple(_price_on(device, action) for action in dict.fromkeys(actions)))


def free_machinery(costs: CostModel) -> CostModel:
    """The same actions with their machinery priced at zero: what recomputation alone costs (bounds, experiments)."""
    return CostModel(
        device=costs.device,
        prices=tuple(ActionPrice(action=p.action, region_ms=0.0, saved_tensor_ms=0.0) for p in costs.prices),
    )


@functools.cache
def _price_on(device: torch.device, action: Action) -> ActionPrice:
    return measure_action_price(device, action)


def measure_action_price(
    device: torch.device,
    action: Action = Action.RECOMPUTE_TORCH,
    *,
    regions: int = 8,
    short_ops: int = 2,
    long_ops: int = 32,
    repeats: int = 15,
) -> ActionPrice:
    """Calibrate a recompute action's machinery on ``device`` with two chains of tiny regions.

    Each region is a run of elementwise ops on 256 numbers (kernels that cost next to nothing), each op saving one
    tensor. A chain runs forward and backward through the rewriter's own region wrapper, alternating with the same
    chain run plainly; the median difference per region, less the recomputed kernels (timed from a plain forward), is
    the machinery. Regions of ``short_ops`` and ``long_ops`` ops give its fixed part and its part per saved tensor,
    which is what makes a real 40-op region cost several times a 2-op one.
    """
    if not action.recomputes:
        raise ValueError(f"measure_action_price calibrates the recompute actions, got {action.value!r}")
    start = torch.linspace(0.0, 1.0, 256, device=device).requires_grad_()  # no random numbers: RNG state untouched
    sync = synchronizer(device)

    def machinery_ms_per_region(ops: int) -> float:
        graph = fx.Graph()
        value = graph.placeholder("x")
        for position in range(ops):  # sin and cos save their input
            value = graph.call_function(torch.sin if position % 2 == 0 else torch.cos, (value,))
        graph.output((value,))
        body = fx.GraphModule(nn.Module(), graph)
        region = CheckpointedRegion(body, "autockpt_calibration_region", action)

        def chain_seconds(checkpointed: bool, backward: bool = True) -> float:
            sync()
            began = time.perf_counter()
            value = start
            for _ in range(regions):
                (value,) = region(value) if checkpointed else body(value)
            if backward:
                value.sum().backward()
            sync()
            return time.perf_counter() - began

        for _ in range(2):  # warm-up
            chain_seconds(True), chain_seconds(False)
        differences = [chain_seconds(True) - chain_seconds(False) for _ in range(repeats)]
        forward_s = statistics.median(chain_seconds(False, backward=False) for _ in range(repeats))
        # torch's recomputation re-runs every op but the last, whose saved tensor is its input (early stop);
        # autockpt's re-runs them all
        early_stop = action is Action.RECOMPUTE_TORCH
        recomputed_s = forward_s * (ops - 1) / ops if early_stop else forward_s
        return (statistics.median(differences) - recomputed_s) / regions * 1e3

    short_ms, long_ms = machinery_ms_per_region(short_ops), machinery_ms_per_region(long_ops)
    saved_tensor_ms = max(0.0, (long_ms - short_ms) / (long_ops - short_ops))
    return ActionPrice(
        action=action, region_ms=max(0.0, short_ms - short_ops * saved_tensor_ms), saved_tensor_ms=saved_tensor_ms
    )
