"""The whole step of a pipeline plan, known once for every candidate stage: which trace knows it, its unit times,
every node's value on the example microbatch and the tensors that cross the candidate cuts.

The trace is chosen as for one device (``planning/build.py``: ``traced_step``, ``device_memory_for``): "measured"
runs the whole step on the model's device, "fake" on fake tensors (``measure/fake.py``), "auto" is fake when the
model or its inputs are on the meta device or when the fake trace predicts the unmodified step above the device
memory (one device cannot run it), measured otherwise. The timing gives the unit times (``measure/timing.py``'s
``with_timing``): measured times are the median of three measured traces (one trace on a busy machine gave the same
split 13 ms and 3763 ms), other timings (roofline for a target, each op benchmarked alone for a fake trace without
one) time the one trace.

On a measured trace the graph runs on the real microbatch, as autockpt always did, and the crossing tensors are
detached copies of the real ones. On a fake trace everything runs on fake copies of the model and the microbatch
under a ``FakeTensorMode`` (``measure/fake_copy.py``, ``FakeStep``): no real step, no weight read, the user's model
untouched (a model on the meta device stays there), and the crossing tensors are meta tensors of the same shapes,
strides and dtypes, which the stage planners trace on fakes in turn (``trace="fake"``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

from autockpt.core.devices import DeviceSpec, device_spec
from autockpt.measure.fake import FakeStep, FakeTrace
from autockpt.measure.fake_copy import fake_copies, fake_of, meta_of_fake
from autockpt.measure.sources import StepInputs, TraceRequest
from autockpt.measure.timing import priced_device, uses_measured_times, with_timing
from autockpt.measure.trace import trace_step
from autockpt.pipeline.request import PipelineRequest
from autockpt.pipeline.stage_graphs import CrossingValue, crossing_tensors, graph_values
from autockpt.planning.build import device_memory_for, traced_step
from autockpt.planning.options import TRACES
from autockpt.record_types import Provenance
from autockpt.types import CostModel, Graph, StepTrace


@dataclass(frozen=True, kw_only=True, slots=True)
class WholeStep:
    """The whole step on the example microbatch, as every candidate stage sees it."""

    graph: Graph
    step: StepInputs  # the model, the first microbatch and its loss
    fake: bool  # traced on fake tensors: every run here is on fake copies, and crossing tensors are meta tensors
    device: torch.device  # where the step runs (the fake step: where ``FakeTrace`` runs it, the CPU for meta)
    provenance: Provenance  # the trace and timing that made the unit times, for which device
    notes: tuple[str, ...]  # the trace, timing and device (and why trace="auto" chose the trace): the plan's notes
    unit_ms: tuple[float, ...]  # forward time of every unit
    backward_ratio: float  # backward time over forward time, of the whole step
    values: dict[str, CrossingValue]  # every node's value (tensor or not, bytes), for where the graph can be cut
    baseline_peak_bytes: int  # the unmodified step's peak on one microbatch (what a loss in chunks is weighed against)
    trace: str  # what the user asked ("auto", "fake", "measured"): the stage planners' trace on a measured step
    timing: Any  # the timing the user asked for, passed to the stage planners
    target: DeviceSpec | None
    device_memory_bytes: int | None  # as the user gave it (the stage planners find their own otherwise)

    @staticmethod
    def profile(
        request: PipelineRequest, graph: Graph, *, trace: str, timing: Any, target: str | DeviceSpec | None,
        device_memory_bytes: int | None,
    ) -> WholeStep:
        spec = device_spec(target) if target is not None else None
        target_value, loss_fn = request.microbatch_target, request.loss_fn
        step = StepInputs.check(
            request.model, request.microbatch_args, request.microbatch_kwargs,
            lambda output: loss_fn(output, target_value),
        )
        memory = device_memory_for(step, device_memory_bytes, spec)
        # every unit timed (the stage times are sums of unit times), no gradient lifetimes: the table's traces
        chosen = traced_step(trace, graph, step, TraceRequest(
            time_repeated_blocks_once=False, gradient_lifetimes=False, times_used=uses_measured_times(timing, target),
        ), memory)
        fake = chosen.source == "fake"
        device = FakeTrace().trace_device(step) if fake else step.device
        timed = with_timing(timing, spec, graph, step, chosen.trace, CostModel(device=str(device), prices=()))
        traces = [timed.trace]
        if timed.timing == "measured":  # measured times: the median of three traces of the whole step
            traces += [trace_step(graph, step.args, step.kwargs, step.loss) for _ in range(2)]
        provenance = Provenance(
            trace=chosen.source, timing=timed.timing, device=spec.name if spec is not None else str(device),
            device_memory_bytes=memory, reason=chosen.reason,
        )
        return WholeStep(
            graph=graph, step=step, fake=fake, device=device, provenance=provenance,
            notes=(f"planned from a {provenance.describe()}", timed.note),
            unit_ms=_unit_ms(traces, len(graph.units)), backward_ratio=_backward_ratio(traces),
            values=_on_values(graph, step, fake, device, graph_values),
            baseline_peak_bytes=chosen.trace.baseline_peak_bytes,
            trace=trace, timing=timing, target=spec, device_memory_bytes=device_memory_bytes,
        )

    def crossing_tensors(self, after_units: Sequence[int]) -> dict[str, torch.Tensor]:
        """The tensors crossing a cut after each of these units, by fx node name: detached copies of the real ones, or
        meta tensors of their shapes, strides and dtypes (a fake trace)."""
        return _on_values(
            self.graph, self.step, self.fake, self.device,
            lambda graph, args, kwargs: crossing_tensors(
                graph, args, kwargs, after_units, keep=_meta_copy if self.fake else None,
            ),
        )

    def planner_arguments(self) -> dict[str, Any]:
        """How every stage's planner knows its stage: on fakes on this step's device when the whole step was, with
        the same timing, target and device memory."""
        return {
            "trace": FakeTrace(device=self.device) if self.fake else self.trace, "timing": self.timing,
            "target": self.target, "device_memory_bytes": self.device_memory_bytes,
        }

    def stage_module(self, module: nn.Module) -> nn.Module:
        """The module a stage planner plans: the stage itself, or for a fake trace a copy on the meta device, as its
        inputs are (a stage of a real model on meta inputs would mix devices, and capture would fall to the module
        level); nothing of the user's is touched, no weight is read."""
        if not self.fake:
            return module
        (copied,), _ = fake_copies((module,), (), meta_of, {}, [])
        return copied

    def link_gb_per_s(self) -> float:
        """What sends between stages are priced at when not given: the target's copy bandwidth (its memory bandwidth
        over two: a copy reads and writes every byte); else, with the times of a roofline, that roofline's device's
        (the times and the sends of one device, whatever the machine's load); else a copy measured on the device the
        step runs on."""
        spec = priced_device(self.target, self.timing)
        if spec is not None:
            return spec.hbm_gb_per_s / 2
        return device_copy_gb_per_s(self.device)

    def stage_forward(self, graph: Graph, step: StepInputs, loss: Callable[[Any], torch.Tensor]) -> tuple[Any, Any]:
        """The output and loss of a stage's forward without gradients (``graph``, ``step``: its planner's capture
        and call), on the real values or, for a fake trace, on fake copies (whose captured graph has its meta-device
        constants moved to the fake step's device)."""
        if not self.fake:
            with torch.no_grad(), torch.random.fork_rng():
                output = step.model(*step.args, **step.kwargs)
                return output, loss(output)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        copied = FakeStep.of(graph, step, mode, self.device)
        with torch.no_grad(), torch.random.fork_rng(), mode:
            output = copied.graph.executable(*copied.args, **copied.kwargs)
            return output, loss(output)


def check_trace(trace: Any) -> None:
    if not isinstance(trace, str) or trace not in TRACES:
        raise ValueError(
            f"trace={trace!r}: a pipeline plan takes one of {', '.join(TRACES)} (a TraceSource object is for one "
            "device: Planner.from_model)"
        )


def _on_values(
    graph: Graph, step: StepInputs, fake: bool, device: torch.device, run: Callable[[Graph, tuple, dict], Any]
) -> Any:
    """``run`` on the graph and the microbatch: the real ones, or fake copies under a ``FakeTensorMode``."""
    if not fake:
        return run(graph, step.args, step.kwargs)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    copied = FakeStep.of(graph, step, mode, device)
    with mode:
        return run(copied.graph, copied.args, copied.kwargs)


def meta_of(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``tensor``'s shape, strides and dtype (a parameter stays a parameter); no data is read."""
    meta = tensor.detach().to("meta")
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(meta, requires_grad=tensor.requires_grad)
    return meta.requires_grad_(tensor.requires_grad) if tensor.requires_grad else meta


def _meta_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor laid out as a detached copy of this (fake) tensor would be: the same storage bytes."""
    return meta_of_fake(tensor.detach().clone()).requires_grad_(tensor.requires_grad)


class FakesBeside:
    """Tensors a stage's loss closes over (the target, the seed gradients of a middle stage), as the loss needs them
    beside its output: themselves on a real step; on a fake one (a stage traced on fakes), fakes of them in the
    output's ``FakeTensorMode`` and on its device (from real or meta tensors), made once per mode and held here as
    long as the real ones live. (A fake made at each use dies with its last use: the trace would count the target's
    storage freed after the loss's backward, where the real one stays to the end of the step.)"""

    def __init__(self, value: Any) -> None:
        self.value = value
        self._held: list[tuple[FakeTensorMode, Any]] = []  # (mode, value as its fakes); the modes held, never reused

    def __call__(self, output: Any) -> Any:
        anchor = next((leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, FakeTensor)), None)
        if anchor is None:
            return self.value
        for mode, converted in self._held:
            if mode is anchor.fake_mode:
                return converted
        converted = pytree.tree_map(
            lambda leaf: fake_of(leaf, anchor.fake_mode, anchor.device)
            if isinstance(leaf, torch.Tensor) and not isinstance(leaf, FakeTensor) else leaf,
            self.value,
        )
        self._held.append((anchor.fake_mode, converted))
        return converted


def _unit_ms(traces: list[StepTrace], num_units: int) -> tuple[float, ...]:
    return tuple(statistics.median(t.units[u].forward_ms for t in traces) for u in range(num_units))


def _backward_ratio(traces: list[StepTrace]) -> float:
    return max(statistics.median(t.step_ms / max(t.forward_ms, 1e-9) for t in traces) - 1.0, 0.0)


def device_copy_gb_per_s(device: torch.device) -> float:
    """Copy bandwidth on ``device``, GB/s (GB = 10^9 bytes): what sends between stages are priced at when not given."""
    source = torch.empty(16 * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    timings = []
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - started)
    return source.nbytes / min(timings) / 1e9
