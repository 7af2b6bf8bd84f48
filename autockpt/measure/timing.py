"""Timings: where a trace's unit times come from, behind one protocol.

A ``Timing`` takes the trace a trace source made (memory events, FLOPs, bytes) and gives it its times:

* ``MeasuredTiming`` ("measured"): the times the trace source measured on the model's device, as autockpt always had;
* ``RooflineTiming(spec)`` ("roofline"): FLOPs and bytes moved against a ``DeviceSpec`` (``core/roofline.py``), so a
  step can be planned for a device it never ran on (``target="h100-sxm-80gb"``), and offloading is priced on the
  spec's host link.

``timing_for(timing, target, device)`` chooses: "auto" is "measured" when the target is the model's own device (no
target), and "roofline" for any other target. ``with_timing`` applies the choice to what ``Planner.from_model``
captured, traced and priced, and names it in a note the planner gives every plan.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Protocol

import torch

from autockpt.core.devices import DeviceSpec, device_spec
from autockpt.core.roofline import link_price, roofline_trace
from autockpt.measure.devices_local import local_device_spec
from autockpt.measure.sources import StepInputs
from autockpt.runtime.fx_nodes import compute_nodes
from autockpt.types import CaptureKind, CostModel, Graph, StepTrace

TIMINGS = ("auto", "measured", "roofline")


class Timing(Protocol):
    """Gives a trace its unit times, forward time and step time; memory events stay as the trace source made them."""

    name: str

    def timed(self, trace: StepTrace, graph: Graph, step: StepInputs) -> StepTrace: ...


class MeasuredTiming:
    """The times the trace source measured (``MeasuredTrace`` times the real step on the model's device)."""

    name = "measured"

    def timed(self, trace: StepTrace, graph: Graph, step: StepInputs) -> StepTrace:
        return trace

    def priced(self, costs: CostModel) -> CostModel:
        return costs

    def describe(self, trace: StepTrace) -> str:
        if not trace.times_measured:  # a trace source that runs no real step (``FakeTrace``) times nothing
            return "timing: none measured (the trace source ran no real step)"
        return "timing: measured on the model's device"


class RooflineTiming:
    """Unit times from FLOPs and bytes moved against ``spec`` (``autockpt.core.roofline``), for ``dtype`` (default:
    the autocast dtype when autocast was on at capture, else the dtype of most of the model's floating-point
    parameters)."""

    name = "roofline"

    def __init__(self, spec: DeviceSpec | str, dtype: torch.dtype | str | None = None) -> None:
        self.spec = device_spec(spec)
        self.dtype = dtype

    def timed(self, trace: StepTrace, graph: Graph, step: StepInputs) -> StepTrace:
        dtype = self.dtype if self.dtype is not None else compute_dtype(graph, step)
        return roofline_trace(trace, self.spec, dtype, parameter_read_bytes=parameter_read_bytes(graph))

    def priced(self, costs: CostModel) -> CostModel:
        """``costs`` with offloading's host link priced from the spec (when the cost model has a link). The recompute
        actions' machinery (Python hooks on the host) stays as calibrated on this machine."""
        if costs.link is None:
            return costs
        return dataclasses.replace(costs, link=link_price(self.spec))

    def describe(self, trace: StepTrace) -> str:
        return f"timing: roofline on {self.spec.describe()}"


def timing_for(timing: str | Timing, target: str | DeviceSpec | None, device: torch.device) -> Timing:
    """The timing ``timing`` names ("auto", "measured", "roofline", or a ``Timing``) for ``target`` (a table name,
    a ``DeviceSpec``, or None: the model's device). "auto": measured without a target, roofline with one.
    "roofline" without a target: the model's device, calibrated (``local_device_spec``)."""
    if not isinstance(timing, str):
        if not callable(getattr(timing, "timed", None)):
            raise TypeError(f"timing must be one of {TIMINGS} or a Timing (name, timed), got {type(timing).__name__}")
        return timing
    if timing not in TIMINGS:
        raise ValueError(f"timing={timing!r}: choose one of {', '.join(TIMINGS)}, or give a Timing")
    spec = device_spec(target) if target is not None else None
    if timing == "measured":
        if spec is not None:
            raise ValueError(
                f"timing='measured' times the step on the model's device ({device}), not on target={spec.name!r}; "
                "use timing='roofline' (or 'auto') to plan for another device"
            )
        return MeasuredTiming()
    if timing == "auto" and spec is None:
        return MeasuredTiming()
    return RooflineTiming(spec if spec is not None else local_device_spec(device))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TimedStep:
    """What ``Planner.from_model`` plans from, after the timing: the trace with its times, the prices, the device
    planned for (None: the model's own) and the note every plan carries about the timing."""

    trace: StepTrace
    costs: CostModel
    target: DeviceSpec | None
    note: str
    timing: str  # the timing's name ("measured", "benchmark", "roofline"; "none": a trace that measured nothing)


def with_timing(
    timing: str | Timing, target: str | DeviceSpec | None, graph: Graph, step: StepInputs, trace: StepTrace,
    costs: CostModel,
) -> TimedStep:
    """Apply the timing ``timing_for(timing, target, step.device)`` to a captured, traced and priced step."""
    timer = timing_for(timing, target, step.device)
    priced = getattr(timer, "priced", None)
    describe = getattr(timer, "describe", None)
    note = describe(trace) if callable(describe) else f"timing: {timer.name}"
    return TimedStep(
        trace=timer.timed(trace, graph, step),
        costs=priced(costs) if callable(priced) else costs,
        target=getattr(timer, "spec", None) if target is not None else None,
        note=note,
        timing="none" if timer.name == "measured" and not trace.times_measured else timer.name,
    )


def compute_dtype(graph: Graph, step: StepInputs) -> torch.dtype:
    """The dtype the step's matmuls run in: autocast's on the model's device when it was on at capture, else the
    dtype of most floating-point parameter bytes (float32 for a model without any)."""
    device_type = step.device.type
    for autocast_device, enabled, dtype in graph.autocast:
        if enabled and autocast_device == device_type:
            return dtype
    weights: Counter[torch.dtype] = Counter()
    for param in graph.model.parameters():
        if param.is_floating_point():
            weights[param.dtype] += param.numel() * param.element_size()
    return weights.most_common(1)[0][0] if weights else torch.float32


def parameter_read_bytes(graph: Graph) -> list[int]:
    """Per unit, the bytes of parameters and buffers its forward reads, from the graph without running it: an fx
    ``call_module`` node's module, the ``get_attr`` inputs of any node (export's parameters); at module level, the
    module's own parameters and buffers at the first unit of its path."""
    count = len(graph.units)
    read = [0] * count
    if graph.kind is CaptureKind.MODULE:
        seen: set[str] = set()
        for unit in graph.units:
            if unit.module_path in seen:
                continue
            seen.add(unit.module_path)
            try:
                module = graph.model.get_submodule(unit.module_path)
            except AttributeError:
                continue
            read[unit.index] = _tensor_bytes([*module.parameters(recurse=False), *module.buffers(recurse=False)])
        return read
    gm = graph.executable
    for index, node in enumerate(compute_nodes(gm)[:count]):
        tensors: list[torch.Tensor] = []
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            tensors += [*module.parameters(), *module.buffers()]
        for source in node.all_input_nodes:
            if source.op == "get_attr":
                value = _attribute(gm, str(source.target))
                if isinstance(value, torch.Tensor):
                    tensors.append(value)
        read[index] = _tensor_bytes(tensors)
    return read


def _attribute(root: torch.nn.Module, path: str) -> object:
    value: object = root
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def _tensor_bytes(tensors: list[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total
