"""Building a planner from a model: choose how the step is known (``trace=``, ``timing=``), for which device
(``target=``, ``device_memory_bytes=``), then capture, trace and price it (``Planner.from_model`` is this).

The trace (``measure/sources.py``, ``measure/fake.py``):

* ``"measured"``: the unmodified step runs on the model's device (``MeasuredTrace``), as autockpt always did;
* ``"fake"``: the step runs on fake tensors (``FakeTrace``): memory exact, no real step, no weights read;
* ``"auto"``: fake when the model or the inputs are on the meta device (there is nothing to run), or when the
  device's memory is known (``device_memory_bytes=``, the target's memory, a CUDA device's free memory) and the fake
  trace predicts the unmodified step above it (running it would run out of memory); measured otherwise. A step the
  fake trace cannot run (tensor values in its Python control flow) is measured when the model is real; a measured
  step that runs out of CUDA memory is traced on fakes instead.

The timing (``measure/timing.py``) is chosen after the trace: measured times with a measured trace, benchmarked ops
with a fake trace on the local device, roofline times for another device (``target=``).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from autockpt.core.devices import DeviceSpec, device_spec
from autockpt.core.simulate import simulate
from autockpt.core.solve.base import recompute_actions
from autockpt.errors import FakeStepError, ProfileError
from autockpt.measure.capture import capture
from autockpt.measure.costs import calibrate
from autockpt.measure.fake import FakeTrace
from autockpt.measure.fake_copy import has_no_values, meta_of_fake, model_on_meta, without_values
from autockpt.measure.sources import MeasuredTrace, StepInputs, TraceRequest, TraceSource
from autockpt.measure.step import alternating_step_seconds, relative_step_times
from autockpt.measure.timing import uses_measured_times, with_timing
from autockpt.planning.eager_check import compare_with_eager
from autockpt.planning.options import PlanOptions, checkpoint_choice
from autockpt.record_types import Provenance
from autockpt.runtime.model_state import enter_training_modes, preserved_model_state
from autockpt.types import Action, CaptureKind, CostModel, Graph, OptimizerStepCost, StepTrace
from autockpt.units import format_bytes

logger = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ChosenTrace:
    """The step's trace and which source made it, with why ``"auto"`` chose it."""

    trace: StepTrace
    source: str  # the trace source's name: "measured", "fake", or a custom source's
    reason: str = ""


def on_meta(step: StepInputs) -> bool:
    """Whether the model or any example input is on the meta device (or a fake tensor): no real step can run."""
    return without_values(step.model, step.args, step.kwargs)


def aligned_step(step: StepInputs) -> StepInputs:
    """``step`` with example inputs the capture can run beside the model (one tensor given twice stays one tensor):

    * beside a model on the meta device, every input tensor becomes a meta tensor of its shape, strides and dtype
      (fx and export check a graph by running it: real CPU token ids beside meta weights fail there);
    * beside a real model, inputs given as meta or fake tensors (of the user's own ``FakeTensorMode``) become tensors
      of their shapes on the model's device, floating ones random and the others zeros (in range for any embedding):
      they are captured and traced on fakes, never run for real (``trace="measured"`` on them is refused).
    """
    on_meta_device = model_on_meta(step.model)
    target_device = torch.device("meta") if on_meta_device else step.model_device
    made: dict[int, torch.Tensor] = {}
    storages: dict[Any, torch.UntypedStorage] = {}  # views of one storage stay views of one storage

    def aligned(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        plain_meta = leaf.device.type == "meta" and not isinstance(leaf, FakeTensor)
        if plain_meta if on_meta_device else not has_no_values(leaf):  # already where the model is
            return leaf
        if id(leaf) not in made:
            made[id(leaf)] = _same_layout_on(leaf, target_device, storages)
        return made[id(leaf)]

    args, kwargs = pytree.tree_map(aligned, (step.args, step.kwargs))
    if not made:
        return step
    return dataclasses.replace(step, args=args, kwargs=kwargs)


def _same_layout_on(
    tensor: torch.Tensor, device: torch.device, storages: dict[Any, torch.UntypedStorage]
) -> torch.Tensor:
    """A tensor on ``device`` laid out as ``tensor`` in a storage of the same bytes (a microbatch sliced from a batch
    keeps the batch's storage, as the trace counts it); values random if floating, zeros otherwise (token ids in
    range for any embedding). Views of one storage share the new one."""
    if isinstance(tensor, FakeTensor):
        tensor = meta_of_fake(tensor)
    source = tensor.untyped_storage()
    # real storages are told apart by address; a meta one has none, so each meta input keeps a storage of its own
    key = source.data_ptr() if source.device.type != "meta" else object()
    if key not in storages:
        storages[key] = torch.UntypedStorage(source.nbytes(), device=device)
        if device.type != "meta":
            filler = torch.empty(0, dtype=tensor.dtype, device=device).set_(
                storages[key], 0, (source.nbytes() // tensor.element_size(),), (1,)
            )
            with torch.no_grad():
                filler.normal_() if tensor.is_floating_point() or tensor.is_complex() else filler.zero_()
    made = torch.empty(0, dtype=tensor.dtype, device=device)
    made.set_(storages[key], tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
    return made.requires_grad_(tensor.requires_grad)


def device_memory_for(
    step: StepInputs, device_memory_bytes: int | None, target: DeviceSpec | None
) -> int | None:
    """The device memory to plan for: ``device_memory_bytes`` as given, else the target's, else on CUDA what is free
    now plus what this process's allocator holds (``local_memory_bytes``); None on a CPU without either."""
    if device_memory_bytes is not None:  # checked when PlanOptions was made
        return device_memory_bytes
    if target is not None:
        return target.memory_bytes
    device = step.device
    if device.type == "cuda":
        return local_memory_bytes(step)
    return None


def traced_step(
    trace: str | TraceSource, graph: Graph, step: StepInputs, request: TraceRequest, device_memory_bytes: int | None,
    *, without_values: bool | None = None,
) -> ChosenTrace:
    """The step traced as ``trace`` says (module docstring): ``"auto"``'s choice with its reason. ``without_values``:
    the model or the example inputs have no values (meta or fake tensors; default: read from ``step``). A step run
    for real must also fit the local device (``local_memory_bytes``), whatever device it is planned for."""
    if not isinstance(trace, str):
        return ChosenTrace(trace=trace.trace(graph, step, request), source=trace.name)
    meta = on_meta(step) if without_values is None else without_values
    if trace == "measured":
        if meta:
            raise ValueError(
                f"trace='measured' runs the real step, but {type(step.model).__name__} or its example inputs are on "
                "the meta device (no values to run); use trace='fake' (or 'auto'), which runs no real step"
            )
        return ChosenTrace(trace=MeasuredTrace().trace(graph, step, request), source="measured")
    if trace == "fake":
        return ChosenTrace(trace=FakeTrace().trace(graph, step, request), source="fake")
    if meta:
        return ChosenTrace(
            trace=FakeTrace().trace(graph, step, request), source="fake",
            reason="the model or its inputs are on the meta device (or fake tensors)",
        )
    if device_memory_bytes is None:  # nothing known of the memory (a CPU, no target): measured, as always
        return _measured_or_fake(graph, step, request, "")
    local = local_memory_bytes(step)  # a real step must fit where it runs too (a target's memory may be larger)
    memory = device_memory_bytes if local is None else min(device_memory_bytes, local)
    try:
        fake = FakeTrace().trace(graph, step, request)
    except FakeStepError as error:
        logger.info("trace='auto': the fake trace cannot run this step (%s); measuring it", error.op)
        return _measured_or_fake(graph, step, request, f"the fake trace cannot run this step ({error.op})")
    peak = fake.baseline_peak_bytes
    which = "the device memory" if memory == device_memory_bytes else f"this machine's free {step.device.type} memory"
    if peak > memory:
        return ChosenTrace(
            trace=fake, source="fake",
            reason=(
                f"the unmodified step's predicted peak ({format_bytes(peak)}) is above {which} "
                f"({format_bytes(memory)}): no unmodified step was run"
            ),
        )
    return _measured_or_fake(
        graph, step, request,
        f"the unmodified step's predicted peak ({format_bytes(peak)}) fits {which} ({format_bytes(memory)})",
    )


def local_memory_bytes(step: StepInputs) -> int | None:
    """What a real step may use where it would run: on CUDA the free memory plus what this process's allocator holds
    (the trace counts everything allocated, the step's and the rest); on the CPU the host memory available now."""
    device = step.device
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return free_bytes + torch.cuda.memory_reserved(device)
    if device.type == "cpu":
        from autockpt.runtime.offload import available_host_bytes

        return available_host_bytes()
    return None


def _measured_or_fake(graph: Graph, step: StepInputs, request: TraceRequest, reason: str) -> ChosenTrace:
    """The measured trace; the fake one when the real step runs out of memory (``trace_step`` wraps the error in a
    ``ProfileError``). The fake trace starts after the failed step's tensors are gone: it counts what is allocated."""
    try:
        return ChosenTrace(trace=MeasuredTrace().trace(graph, step, request), source="measured", reason=reason)
    except (torch.OutOfMemoryError, ProfileError) as error:
        if not _out_of_memory(error):
            raise
        logger.warning("trace='auto': the unmodified step ran out of memory (%s); tracing it on fakes", error)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return ChosenTrace(
        trace=FakeTrace().trace(graph, step, request), source="fake",
        reason="the unmodified step ran out of device memory when measured",
    )


def _out_of_memory(error: BaseException) -> bool:
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, torch.OutOfMemoryError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BuiltStep:
    """What a planner is made from (``Planner(graph, trace, costs, options, ...)``): the captured graph, its timed
    trace and the prices, the device planned for and how the step was known."""

    step: StepInputs  # the step as captured (inputs aligned with the model: ``aligned_step``)
    example_values: bool  # False: the model or the inputs had no values (meta, fake): no real step can be measured
    graph: Graph
    trace: StepTrace
    costs: CostModel
    target: DeviceSpec | None  # a device other than the model's (roofline timing), else None
    provenance: Provenance
    notes: tuple[str, ...]  # every plan carries them: how the times were made, why the trace was chosen
    capture_time_s: float
    profile_time_s: float


def built_step(step: StepInputs, options: PlanOptions, *, on_stage: Callable[[str], None] | None) -> BuiltStep:
    """``Planner.from_model``'s work on a checked step: capture, trace, time and price (where the step is known from
    and for which device: ``options.trace``, ``timing``, ``target``, ``device_memory_bytes``)."""
    without_values = on_meta(step)  # before the inputs are aligned: placeholders stand for no values
    step = aligned_step(step)
    spec = device_spec(options.target) if options.target is not None else None
    memory = device_memory_for(step, options.device_memory_bytes, spec)
    stage = on_stage or (lambda name: None)
    with preserved_model_state(step.model, step.args, step.kwargs):
        enter_training_modes(step.model)
        stage("capture")
        started = time.perf_counter()
        graph = capture(step.model, step.args, step.kwargs)
        captured = time.perf_counter()
        stage("profile")
        return _traced_and_priced(
            step, graph, options, options.trace, spec, memory, without_values, capture_time_s=captured - started,
        )


def built_for_graph(built: BuiltStep, graph: Graph, options: PlanOptions) -> BuiltStep:
    """``built``'s step with another program of it (the loss computed in chunks: ``planning/loss_chunks.py``), traced
    by the trace source that traced ``built`` (the same choice of "auto"), timed and priced alike."""
    trace = options.trace if not isinstance(options.trace, str) else (
        built.provenance.trace if built.provenance.trace in ("measured", "fake") else options.trace)
    spec = device_spec(options.target) if options.target is not None else None
    with preserved_model_state(built.step.model, built.step.args, built.step.kwargs):
        enter_training_modes(built.step.model)
        return _traced_and_priced(
            built.step, graph, options, trace, spec, built.provenance.device_memory_bytes, not built.example_values,
            capture_time_s=built.capture_time_s, eager=built.provenance,
            optimizer_step=built.trace.loop.optimizer if built.trace.loop is not None else None,
        )


def trace_request(options: PlanOptions, graph: Graph, spec: DeviceSpec | None,
                  optimizer_step: OptimizerStepCost | None = None) -> TraceRequest:
    """What a planner of ``options`` asks the trace of ``graph`` for (``spec``: the target planned for, if any;
    ``optimizer_step``: the optimizer's step measured already, on another program of the same step)."""
    return TraceRequest(
        time_repeated_blocks_once=solves_by_blocks(options, graph),
        gradient_lifetimes=Action.RECOMPUTE_OWN in recompute_actions(checkpoint_choice(options), graph.kind),
        optimizer=options.optimizer, gradient_accumulation_steps=options.gradient_accumulation_steps,
        output_held=options.output_held, planned_device_type=spec.device_type if spec is not None else None,
        optimizer_step=optimizer_step, times_used=uses_measured_times(options.timing, options.target),
    )


def _traced_and_priced(
    step: StepInputs, graph: Graph, options: PlanOptions, trace: str | TraceSource, spec: DeviceSpec | None,
    memory: int | None, without_values: bool, *, capture_time_s: float, eager: Provenance | None = None,
    optimizer_step: OptimizerStepCost | None = None,
) -> BuiltStep:
    """Trace, time and price ``graph`` (a capture of ``step``), with the self-check against the eager model where a
    real step ran (``eager``: its figures known already, from the model's own captured program; ``optimizer_step``:
    the optimizer's step measured on that program, the same parameters)."""
    started = time.perf_counter()
    # a model on the meta device is planned for the CPU, where its fake step runs and its machinery is priced
    price_device = torch.device("cpu") if step.device.type == "meta" else step.device
    actions = recompute_actions(checkpoint_choice(options), graph.kind)
    chosen = traced_step(trace, graph, step, trace_request(options, graph, spec, optimizer_step), memory,
                         without_values=without_values)
    if chosen.reason:
        logger.info("trace='auto' chose the %s trace: %s", chosen.source, chosen.reason)
    if chosen.trace.loop is not None:
        logger.info("%s", chosen.trace.loop.describe())
    offload = (Action.OFFLOAD,) if options.host_pool_gb != 0 else ()
    if offload and graph.kind is CaptureKind.MODULE:
        refuse_offload(options.host_pool_gb, step.model, graph)
    costs = calibrate(price_device, (*actions, *offload))
    timed = with_timing(options.timing, spec, graph, step, chosen.trace, costs)  # measured, benchmark or roofline
    compared = None
    if eager is None and chosen.source == "measured":
        # where a real step ran, the self-check: the captured program against the user's eager model
        # (the trace measured the captured program's step already, unless it covers a loop around it)
        traced = simulate(timed.trace, timed.costs, ()).peak_bytes if timed.trace.loop is None else None
        compared = compare_with_eager(step, graph, traced)
    figures = compared if compared is not None else eager  # both carry the two peaks (or neither is known)
    provenance = Provenance(
        trace=chosen.source, timing=timed.timing, device=spec.name if spec is not None else str(price_device),
        device_memory_bytes=memory, reason=chosen.reason,
        eager_peak_bytes=figures.eager_peak_bytes if figures is not None else None,
        captured_peak_bytes=figures.captured_peak_bytes if figures is not None else None,
    )
    return BuiltStep(
        step=step, example_values=not without_values,
        graph=graph, trace=timed.trace, costs=timed.costs, target=timed.target, provenance=provenance,
        notes=(timed.note, *([f"trace: {chosen.source} ({chosen.reason})"] if chosen.reason else []),
               *([compared.warning] if compared is not None and compared.warning else [])),
        capture_time_s=capture_time_s, profile_time_s=time.perf_counter() - started,
    )


PROGRAM_TIMING_ROUNDS = 5  # alternating rounds that time another program of the step against the captured one


def priced_against(reference: BuiltStep, reference_graph: Graph, program: BuiltStep) -> BuiltStep:
    """``program`` (another program of ``reference``'s step: the loss in chunks) timed on ``reference``'s
    measurements, so that the two are compared on what differs between them, not on the noise of two traces (two
    traces of one CPU step were 20 % apart, enough to pick the slower program). Where both steps were measured on
    the device: each unit both programs run (by node name) takes ``reference``'s time, and the step takes
    ``reference``'s time scaled by the median ratio of the two in alternating rounds (``reference_graph``:
    ``reference``'s program, runnable, not rewritten). Other times (benchmarked, roofline, placeholders) are each
    program's own."""
    if not (reference.provenance.timing == "measured" and program.provenance.timing == "measured"):
        return program
    forward_ms = {unit.name: cost.forward_ms for unit, cost in zip(reference.graph.units, reference.trace.units)}
    units = tuple(dataclasses.replace(cost, forward_ms=forward_ms.get(unit.name, cost.forward_ms))
                  for unit, cost in zip(program.graph.units, program.trace.units))
    step = reference.step
    try:
        with preserved_model_state(step.model, step.args, step.kwargs):
            enter_training_modes(step.model)
            seconds = alternating_step_seconds(
                [reference_graph.executable, program.graph.executable], step.args, step.kwargs, step.loss,
                rounds=PROGRAM_TIMING_ROUNDS,
            )
    except torch.OutOfMemoryError:  # the device filled up since the trace: each program keeps its own times
        logger.warning("timing a program of the step against the captured one ran out of device memory; its own "
                       "trace's times are used")
        return program
    ratio = relative_step_times(seconds)[1]
    logger.info("a program of the step timed against the captured one in %d alternating rounds: %.3f x its step",
                PROGRAM_TIMING_ROUNDS, ratio)
    trace = dataclasses.replace(program.trace, units=units, forward_ms=sum(u.forward_ms for u in units),
                                step_ms=reference.trace.step_ms * ratio)
    return dataclasses.replace(program, trace=trace)


def solves_by_blocks(options: PlanOptions, graph: Graph) -> bool:
    """Repeated blocks are solved (and timed) once per family, unless switched off or the capture is module-level
    (which can only checkpoint whole submodule calls: its candidates are those calls)."""
    return options.solver.repeated_blocks and graph.kind is not CaptureKind.MODULE


def refuse_offload(host_pool_gb: float | str, model: torch.nn.Module, graph: Graph) -> None:
    raise ValueError(
        f"host_pool_gb={host_pool_gb!r}: offloading needs a graph capture, but {type(model).__name__} "
        f"fell to the module-level capture ({graph.notes[0] if graph.notes else 'no graph'}); "
        "plan it without a pool (host_pool_gb=0), which recomputes only"
    )
