"""Trace: Graph -> StepTrace. Runs the captured, unmodified step and measures what every unit costs.

One tracked step records the memory timeline: a ``TorchDispatchMode`` (``storage_tracker.py``) sees every storage
that ops create (the same accounting as ``torch.distributed._tools.mem_tracker.MemTracker``), weak references tell
when each one is freed, and ``saved_tensors_hooks`` tell which unit saved which storage for backward and when
backward unpacked it; torch's FLOP counter counts each unit's FLOPs in that step's forward (``flops.py``). Timed
steps give per-unit forward milliseconds (median of repeats) and the step time. What each action would add on top
(the checkpoint machinery) is priced apart, by ``costs.py``. The caller keeps the model's state (see
``autockpt.runtime.model_state``).

Under autocast every step starts with autocast's cache empty (``model_state.start_autocast_step``, which the optimized
module does too). The low-precision copies of parameters that autocast caches are recorded as storages no unit owns
(``OUTSIDE_GRAPH_UNIT``, no readers or savers), like the parameters themselves: the cache holds them until the
context exits, so no checkpoint frees them and no recomputation makes them again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import statistics
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autockpt.core.structure import find_repeated_blocks
from autockpt.errors import LossFunctionError, ProfileError
from autockpt.measure.capture import ModuleUnitRecorder
from autockpt.measure.flops import ForwardFlops
from autockpt.measure.storage_tracker import GradientRecorder, StorageRecord, StorageTracker
from autockpt.runtime.fx_nodes import compute_nodes
from autockpt.runtime.model_state import start_autocast_step
from autockpt.types import (
    OUTSIDE_GRAPH_UNIT,
    CaptureKind,
    GradientVersion,
    Graph,
    MemoryEvent,
    Phase,
    StepTrace,
    StorageLife,
    UnitCost,
)

logger = logging.getLogger(__name__)

LossFn = Callable[[Any], torch.Tensor]


def trace_step(
    graph: Graph,
    args: tuple,
    kwargs: dict,
    loss_fn: LossFn,
    *,
    timing_repeats: int = 3,
    time_repeated_blocks_once: bool = True,
    gradient_lifetimes: bool = False,
    timed: bool = True,
    output_held: bool = True,
    warm_up: bool = True,
) -> StepTrace:
    """Measure the unmodified training step of ``graph`` on the example inputs. ``gradient_lifetimes``: also record
    how long the gradients of forward tensors lived (the simulation of ``Action.RECOMPUTE_OWN`` needs them).
    ``timed=False``: no timed steps; every time in the trace is 0 and ``times_measured`` False (``FakeTrace`` traces
    fake tensors, which take none; a measured trace whose timing replaces every time skips them).
    ``output_held=False``: the model's output is dropped before backward, as loops that keep only the loss do.
    ``warm_up=False``: no warm-up step before the tracked one (fake tensors have no allocator to warm and no kernels
    to load lazily; a step's own lazy state, made at capture, is there already).

    With ``time_repeated_blocks_once``, the units of repeated blocks (found from the tracked step: same ops, FLOPs and
    bytes) are timed at one instance per family and every other instance reuses those times, so the timed steps
    carry markers (and, on CUDA, synchronisations) at one block per family instead of at every layer.
    """
    params = [p for p in graph.model.parameters()]
    num_units = len(graph.units)
    try:
        if warm_up:
            _clear_grads(params)
            loss_fn(graph.executable(*args, **kwargs)).backward()  # warm-up: allocator, lazy initialisation
            _clear_grads(params)
        start_autocast_step()  # autocast's casts are made in the tracked step, as in the optimized module's steps
        tracked = _tracked_step(
            graph, args, kwargs, loss_fn, record_gradients=gradient_lifetimes, output_held=output_held
        )
        untimed = _assemble(graph, args, kwargs, tracked, tracked.unit_flops, gradient_lifetimes=gradient_lifetimes)
        if not timed:
            return dataclasses.replace(untimed, times_measured=False)  # zeros, not times: a timing gives them
        timed_at = timing_units(graph, untimed) if time_repeated_blocks_once else list(range(num_units))
        unit_ms_runs, step_ms_runs = timed_steps(
            graph, args, kwargs, loss_fn, timed_units=set(timed_at), repeats=timing_repeats
        )
    except LossFunctionError:
        raise  # the user's loss function, not the graph: its message says what to change
    except Exception as error:
        raise ProfileError(
            f"running the captured {graph.kind.value} graph forward and backward failed: "
            f"{type(error).__name__}: {error}"
        ) from error
    finally:
        _clear_grads(params)
    unit_ms = [statistics.median(run[timed_at[i]] for run in unit_ms_runs) for i in range(num_units)]
    return _with_times(untimed, unit_ms, statistics.median(step_ms_runs), timed_at)


def timing_units(graph: Graph, untimed: StepTrace) -> list[int]:
    """Per unit, the unit whose measured forward time it takes: itself, or the same unit of its family's middle
    instance when it belongs to a repeated block (the middle one, away from cold caches at the first layer)."""
    timed_at = list(range(len(untimed.units)))
    for family in find_repeated_blocks(graph, untimed).families:
        timed_instance = family.instances[len(family.instances) // 2]
        for instance in family.instances:
            for offset in range(family.block_units):
                timed_at[instance.first_unit + offset] = timed_instance.first_unit + offset
    return timed_at


# --------------------------------------------------------------------------------------------------- unit callbacks

_active_unit_callback: Callable[[int], None] | None = None
_active_inputs_callback: Callable[[int, tuple[Any, ...]], None] | None = None


def unit_marker(index: int, *inputs: Any) -> None:
    """Inserted before each unit of a GraphModule while profiling; reports the unit (and, when asked for, the values
    of its input nodes) to the active callbacks."""
    if _active_unit_callback is not None:
        _active_unit_callback(index)
    if inputs and _active_inputs_callback is not None:
        _active_inputs_callback(index, inputs)


@contextlib.contextmanager
def unit_callbacks(
    graph: Graph,
    callback: Callable[[int], None],
    units: Collection[int] | None = None,
    *,
    on_inputs: Callable[[int, tuple[Any, ...]], None] | None = None,
) -> Iterator[None]:
    """Call ``callback(i)`` whenever unit ``i`` starts while the graph's executable runs (only the ``units`` given,
    when given), and ``on_inputs(i, values)`` with the values of its input nodes (fx and export graphs only: a
    module-level unit's reads are all ops, which the tracker sees)."""
    global _active_unit_callback, _active_inputs_callback
    selected = set(units) if units is not None else None
    if graph.kind is CaptureKind.MODULE:
        on_start = callback if selected is None else lambda index: callback(index) if index in selected else None
        with ModuleUnitRecorder(graph.model, on_start).recording():
            yield
        return
    gm = graph.executable
    assert isinstance(gm, fx.GraphModule)
    markers = []
    for index, node in enumerate(compute_nodes(gm)):
        if selected is not None and index not in selected:
            continue
        inputs = tuple(node.all_input_nodes) if on_inputs is not None else ()
        with gm.graph.inserting_before(node):
            markers.append(gm.graph.call_function(unit_marker, (index, *inputs)))
    gm.recompile()
    _active_unit_callback, _active_inputs_callback = callback, on_inputs
    try:
        yield
    finally:
        _active_unit_callback = _active_inputs_callback = None
        for marker in markers:
            gm.graph.erase_node(marker)
        gm.recompile()


# --------------------------------------------------------------------------------------------- the tracked step


@dataclass(slots=True)
class _TrackedStep:
    tracker: StorageTracker
    saved_by_unit: dict[int, set[int]]  # unit -> indices of storages it saved
    packs_by_unit: dict[int, int]  # unit -> tensors autograd packed while it ran (parameters and repeats included)
    gradient_allocations: list[tuple[int, int]]  # (event, bytes) of each parameter gradient's storage
    gradient_event_of_leaf: dict[int, int]  # id of a leaf (parameter, input) -> the event its gradient was made in
    unit_flops: list[int]  # per unit: the FLOPs of its forward


def _tracked_step(
    graph: Graph, args: tuple, kwargs: dict, loss_fn: LossFn, *, record_gradients: bool, output_held: bool = True
) -> _TrackedStep:
    device = device_of(graph.model, args, kwargs)
    static = step_tensors(graph.model, args, kwargs)
    tracker = StorageTracker(device, static)
    saved_by_unit: dict[int, set[int]] = {}
    packs_by_unit: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> tuple[torch.Tensor, StorageRecord | None, int]:
        record = tracker.record_of(tensor)
        unit = tracker.unit
        packs_by_unit[unit] = packs_by_unit.get(unit, 0) + 1
        current = tracker.events[-1]
        if current.phase is Phase.FORWARD:  # a recomputation that stops at this pack reached this peak
            current.pack_peak_bytes = current.peak_bytes
        if record is not None and record.phase is Phase.FORWARD:
            saved_by_unit.setdefault(unit, set()).add(record.index)
        # detach: same storage, no reference cycle through the output's grad_fn
        return tensor.detach(), record, unit

    def unpack(packed: tuple[torch.Tensor, StorageRecord | None, int]) -> torch.Tensor:
        tensor, record, unit = packed
        if tracker.phase is not Phase.BACKWARD or tracker.unit != unit:
            tracker.begin_event(Phase.BACKWARD, unit)
        if record is not None and record.phase is Phase.FORWARD:
            record.release_event_by_saver[unit] = len(tracker.events) - 1
        return tensor

    def on_unit(index: int) -> None:
        tracker.begin_event(Phase.FORWARD, index)
        flops.mark(index)

    def on_inputs(index: int, inputs: tuple[Any, ...]) -> None:
        # a unit reads its inputs even when no op does: a dropout with p=0 returns its input as it is (decomposed
        # above the tracker, which sees no op), yet a region holding that unit holds the input for its backward
        event = len(tracker.events) - 1
        for leaf in pytree.tree_leaves(inputs):
            record = tracker.record_of(leaf) if isinstance(leaf, torch.Tensor) else None
            if record is not None:
                record.users.add(index)
                record.last_use_event = event

    flops = ForwardFlops()
    with flops, tracker, GradientRecorder(tracker) if record_gradients else contextlib.nullcontext():
        with unit_callbacks(graph, on_unit, on_inputs=on_inputs), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            output = graph.executable(*args, **kwargs)
            flops.stop()
            tracker.begin_event(Phase.FORWARD, OUTSIDE_GRAPH_UNIT)  # the loss function
            loss = loss_fn(output)
            if not output_held:
                del output  # what of it backward does not keep is freed before backward starts
        tracker.begin_event(Phase.BACKWARD, OUTSIDE_GRAPH_UNIT)
        loss.backward()
        del loss
        tracker.begin_event(Phase.BACKWARD, OUTSIDE_GRAPH_UNIT)  # end marker: what is freed after the step
    output = None
    gradient_records = {tracker.record_of(p.grad) for p in graph.model.parameters() if p.grad is not None}
    gradient_allocations = [(r.alloc_event, r.nbytes) for r in gradient_records if r is not None]
    leaves = [*graph.model.parameters(), *(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))]
    gradient_event_of_leaf = {
        id(leaf): record.alloc_event
        for leaf in leaves
        if leaf.grad is not None and (record := tracker.record_of(leaf.grad)) is not None
    }
    return _TrackedStep(
        tracker, saved_by_unit, packs_by_unit, gradient_allocations, gradient_event_of_leaf,
        flops.per_unit(len(graph.units)),
    )


def _last_free_event(records: list[StorageRecord], num_events: int) -> int | None:
    """The event after which none of ``records`` is alive (None: there are none)."""
    if not records:
        return None
    return max(r.free_event if r.free_event is not None else num_events - 1 for r in records)


def _gradient_versions(record: StorageRecord, num_events: int) -> tuple[GradientVersion, ...]:
    """Per unit that wrote a version of ``record``'s storage: when the last gradient computed for that version was
    gone, and the highest live bytes of that event after it went."""
    versions = []
    for writer, gradients in sorted(record.gradients_by_writer.items()):
        last = max(gradients, key=lambda g: g.free_event if g.free_event is not None else num_events)
        versions.append(GradientVersion(
            writer_unit=writer, free_event=last.free_event if last.free_event is not None else num_events - 1,
            late_peak_bytes=last.late_peak_bytes if last.free_event is not None else None,
        ))
    return tuple(versions)


# ------------------------------------------------------------------------------------------------ timing, flops


def timed_steps(
    graph: Graph, args: tuple, kwargs: dict, loss_fn: LossFn, *, timed_units: Collection[int], repeats: int
) -> tuple[list[list[float]], list[float]]:
    """``repeats`` steps with a clock at ``timed_units``: per step, their forward milliseconds (0 for the others) and
    the step's milliseconds."""
    num_units = len(graph.units)
    timed = set(timed_units)
    # a unit's time runs to the next marker, so a timed unit followed by an untimed one needs a marker after it
    stops = {u + 1 for u in timed if u + 1 < num_units and u + 1 not in timed}
    params = list(graph.model.parameters())
    sync = synchronizer(device_of(graph.model, args, kwargs))
    stamps: list[tuple[int, float]] = []

    def on_unit(index: int) -> None:
        sync()
        stamps.append((index, time.perf_counter()))

    unit_ms_runs: list[list[float]] = []
    step_ms_runs: list[float] = []
    # the markers go in (and come out) once, outside the timed windows: inserting them recompiles the GraphModule,
    # which takes longer than the forward itself on graphs of a few hundred units
    with unit_callbacks(graph, on_unit, timed | stops):
        for _ in range(repeats):
            _clear_grads(params)
            start_autocast_step()  # autocast's casts are made in every step, as in the optimized module's
            stamps.clear()
            sync()
            start = time.perf_counter()
            output = graph.executable(*args, **kwargs)
            sync()
            forward_end = time.perf_counter()
            loss_fn(output).backward()
            sync()
            step_ms_runs.append((time.perf_counter() - start) * 1e3)
            del output
            unit_ms = [0.0] * num_units
            ends = [t for _, t in stamps[1:]] + [forward_end]
            for (index, began), ended in zip(stamps, ends):
                if index in timed:
                    unit_ms[index] += (ended - began) * 1e3
            unit_ms_runs.append(unit_ms)
    return unit_ms_runs, step_ms_runs


# ---------------------------------------------------------------------------------------------------- assembly


def _assemble(
    graph: Graph,
    args: tuple,
    kwargs: dict,
    tracked: _TrackedStep,
    flops: list[int],
    *,
    gradient_lifetimes: bool,
) -> StepTrace:
    """The trace of the tracked step, with no times yet (``_with_times`` adds them)."""
    tracker = tracked.tracker
    events = tuple(
        MemoryEvent(
            index=i, phase=e.phase, unit=e.unit, start_bytes=e.start_bytes, peak_bytes=e.peak_bytes,
            pack_peak_bytes=e.pack_peak_bytes,
        )
        for i, e in enumerate(tracker.events)
    )
    storages, output_bytes, cached_casts = _storage_lives(graph, tracked, len(events), gradient_lifetimes)
    record_bytes = {r.index: r.nbytes for r in tracker.records if r.index not in cached_casts}
    units = tuple(
        UnitCost(
            index=u.index,
            forward_ms=0.0,
            flops=flops[u.index],
            output_bytes=output_bytes[u.index],
            saved_bytes=sum(record_bytes.get(i, 0) for i in tracked.saved_by_unit.get(u.index, ())),
            saved_tensors=tracked.packs_by_unit.get(u.index, 0),
        )
        for u in graph.units
    )
    params = list(graph.model.parameters())
    gradient_added = [0] * (len(events) + 1)
    for event, nbytes in tracked.gradient_allocations:
        gradient_added[event] += nbytes
    return StepTrace(
        units=units,
        storages=storages,
        events=events,
        parameter_bytes=unique_storage_bytes(params),
        buffer_bytes=unique_storage_bytes(list(graph.model.buffers())),
        input_bytes=unique_storage_bytes([t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]),
        gradient_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        baseline_peak_bytes=max(e.peak_bytes for e in events),
        forward_ms=0.0,
        step_ms=0.0,
        gradient_bytes_by_event=tuple(itertools.accumulate(gradient_added[: len(events)])),
        gradient_lifetimes=gradient_lifetimes,
    )


def _storage_lives(
    graph: Graph, tracked: _TrackedStep, num_events: int, gradient_lifetimes: bool
) -> tuple[tuple[StorageLife, ...], list[int], set[int]]:
    """Every storage made in forward as a ``StorageLife``, the bytes each unit outputs, and the records that are
    autocast's cached casts."""
    storages: list[StorageLife] = []
    output_bytes = [0] * len(graph.units)
    cached_casts: set[int] = set()
    for record in tracked.tracker.records:
        if record.phase is not Phase.FORWARD:
            continue
        free_event = record.free_event if record.free_event != num_events - 1 else None
        if record.autocast_cast is not None and free_event is None:
            # held by autocast's cache to the context's end: like a parameter, no unit's output or saved tensor,
            # so no plan frees or remakes it; the unit that made it keeps it in its forward event's bytes. Its
            # gradient went when the leaf's gradient was made from it (autockpt's own checkpoint delays that)
            cached_casts.add(record.index)
            leaf = record.autocast_cast()
            storages.append(
                StorageLife(
                    index=len(storages), nbytes=record.nbytes, producer_unit=OUTSIDE_GRAPH_UNIT,
                    alloc_event=record.alloc_event, last_forward_use_event=record.alloc_event, free_event=None,
                    user_units=(), saver_units=(), saver_release_events=(),
                    gradient_free_event=(
                        tracked.gradient_event_of_leaf.get(id(leaf)) if gradient_lifetimes and leaf is not None else None
                    ),
                )
            )
            continue
        if record.producer_unit >= 0:
            output_bytes[record.producer_unit] += record.nbytes
        savers = tuple(sorted(record.release_event_by_saver))
        storages.append(
            StorageLife(
                index=len(storages),
                nbytes=record.nbytes,
                producer_unit=record.producer_unit,
                alloc_event=record.alloc_event,
                last_forward_use_event=record.last_use_event,
                free_event=free_event,
                user_units=tuple(sorted(u for u in record.users if u >= 0)),
                saver_units=savers,
                saver_release_events=tuple(record.release_event_by_saver[u] for u in savers),
                mutator_units=tuple(sorted(u for u in record.mutators if u >= 0)),
                gradient_free_event=_last_free_event(
                    [g for gradients in record.gradients_by_writer.values() for g in gradients], num_events
                ),
                gradient_versions=_gradient_versions(record, num_events),
            )
        )
    return tuple(storages), output_bytes, cached_casts


def _with_times(untimed: StepTrace, unit_ms: list[float], step_ms: float, timed_at: list[int]) -> StepTrace:
    units = tuple(
        dataclasses.replace(
            u, forward_ms=unit_ms[u.index], forward_ms_timed_at=None if timed_at[u.index] == u.index else timed_at[u.index]
        )
        for u in untimed.units
    )
    return dataclasses.replace(untimed, units=units, forward_ms=sum(unit_ms), step_ms=step_ms)


def unique_storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights and views counted once)."""
    # keyed by the storage itself, not its data pointer: meta and fake storages have none
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def step_tensors(model: nn.Module, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors that exist before a step starts: parameters, buffers, existing gradients, inputs."""
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return tensors


def device_of(model: nn.Module, args: tuple, kwargs: dict) -> torch.device:
    """The device the step runs on: the first parameter's, else the first input tensor's."""
    for tensor in list(model.parameters()) + [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]:
        return tensor.device
    return torch.device("cpu")


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _clear_grads(params: list[torch.Tensor]) -> None:
    for param in params:
        param.grad = None
