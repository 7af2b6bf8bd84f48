"""Simulate: (StepTrace, CostModel, regions with actions) -> Timeline. Scores any plan, the baselines' too; knows
nothing about how the plan was found.

The prediction starts from the *measured* timeline of the unmodified step and applies what each region's action
changes, storage by storage (the rule of each action below; ``recompute.py`` runs them):

* a storage produced inside a region and saved only by units of that region is freed after its last forward use;
  when backward first reaches the region, the region is re-run and a fresh copy lives until the saver that used it
  last has run its backward. ``torch.utils.checkpoint(use_reentrant=False)`` stops re-running at the pack of the
  region's last saved tensor (early stop, ``Action.RECOMPUTE_TORCH``); autockpt's own checkpoint
  (``Action.RECOMPUTE_OWN``) re-runs the whole region;
* a storage that a region reads from outside is held by the checkpoint until the region's backward is done;
* ``Action.RECOMPUTE_OWN`` also holds the gradients of the region's outputs until the region's backward is done;
* storages saved by units outside every region live as measured.

Everything the plan does not touch (parameter gradients, backward temporaries) stays as measured, which is what makes
the prediction close to a real measurement. Time: the recomputed kernels as measured, plus each region's machinery at
its action's price (``CostModel``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from autockpt.types import (
    Action,
    CostModel,
    MemoryCurve,
    MemoryEvent,
    Phase,
    Region,
    RegionAction,
    StepTrace,
    StorageLife,
    Timeline,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class RegionWindow:
    """Where a region's recomputation happens on the measured timeline, and how far it runs."""

    first_backward_event: int | None  # the unpack that triggers recomputation; None: nothing saved inside
    last_backward_event: int | None  # the checkpoint frame (and the region's inputs) is released here
    last_saver_unit: int | None  # the last unit that saves anything (parameters included) for backward
    last_recomputed_unit: int | None  # the last unit whose kernels run again; None: nothing is re-run


def region_windows(trace: StepTrace, region_actions: Sequence[RegionAction]) -> list[RegionWindow]:
    """Where each region is recomputed (the first backward event that unpacks what one of its units saved), and how
    far the recomputation runs.

    Under torch's non-reentrant checkpoint it stops as soon as the region's last saved tensor is packed again (early
    stop). Autograd packs an op's saved *inputs* before running its kernel, so when the last saver saves only tensors
    made before it (a matmul saving its operands) its kernel is skipped; when it saves its own output it runs.
    autockpt's own checkpoint runs the whole region: backward starts from the outputs' gradient functions.
    """
    index = _storage_index(trace)
    windows = []
    for region_action in region_actions:
        region, early_stop = region_action.region, _stops_early(region_action.action)
        # units that saved anything (their saved tensors are unpacked in backward) -> first and last such event
        spans = {
            u: index.backward_span_of_unit[u]
            for u in range(region.first_unit, region.last_unit + 1)
            if index.backward_span_of_unit[u] is not None
        }
        last_saver = max(spans, default=None)
        recomputed = None
        if last_saver is not None and not early_stop:
            recomputed = region.last_unit
        elif last_saver is not None:
            recomputed = last_saver if last_saver in index.saves_own_output else last_saver - 1
            recomputed = recomputed if recomputed >= region.first_unit else None
        windows.append(
            RegionWindow(
                first_backward_event=min((first for first, _ in spans.values()), default=None),
                last_backward_event=max((last for _, last in spans.values()), default=None),
                last_saver_unit=last_saver,
                last_recomputed_unit=recomputed,
            )
        )
    return windows


def _stops_early(action: Action) -> bool:
    """Whether the region's recomputation stops at its last saved tensor (torch's non-reentrant checkpoint)."""
    return action is Action.RECOMPUTE_TORCH


def unit_regions(num_units: int, regions: Sequence[Region]) -> list[int | None]:
    """Region index of every unit (None when not checkpointed); raises on overlapping regions."""
    region_of: list[int | None] = [None] * num_units
    for r, region in enumerate(regions):
        if region.last_unit >= num_units:
            raise ValueError(f"region {region} reaches past the last unit ({num_units - 1})")
        for unit in range(region.first_unit, region.last_unit + 1):
            if region_of[unit] is not None:
                raise ValueError(f"regions overlap at unit {unit}: {regions[region_of[unit]]} and {region}")
            region_of[unit] = r
    return region_of


def machinery_ms(trace: StepTrace, costs: CostModel, region_actions: Sequence[RegionAction]) -> float:
    """What the regions' actions add to a step besides the recomputed kernels: per region, its action's fixed price
    plus its price per tensor the region's units save (calibrated on the device, ``costs.py``)."""
    total = 0.0
    for region_action in region_actions:
        region, price = region_action.region, costs.price(region_action.action)
        saved_tensors = sum(trace.units[u].saved_tensors for u in range(region.first_unit, region.last_unit + 1))
        total += price.region_ms + saved_tensors * price.saved_tensor_ms
    return total


def simulate(trace: StepTrace, costs: CostModel, region_actions: Sequence[RegionAction]) -> Timeline:
    """Predict the memory and added time of one training step when each region runs under its action."""
    return _predict(trace, costs, region_actions, detailed=False).timeline


def memory_curve(trace: StepTrace, costs: CostModel, region_actions: Sequence[RegionAction]) -> MemoryCurve:
    """The predicted step of ``simulate`` per event, stacked by category (for reports); sums to its event bytes.

    Categories are assigned in a fixed order, each capped by what is left of the event's predicted bytes:
    parameters/buffers/inputs, gradients, recomputed copies, forward tensors, then the rest as temporaries.
    """
    prediction = _predict(trace, costs, region_actions, detailed=True)
    static = trace.parameter_bytes + trace.buffer_bytes + trace.input_bytes
    gradients = trace.gradient_bytes_by_event or (0,) * len(trace.events)
    columns: list[list[int]] = [[], [], [], [], []]
    for event, total in enumerate(prediction.timeline.event_bytes):
        left = total
        parts = (static, gradients[event], prediction.copy_bytes[event], prediction.forward_bytes[event])
        for column, value in zip(columns, parts):
            taken = max(0, min(value, left))
            column.append(taken)
            left -= taken
        columns[4].append(left)
    return MemoryCurve(
        phases=tuple(e.phase for e in trace.events),
        parameter_bytes=tuple(columns[0]),
        gradient_bytes=tuple(columns[1]),
        recomputed_bytes=tuple(columns[2]),
        activation_bytes=tuple(columns[3]),
        temporary_bytes=tuple(columns[4]),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class _Prediction:
    timeline: Timeline
    forward_bytes: list[int]  # per event: bytes of forward-made storages alive under the plan
    copy_bytes: list[int]  # per event: recomputed copies alive, plus the replay burst where it sets the peak


def _predict(
    trace: StepTrace, costs: CostModel, region_actions: Sequence[RegionAction], *, detailed: bool
) -> _Prediction:
    """``detailed``: also split the bytes into forward storages and recomputed copies (for memory curves)."""
    num_events = len(trace.events)
    regions = [ra.region for ra in region_actions]
    actions = [ra.action for ra in region_actions]
    if Action.RECOMPUTE_OWN in actions and not trace.gradient_lifetimes:
        raise ValueError(
            f"this trace cannot score {Action.RECOMPUTE_OWN.value!r}: it has no gradient lifetimes (the action holds "
            "output gradients); trace the step with gradient_lifetimes=True"
        )
    region_of = unit_regions(len(trace.units), regions)
    windows = region_windows(trace, region_actions)
    index = _storage_index(trace)
    copy_bytes_at_burst = [0] * len(regions)
    plan_delta = [0] * (num_events + 1)  # what the plan changes, on top of the measured timeline (difference array)
    forward_delta = [0] * (num_events + 1)  # detailed: the plan's changes to the original forward storages
    copy_delta = [0] * (num_events + 1)  # detailed: recomputed copies

    def add(delta: list[int], first: int, last: int, nbytes: int) -> None:
        if first <= last:
            delta[first] += nbytes
            delta[last + 1] -= nbytes

    # only storages that a region's unit makes, reads or saves can change
    touched = sorted({s for region in regions for u in range(region.first_unit, region.last_unit + 1)
                      for s in index.storages_of_unit[u]})
    for position in touched:
        storage = trace.storages[position]
        base_free = storage.free_event if storage.free_event is not None else num_events - 1
        plan_free = _plan_free_event(storage, region_of, windows, base_free)
        if plan_free != base_free:
            first, last, nbytes = (plan_free + 1, base_free, -storage.nbytes) if plan_free < base_free else (
                base_free + 1, plan_free, storage.nbytes)
            add(plan_delta, first, last, nbytes)
            if detailed:
                add(forward_delta, first, last, nbytes)
        home = _region(region_of, storage.producer_unit)
        if home is None:
            continue
        releases = [
            e for u, e in zip(storage.saver_units, storage.saver_release_events) if _region(region_of, u) == home
        ]
        window = windows[home]
        gradient_free = storage.gradient_free_event
        if (
            actions[home] is Action.RECOMPUTE_OWN  # it holds the gradients of the region's outputs
            and window.first_backward_event is not None
            and gradient_free is not None
            and _is_region_output(storage, region_of, home)
        ):
            # the checkpoint holds the gradients of the region's outputs until the region's backward is done (in
            # the measured step they were gone after ``gradient_free_event``)
            add(plan_delta, max(gradient_free + 1, window.first_backward_event), window.last_backward_event,
                storage.nbytes)
        if releases and window.first_backward_event is not None:
            add(plan_delta, window.first_backward_event, max(releases), storage.nbytes)
            if detailed:
                add(copy_delta, window.first_backward_event, max(releases), storage.nbytes)
            copy_bytes_at_burst[home] += storage.nbytes

    event_bytes, forward_bytes, copy_bytes = [], [], []
    running = forward_running = copy_running = 0
    for event in trace.events:
        running += plan_delta[event.index]
        event_bytes.append(event.peak_bytes + running)
        if detailed:
            forward_running += forward_delta[event.index]
            copy_running += copy_delta[event.index]
            forward_bytes.append(index.forward_bytes[event.index] + forward_running)
            copy_bytes.append(copy_running)

    burst_bytes = []
    recompute_ms = 0.0
    rerun_units: list[int] = []
    for r, (region, window) in enumerate(zip(regions, windows)):
        if window.first_backward_event is None:
            burst_bytes.append(0)
            continue
        c = window.first_backward_event
        offset = sum(plan_delta[: c + 1])
        before_recompute = trace.events[c].start_bytes + offset - copy_bytes_at_burst[r]
        replay = _replay_peak(trace, region, window, region_of, r, early_stop=_stops_early(actions[r]))
        if window.last_recomputed_unit is not None:
            rerun = range(region.first_unit, window.last_recomputed_unit + 1)
            recompute_ms += sum(trace.units[u].forward_ms for u in rerun)
            rerun_units += rerun
        burst = before_recompute + replay
        burst_bytes.append(burst)
        if burst > event_bytes[c]:
            if detailed:
                copy_bytes[c] += burst - event_bytes[c]
            event_bytes[c] = burst

    peak_event = max(range(num_events), key=event_bytes.__getitem__)
    machinery = machinery_ms(trace, costs, region_actions)
    timeline = Timeline(
        event_bytes=tuple(event_bytes),
        burst_bytes=tuple(burst_bytes),
        peak_bytes=event_bytes[peak_event],
        peak_event=peak_event,
        recompute_ms=recompute_ms,
        rerun_units=tuple(rerun_units),
        overhead_ms=recompute_ms + machinery,
        machinery_ms=machinery,
    )
    return _Prediction(timeline=timeline, forward_bytes=forward_bytes, copy_bytes=copy_bytes)


@dataclass(frozen=True, slots=True)
class _StorageIndex:
    storages_of_unit: tuple[tuple[int, ...], ...]  # per unit: storages it makes, reads or saves
    forward_bytes: tuple[int, ...]  # per event: bytes of forward-made storages alive in the measured step
    made_by_unit: tuple[tuple[StorageLife, ...], ...]  # per unit: the storages it made
    backward_span_of_unit: tuple[tuple[int, int] | None, ...]  # per unit: first and last backward event unpacking
    saves_own_output: frozenset[int]  # units that saved a storage they made
    forward_event_of_unit: dict[int, MemoryEvent]  # unit -> its forward event


# Scoring candidates simulates hundreds of plans on one trace: index it once. StepTraces are kept alive here, so an
# id is never reused while its entry exists; a few entries are enough (one planner at a time, tests).
_INDEX_CACHE: dict[int, tuple[StepTrace, _StorageIndex]] = {}
_INDEX_CACHE_SIZE = 4


def _storage_index(trace: StepTrace) -> _StorageIndex:
    cached = _INDEX_CACHE.get(id(trace))
    if cached is not None and cached[0] is trace:
        return cached[1]
    num_events = len(trace.events)
    related: list[set[int]] = [set() for _ in trace.units]
    alive = [0] * (num_events + 1)
    for position, storage in enumerate(trace.storages):
        for unit in {storage.producer_unit, *storage.user_units, *storage.saver_units}:
            if unit >= 0:
                related[unit].add(position)
        free = storage.free_event if storage.free_event is not None else num_events - 1
        alive[storage.alloc_event] += storage.nbytes
        alive[free + 1] -= storage.nbytes
    made: list[list[StorageLife]] = [[] for _ in trace.units]
    for storage in trace.storages:
        if storage.producer_unit >= 0:
            made[storage.producer_unit].append(storage)
    spans: list[tuple[int, int] | None] = [None] * len(trace.units)
    for event in trace.events:  # a backward event belongs to the unit whose saved tensors it unpacked
        if event.phase is Phase.BACKWARD and event.unit >= 0:
            span = spans[event.unit]
            spans[event.unit] = (event.index, event.index) if span is None else (span[0], event.index)
    index = _StorageIndex(
        backward_span_of_unit=tuple(spans),
        saves_own_output=frozenset(u for s in trace.storages for u in s.saver_units if u == s.producer_unit),
        storages_of_unit=tuple(tuple(sorted(s)) for s in related),
        forward_bytes=tuple(itertools.accumulate(alive[:num_events])),
        made_by_unit=tuple(map(tuple, made)),
        forward_event_of_unit={e.unit: e for e in trace.events if e.phase is Phase.FORWARD and e.unit >= 0},
    )
    if len(_INDEX_CACHE) >= _INDEX_CACHE_SIZE:
        _INDEX_CACHE.pop(next(iter(_INDEX_CACHE)))
    _INDEX_CACHE[id(trace)] = (trace, index)
    return index


def _region(region_of: list[int | None], unit: int) -> int | None:
    """Region of a unit; work outside the graph (unit -1: the loss, autograd's start) is in none."""
    return region_of[unit] if unit >= 0 else None


def _plan_free_event(
    storage: StorageLife, region_of: list[int | None], windows: list[RegionWindow], base_free: int
) -> int:
    """Event after which the original storage is gone under the plan.

    Only two things change a storage's life: checkpointing the region that made and saved it (autograd no longer
    holds it for those savers), and a region that reads it (the checkpoint holds it until the region's backward is
    done). Anything else, Python references included, stays as measured.
    """
    if storage.free_event is None:
        return base_free
    home = _region(region_of, storage.producer_unit)
    held_by_regions = [
        windows[r].last_backward_event
        for r in {_region(region_of, user) for user in storage.user_units}
        if r is not None and r != home and windows[r].last_backward_event is not None
    ]
    saved_in_home = home is not None and any(_region(region_of, s) == home for s in storage.saver_units)
    if not saved_in_home:
        return max([base_free, *held_by_regions])
    holds = [storage.last_forward_use_event, *held_by_regions]
    holds += [
        release
        for saver, release in zip(storage.saver_units, storage.saver_release_events)
        if _region(region_of, saver) is None  # autograd keeps it for a unit that is not checkpointed
    ]
    return max(holds)


def _replay_peak(
    trace: StepTrace, region: Region, window: RegionWindow, region_of: list[int | None], r: int, *, early_stop: bool
) -> int:
    """Peak bytes the recomputation of ``region`` adds on top of memory at its start.

    While unit ``u`` re-runs, memory rises by what it rose during ``u``'s measured forward (its outputs plus the
    temporaries it frees before returning). After it, only the outputs the recomputation still needs stay: tensors a
    unit of the region saved (kept for backward), tensors a later unit of the region reads (until that unit ran), and
    the region's own outputs (tensors a unit outside the region reads): the region runs as one function that holds
    its return values until the recomputation stops, even though backward has no use for them. Temporaries are
    already gone. Under early stop the recomputation ends at the last saver's last pack, so that unit rises only as
    far as it had risen by then in the measured forward (a dropout stops once its mask exists, before the masked
    output).
    """
    storages = _storage_index(trace)
    last = window.last_saver_unit if early_stop else region.last_unit
    live = 0
    peak = 0
    readers_left: dict[int, int] = {}  # storage index -> last unit of the region that reads it
    transient_bytes: dict[int, int] = {}
    for unit in range(region.first_unit, last + 1):
        event = storages.forward_event_of_unit.get(unit)
        if early_stop and unit == last and event is not None and event.pack_peak_bytes is not None:
            return max(peak, live + event.pack_peak_bytes - event.start_bytes)
        rise = event.peak_bytes - event.start_bytes if event is not None else 0
        peak = max(peak, live + rise)
        for storage in storages.made_by_unit[unit]:
            if storage.free_event is not None and storage.free_event <= storage.alloc_event:
                continue  # a temporary of the unit itself: inside ``rise``
            saved_in_region = any(_region(region_of, s) == r for s in storage.saver_units)
            if saved_in_region or any(_region(region_of, u) != r for u in storage.user_units):
                live += storage.nbytes
                continue
            later_readers = [u for u in storage.user_units if _region(region_of, u) == r and u > unit]
            if later_readers:
                live += storage.nbytes
                readers_left[storage.index] = max(later_readers)
                transient_bytes[storage.index] = storage.nbytes
        peak = max(peak, live)
        for index in [i for i, last_reader in readers_left.items() if last_reader <= unit]:
            live -= transient_bytes.pop(index)
            del readers_left[index]
    return peak


def _is_region_output(storage: StorageLife, region_of: list[int | None], r: int) -> bool:
    """Made in region ``r`` and read after it: by a unit outside it, by the loss, or as part of the model output."""
    return storage.free_event is None or any(_region(region_of, u) != r for u in storage.user_units)
