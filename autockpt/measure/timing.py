"""Timings: where a trace's unit times come from, behind one protocol.

A ``Timing`` takes the trace a trace source made (memory events, FLOPs, bytes) and gives it its times:

* ``MeasuredTiming`` ("measured"): the times the trace source measured on the model's device, as autockpt always had;
* ``BenchmarkTiming`` ("benchmark"): for a trace that ran no real step (``FakeTrace``), each op benchmarked alone on
  the local device at its shapes, forward and backward, on random inputs (``benchmark.py``); repeated blocks once;
* ``RooflineTiming(spec)`` ("roofline"): FLOPs and bytes moved against a ``DeviceSpec`` (``core/roofline.py``), so a
  step can be planned for a device it never ran on (``target="h100-sxm-80gb"``), and offloading is priced on the
  spec's host link.

``timing_for(timing, target, device, trace_measured=)`` chooses: "auto" is "measured" when the target is the model's
own device (no target) and the trace source measured its times, "benchmark" when it measured none (a fake trace),
and "roofline" for any other target. ``with_timing`` applies the choice to what ``Planner.from_model`` captured,
traced and priced, and names it in a note the planner gives every plan.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Protocol

import torch

from autockpt.core.devices import DeviceSpec, device_spec
from autockpt.core.roofline import BACKWARD_FACTOR, link_price, roofline_trace, unit_rooflines
from autockpt.measure.benchmark import OpBenchmarks, benchmark_units
from autockpt.measure.devices_local import local_device, local_device_spec, local_spec_name
from autockpt.measure.sources import StepInputs
from autockpt.runtime.fx_nodes import compute_nodes
from autockpt.types import CaptureKind, CostModel, Graph, StepTrace

TIMINGS = ("auto", "measured", "roofline", "benchmark")


class Timing(Protocol):
    """Gives a trace its unit times, forward time and step time; memory events stay as the trace source made them."""

    name: str

    def timed(self, trace: StepTrace, graph: Graph, step: StepInputs) -> StepTrace: ...


class MeasuredTiming:
    """The times the trace source measured (``MeasuredTrace`` times the real step on the model's device)."""

    name = "measured"
    uses_measured_times = True

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
    uses_measured_times = False  # every unit's time from FLOPs and bytes

    def __init__(self, spec: DeviceSpec | str, dtype: torch.dtype | str | None = None) -> None:
        self.spec = device_spec(spec)
        self.dtype = dtype

    def timed(self, trace: StepTrace, graph: Graph, step: StepInputs) -> StepTrace:
        dtype = self.dtype if self.dtype is not None else compute_dtype(graph, step)
        timed = roofline_trace(trace, self.spec, dtype, parameter_read_bytes=parameter_read_bytes(graph))
        return dataclasses.replace(timed, times_measured=True)  # estimates of the device's times, not placeholders

    def priced(self, costs: CostModel) -> CostModel:
        """``costs`` with offloading's host link priced from the spec (when the cost model has a link). The recompute
        actions' machinery (Python hooks on the host) stays as calibrated on this machine."""
        if costs.link is None:
            return costs
        return dataclasses.replace(costs, link=link_price(self.spec))

    def describe(self, trace: StepTrace) -> str:
        return f"timing: roofline on {self.spec.describe()}"


class BenchmarkTiming:
    """Unit times from each op benchmarked alone on the local device (``device``; default the model's, the CPU for a
    model on the meta device), without running the step: ``benchmark.benchmark_units`` (shapes from a fake copy,
    random inputs and weights, forward and backward, median of ``repeats``; repeated blocks once, each instance's
    unit k taking the first instance's unit k). An op that cannot run alone gets its roofline time on the local
    device, calibrated (``local_device_spec``), backward ``BACKWARD_FACTOR`` times its forward; ``describe`` counts
    them. A module-level capture has no op graph to benchmark: it is timed by that roofline whole, and says so.

    The result: unit ``forward_ms`` (``forward_ms_timed_at`` at a first instance), ``forward_ms`` their sum,
    ``step_ms`` the forward plus the benchmarked backwards (the loss function and autograd's own walk not counted),
    memory events untouched, and ``times_measured`` True: the times are measured on the device, op by op, not
    placeholders, so the plan's notes name this timing instead of calling them placeholders. ``report`` keeps what
    the last ``timed`` did."""

    name = "benchmark"
    uses_measured_times = False  # every op timed alone

    def __init__(self, device: torch.device | str | None = None, *, repeats: int = 3) -> None:
        if repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {repeats!r}")
        self.device = local_device(device) if device is not None else None
        self.repeats = repeats
        self.report: BenchmarkReport | None = None

    def timed(self, trace: StepTrace, graph: Graph, step: StepInputs) -> StepTrace:
        device = self.device if self.device is not None else local_device(step.device)
        dtype = compute_dtype(graph, step)
        if graph.kind is CaptureKind.MODULE:
            spec = local_device_spec(device)
            self.report = BenchmarkReport(device=str(device), units=len(trace.units), roofline_spec=spec.describe())
            timed = roofline_trace(trace, spec, dtype, parameter_read_bytes=parameter_read_bytes(graph))
            return dataclasses.replace(timed, times_measured=True)
        bench = benchmark_units(graph, step, trace, device, repeats=self.repeats)
        forward_ms = [t.forward_ms if t is not None else 0.0 for t in bench.times]
        backward_ms = [t.backward_ms if t is not None else 0.0 for t in bench.times]
        missing = [u for u, t in enumerate(bench.times) if t is None]
        spec_text = None
        if missing:  # calibrating the local device takes a second or two: only when an op did not run alone
            spec = local_device_spec(device)
            spec_text = spec.describe()
            lines = unit_rooflines(trace, spec, dtype, parameter_read_bytes=parameter_read_bytes(graph))
            for unit in missing:
                forward_ms[unit] = lines[unit].forward_ms
                backward_ms[unit] = BACKWARD_FACTOR * lines[unit].forward_ms
        self.report = BenchmarkReport(
            device=str(device), units=len(trace.units), benchmarks=bench, roofline_spec=spec_text,
        )
        units = tuple(
            dataclasses.replace(
                unit, forward_ms=forward_ms[unit.index],
                forward_ms_timed_at=None if bench.timed_at[unit.index] == unit.index else bench.timed_at[unit.index],
            )
            for unit in trace.units
        )
        return dataclasses.replace(
            trace, units=units, forward_ms=sum(forward_ms), step_ms=sum(forward_ms) + sum(backward_ms),
            times_measured=True,
        )

    def priced(self, costs: CostModel) -> CostModel:
        return costs  # the actions were priced on the model's device, the one benchmarked

    def describe(self, trace: StepTrace) -> str:
        report = self.report
        if report is None:
            return f"timing: benchmark of each op alone on {self.device or 'the local device'}"
        if report.benchmarks is None:
            return (
                f"timing: benchmark not possible on a module-level capture (no op graph to run op by op): "
                f"roofline on {report.roofline_spec} instead"
            )
        bench = report.benchmarks
        by_roofline = sum(t is None for t in bench.times)
        text = (
            f"timing: benchmark on {report.device}: each op run alone at its shapes on random inputs, forward and "
            f"backward, median of {self.repeats} ({bench.benchmarked} ops run for {report.units} units: repeated "
            f"blocks once, {bench.seconds:.1f} s); {by_roofline} of {report.units} ops timed by roofline"
        )
        if not by_roofline:
            return text
        return f"{text} on {report.roofline_spec}, which could not run alone (first: {bench.failures[0][1]})"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BenchmarkReport:
    """What ``BenchmarkTiming.timed`` did: the device, the units, the op benchmarks (None: a module-level capture,
    timed by roofline whole) and the roofline spec that timed what the benchmark could not (None: none needed)."""

    device: str
    units: int
    benchmarks: OpBenchmarks | None = None
    roofline_spec: str | None = None


def check_timing(timing: object) -> None:
    """A timing is one of ``TIMINGS`` or a ``Timing`` (an object with ``name`` and ``timed``)."""
    if isinstance(timing, str):
        if timing not in TIMINGS:
            raise ValueError(f"timing={timing!r}: choose one of {', '.join(TIMINGS)}, or give a Timing")
    elif not callable(getattr(timing, "timed", None)):
        raise TypeError(f"timing must be one of {TIMINGS} or a Timing (name, timed), got {type(timing).__name__}")


def uses_measured_times(timing: str | Timing, target: str | DeviceSpec | None) -> bool:
    """Whether the timing ``timing_for(timing, target, ...)`` chooses may keep the times a measured trace took: "auto"
    and "measured" without a target, and a ``Timing`` given unless it says it replaces them all
    (``uses_measured_times = False``, as roofline and benchmark do). Where it replaces them, a measured trace need
    not run its timed steps."""
    if not isinstance(timing, str):
        return getattr(timing, "uses_measured_times", True)  # a timing of the user's may read them
    return timing in ("auto", "measured") and target is None


def priced_device(target: DeviceSpec | None, timing: str | Timing) -> DeviceSpec | None:
    """The device whose figures price what a plan moves besides its times (host copies, sends between stages): the
    target, else the device a ``RooflineTiming`` given as ``timing`` is a roofline of (the times and the moves of one
    device, as ``RooflineTiming.priced`` prices a planner's link); None: measure them on this machine."""
    if target is not None:
        return target
    return timing.spec if isinstance(timing, RooflineTiming) else None


def timing_for(
    timing: str | Timing, target: str | DeviceSpec | None, device: torch.device, *, trace_measured: bool = True
) -> Timing:
    """The timing ``timing`` names ("auto", "measured", "roofline", "benchmark", or a ``Timing``, used as it is) for
    ``target`` (a table name, a ``DeviceSpec``, or None: the model's device), for a trace whose source measured its
    times (``trace_measured``) or not (a fake trace). "auto": roofline with a target; without one, measured when the
    trace has measured times, else benchmark. "roofline" without a target: the model's device, calibrated
    (``local_device_spec``; the CPU for a model on the meta device). "benchmark" times the local device only."""
    check_timing(timing)
    if not isinstance(timing, str):
        return timing
    spec = device_spec(target) if target is not None else None
    if timing == "measured":
        if spec is not None:
            raise ValueError(
                f"timing='measured' times the step on the model's device ({device}), not on target={spec.name!r}; "
                "use timing='roofline' (or 'auto') to plan for another device"
            )
        if not trace_measured:
            raise ValueError(
                "timing='measured': the trace source ran no real step and measured no times (a fake trace); use "
                "timing='benchmark' (each op timed alone on this machine) or 'roofline' (FLOPs and bytes), or 'auto'"
            )
        return MeasuredTiming()
    if timing == "benchmark":
        if spec is not None and spec.name != local_spec_name(device):
            raise ValueError(
                f"timing='benchmark' times each op on this machine's {local_device(device)}, not on "
                f"target={spec.name!r}; use timing='roofline' (or 'auto') to plan for another device"
            )
        return BenchmarkTiming(local_device(device))
    if timing == "auto" and spec is None:
        return MeasuredTiming() if trace_measured else BenchmarkTiming(local_device(device))
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
    """Apply the timing ``timing_for(timing, target, step.device, trace_measured=trace.times_measured)`` to a
    captured, traced and priced step."""
    timer = timing_for(timing, target, step.device, trace_measured=trace.times_measured)
    priced = getattr(timer, "priced", None)
    describe = getattr(timer, "describe", None)
    timed = timer.timed(trace, graph, step)
    # described after timing: a benchmark's note counts the ops it could not run alone
    note = describe(trace) if callable(describe) else f"timing: {timer.name}"
    return TimedStep(
        trace=timed,
        costs=priced(costs) if callable(priced) else costs,
        target=(getattr(timer, "spec", None) or device_spec(target)) if target is not None else None,
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
