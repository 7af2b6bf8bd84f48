"""Costs: device -> CostModel. The price of each action on the device, calibrated there once per process.

The recompute actions add machinery on top of the kernels they re-run: a fixed cost per region (RNG state, the
checkpoint frame, setting up the recomputation) and a cost per tensor the region's units save (torch's checkpoint
passes each through Python hooks three times). Two chains of tiny regions measure both: the machinery does not depend
on the model, so one calibration per device and action serves every plan (``max_batch_size`` profiles a model once
per candidate batch).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import fx, nn

from autockpt.measure.trace import synchronizer
from autockpt.runtime.recompute import CheckpointedRegion
from autockpt.types import Action, ActionPrice, CostModel, LinkPrice


def calibrate(device: torch.device, actions: Sequence[Action], *, link: bool = False) -> CostModel:
    """The prices of ``actions`` on ``device`` (each calibrated once per device and process); ``link``: also the
    link to host memory, which offloading needs (``Action.OFFLOAD`` in ``actions`` implies it)."""
    actions = tuple(dict.fromkeys(actions))
    link = link or Action.OFFLOAD in actions
    return CostModel(
        device=str(device), prices=tuple(_price_on(device, action) for action in actions),
        link=_link_on(device) if link else None,
    )


def free_machinery(costs: CostModel) -> CostModel:
    """The same actions with their machinery priced at zero: what recomputation alone costs (bounds, experiments)."""
    return CostModel(
        device=costs.device,
        prices=tuple(ActionPrice(action=p.action, region_ms=0.0, saved_tensor_ms=0.0) for p in costs.prices),
        link=costs.link,
    )


@functools.cache
def _price_on(device: torch.device, action: Action) -> ActionPrice:
    return measure_action_price(device, action)


@functools.cache
def _link_on(device: torch.device) -> LinkPrice:
    return measure_link(device)


def measure_link(device: torch.device, *, large_bytes: int = 32 * 2**20, small_copies: int = 64, repeats: int = 5) -> LinkPrice:
    """Bandwidth each way between ``device`` and a host buffer like the pool's (pinned on CUDA), and the fixed cost
    per storage moved (median of small copies; on CPU a copy between two host buffers)."""
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    source = torch.ones(large_bytes, dtype=torch.uint8, device=device)
    host = torch.empty(large_bytes, dtype=torch.uint8, pin_memory=on_cuda)
    sync = synchronizer(device)

    def seconds(copy: Callable[[], None], times: int = 1) -> float:
        sync()
        began = time.perf_counter()
        for _ in range(times):
            copy()
        sync()
        return (time.perf_counter() - began) / times

    out_s = statistics.median(seconds(lambda: host.copy_(source, non_blocking=on_cuda)) for _ in range(repeats))
    in_s = statistics.median(seconds(lambda: source.copy_(host, non_blocking=on_cuda)) for _ in range(repeats))
    small_source, small_host = source[:1024], host[:1024]
    latency_s = statistics.median(
        seconds(lambda: small_host.copy_(small_source, non_blocking=on_cuda), small_copies) for _ in range(repeats)
    )
    return LinkPrice(
        device_to_host_gb_per_s=large_bytes / max(out_s, 1e-9) / 1e9,
        host_to_device_gb_per_s=large_bytes / max(in_s, 1e-9) / 1e9,
        latency_ms=latency_s * 1e3, overlaps_compute=on_cuda,
    )


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
    if action is Action.OFFLOAD:  # no kernels run again: the machinery is the hooks' (copies are the link's price)
        return _offload_hook_price(device, regions=regions, long_ops=long_ops, repeats=repeats)
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


def _offload_hook_price(device: torch.device, *, regions: int, long_ops: int, repeats: int) -> ActionPrice:
    """The offload action's machinery per saved tensor: a chain of regions of ``long_ops`` elementwise ops on
    tensors below the pool's smallest moved storage, so every pack and unpack passes the hooks and nothing is
    copied; the median difference against the plain chain, per saved tensor."""
    from autockpt.runtime.offload import HostPool  # the runtime, needed only when offload is priced

    start = torch.linspace(0.0, 1.0, 128, device=device).requires_grad_()
    pool = HostPool(0, device)
    sync = synchronizer(device)

    def chain_seconds(offloaded: bool) -> float:
        sync()
        began = time.perf_counter()
        pool.begin_step()
        value = start
        for r in range(regions):
            with pool.offloading(r) if offloaded else contextlib.nullcontext():
                for position in range(long_ops):
                    value = torch.sin(value) if position % 2 == 0 else torch.cos(value)
        value.sum().backward()
        sync()
        return time.perf_counter() - began

    for _ in range(2):
        chain_seconds(True), chain_seconds(False)
    difference_s = statistics.median(chain_seconds(True) - chain_seconds(False) for _ in range(repeats))
    return ActionPrice(action=Action.OFFLOAD, region_ms=0.0, saved_tensor_ms=max(0.0, difference_s / (regions * long_ops) * 1e3))
