"""Simulate: (StepTrace, CostModel, regions with actions) -> Timeline. Scores any plan, the baselines' too; knows
nothing about how the plan was found.

The prediction starts from the *measured* timeline of the unmodified step and applies what each region's action
changes, storage by storage (the rule of each action below; ``recompute.py`` runs them):

* a storage produced inside a region and saved only by units of that region is freed after its last forward use;
  when backward first reaches the region, the region is re-run and a fresh copy lives until the saver that used it
  last has run its backward. ``torch.utils.checkpoint(use_reentrant=False)`` stops re-running at the pack of the
  region's last saved tensor (early stop, ``Action.RECOMPUTE_TORCH``); autockpt's own checkpoint
  (``Action.RECOMPUTE_OWN``) re-runs the whole region. The copy is counted through its saver's whole backward
  event, as the measured step held the saved tensor until its node was released; torch's checkpoint lets go of a
  copy right after the backward op that reads it, so what the node makes after that op (a Linear's bias gradient)
  is predicted with the copy alive: over by those bytes where that sets the peak, never under;
* a storage that a region reads from outside is held by the checkpoint until the region's backward is done;
* ``Action.RECOMPUTE_OWN`` also holds the gradients of the region's outputs until the region's backward is done
  (from the event each went in, the rest of which it then raises: ``StorageLife.gradient_versions``, per version of
  the storage, as an in-place op's output has a gradient of its own; ``exit_gradient``); under autocast it also
  makes the gradients of the parameters whose cached casts the region read only when its backward is done
  (``late_leaf_gradients``);
* storages saved by units outside every region live as measured;
* storages no unit owns live as measured, whatever the plan: under autocast, the low-precision copies of parameters
  that autocast's cache holds to the end of the step (``trace.py``), which a recomputation takes from the cache
  instead of making them again.

Everything the plan does not touch (parameter gradients, backward temporaries) stays as measured, which is what makes
the prediction close to a real measurement. Time: the recomputed kernels as measured, plus each region's machinery at
its action's price (``CostModel``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autockpt.core.offload_model import MovedStorage, OffloadTransfers, offload_transfers, slot_bytes
from autockpt.core.region_rules import (
    RegionWindow,
    exit_gradient,
    is_region_output,
    late_leaf_gradients,
    region_at,
    region_windows,
    stops_early,
    unit_regions,
)
from autockpt.core.storage_replay import (
    REGION_FACTS_SIZE,
    RegionFacts,
    StorageArrays,
    replay_peak_alone,
    storage_arrays,
    storage_deltas,
    storage_index,
)
from autockpt.types import (
    Action,
    CostModel,
    MemoryCurve,
    Region,
    RegionAction,
    StepTrace,
    StorageLife,
    Timeline,
)


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
    """Predict the memory and added time of one training step when each region runs under its action.

    The solvers simulate thousands of plans per planner, so this is the vectorised twin of ``_predict``: the same
    rules, applied to every storage at once with numpy, and what depends on one region and its action alone (its
    window, replay peak, re-run units) cached per trace (``storage_replay.py``). ``_predict`` stays the reference
    (and makes the memory curves); tests/core/test_simulate.py checks that both give the same timeline, field by field.
    """
    if any(ra.action is Action.OFFLOAD for ra in region_actions):
        return _predict(trace, costs, region_actions, detailed=False).timeline  # the fast twin has no offload rules
    return _predict_fast(trace, costs, region_actions)


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
        host_pool_bytes=tuple(prediction.pool_bytes) if prediction.timeline.host_pool_bytes else (),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class _Prediction:
    timeline: Timeline
    forward_bytes: list[int]  # per event: bytes of forward-made storages alive under the plan
    copy_bytes: list[int]  # per event: recomputed copies alive, plus the replay burst where it sets the peak
    pool_bytes: list[int]  # per event: host pool slots taken so far this step (offload; not device memory)


@dataclass(slots=True)
class _PlanChanges:
    """What a plan changes on the measured timeline, as difference arrays over the events (``_add``)."""

    plan: list[int]  # every byte the plan adds or removes
    forward: list[int]  # detailed: of which the original forward storages
    copies: list[int]  # detailed: of which recomputed copies
    pool: list[int]  # detailed: host pool slots (kept until the step ends)
    copy_bytes_at_burst: list[int]  # per region: the copies alive when its recomputation starts
    late_raises: dict[int, list[int]]  # event -> [its peak after held gradients went, their bytes]

    @classmethod
    def empty(cls, num_events: int, num_regions: int) -> _PlanChanges:
        return cls(*([0] * (num_events + 1) for _ in range(4)), [0] * num_regions, {})


def _add(delta: list[int], first: int, last: int, nbytes: int) -> None:
    if first <= last:
        delta[first] += nbytes
        delta[last + 1] -= nbytes


def _predict(
    trace: StepTrace, costs: CostModel, region_actions: Sequence[RegionAction], *, detailed: bool
) -> _Prediction:
    """``detailed``: also split the bytes into forward storages and recomputed copies (for memory curves)."""
    regions = [ra.region for ra in region_actions]
    actions = [ra.action for ra in region_actions]
    _check_gradient_lifetimes(trace, actions)
    region_of = unit_regions(len(trace.units), regions)
    windows = region_windows(trace, region_actions)
    transfers = offload_transfers(trace, costs, region_actions, region_of, windows)
    changes = _storage_changes(trace, actions, regions, region_of, windows, transfers, detailed=detailed)
    event_bytes, forward_bytes, copy_bytes, pool_bytes = _event_series(trace, changes, detailed=detailed)
    burst_bytes, recompute_ms, rerun_units = _recompute_bursts(
        trace, actions, regions, region_of, windows, transfers.regions, changes, event_bytes,
        copy_bytes if detailed else None,
    )
    peak_event = max(range(len(trace.events)), key=event_bytes.__getitem__)
    machinery = machinery_ms(trace, costs, region_actions)
    timeline = Timeline(
        event_bytes=tuple(event_bytes),
        burst_bytes=tuple(burst_bytes),
        peak_bytes=event_bytes[peak_event],
        peak_event=peak_event,
        recompute_ms=recompute_ms,
        rerun_units=tuple(rerun_units),
        overhead_ms=recompute_ms + machinery + transfers.exposed_ms,
        machinery_ms=machinery,
        transfer_ms=transfers.exposed_ms,
        offloaded_bytes=transfers.moved_bytes,
        host_pool_bytes=transfers.pool_bytes,
    )
    return _Prediction(timeline=timeline, forward_bytes=forward_bytes, copy_bytes=copy_bytes, pool_bytes=pool_bytes)


def _storage_changes(
    trace: StepTrace, actions: Sequence[Action], regions: Sequence[Region], region_of: list[int | None],
    windows: Sequence[RegionWindow], transfers: OffloadTransfers, *, detailed: bool,
) -> _PlanChanges:
    """Each storage a region's unit makes, reads or saves (only those can change), under the plan's rules."""
    num_events = len(trace.events)
    index = storage_index(trace)
    changes = _PlanChanges.empty(num_events, len(regions))
    touched = sorted({s for region in regions for u in range(region.first_unit, region.last_unit + 1)
                      for s in index.storages_of_unit[u]})
    for position in touched:
        storage = trace.storages[position]
        base_free = storage.free_event if storage.free_event is not None else num_events - 1
        moved = transfers.moves.get(position, ())
        plan_free = _plan_free_event(storage, region_of, windows, base_free, transfers.regions, moved)
        if plan_free != base_free:
            first, last, nbytes = (plan_free + 1, base_free, -storage.nbytes) if plan_free < base_free else (
                base_free + 1, plan_free, storage.nbytes)
            _add(changes.plan, first, last, nbytes)
            if detailed:
                _add(changes.forward, first, last, nbytes)
        for copy in moved:  # each copy brought back from the pool, until its last saver has unpacked it
            _add(changes.plan, copy.fetch_event, copy.last_release_event, storage.nbytes)
            if detailed:
                _add(changes.copies, copy.fetch_event, copy.last_release_event, storage.nbytes)
                _add(changes.pool, copy.pack_event, num_events - 1, slot_bytes(storage.nbytes))
        home = region_at(region_of, storage.producer_unit)
        if home is None or home in transfers.regions:
            continue
        _recomputed_storage(storage, actions[home], windows[home], region_of, home, changes, detailed=detailed)
    last_backward = [window.last_backward_event for window in windows]
    for first, last, nbytes in late_leaf_gradients(trace, region_of, last_backward, actions):
        _add(changes.plan, first, last, nbytes)
    return changes


def _recomputed_storage(
    storage: StorageLife, action: Action, window: RegionWindow, region_of: list[int | None], home: int,
    changes: _PlanChanges, *, detailed: bool,
) -> None:
    """A storage made in recomputed region ``home``: its fresh copy in backward, and the gradient autockpt's own
    checkpoint holds when the storage is one of the region's outputs."""
    releases = [e for u, e in zip(storage.saver_units, storage.saver_release_events) if region_at(region_of, u) == home]
    gradient_free, late_peak = exit_gradient(storage, region_of, home)
    if (
        action is Action.RECOMPUTE_OWN  # it holds the gradients of the region's outputs
        and window.first_backward_event is not None
        and gradient_free is not None
        and is_region_output(storage, region_of, home)
    ):
        # the checkpoint holds the gradients of the region's outputs until the region's backward is done (in the
        # measured step they were gone after ``gradient_free``); in the event it went in, the rest of the event has
        # it too
        _add(changes.plan, max(gradient_free + 1, window.first_backward_event), window.last_backward_event,
             storage.nbytes)
        if late_peak is not None and window.first_backward_event <= gradient_free <= window.last_backward_event:
            level = changes.late_raises.setdefault(gradient_free, [0, 0])
            level[0], level[1] = max(level[0], late_peak), level[1] + storage.nbytes
    if releases and window.first_backward_event is not None:
        _add(changes.plan, window.first_backward_event, max(releases), storage.nbytes)
        if detailed:
            _add(changes.copies, window.first_backward_event, max(releases), storage.nbytes)
        changes.copy_bytes_at_burst[home] += storage.nbytes


def _event_series(
    trace: StepTrace, changes: _PlanChanges, *, detailed: bool
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per event: the step's bytes under the plan, and (detailed) its forward storages, copies and pool slots."""
    forward_made = storage_index(trace).forward_bytes
    event_bytes, forward_bytes, copy_bytes, pool_bytes = [], [], [], []
    running = forward_running = copy_running = pool_running = 0
    for event in trace.events:
        running += changes.plan[event.index]
        event_bytes.append(event.peak_bytes + running)
        if event.index in changes.late_raises:
            late_peak, held = changes.late_raises[event.index]
            event_bytes[-1] = max(event_bytes[-1], late_peak + held + running)
        if detailed:
            forward_running += changes.forward[event.index]
            copy_running += changes.copies[event.index]
            forward_bytes.append(forward_made[event.index] + forward_running)
            copy_bytes.append(copy_running)
            pool_running += changes.pool[event.index]
            pool_bytes.append(pool_running)
    return event_bytes, forward_bytes, copy_bytes, pool_bytes


def _recompute_bursts(
    trace: StepTrace, actions: Sequence[Action], regions: Sequence[Region], region_of: list[int | None],
    windows: Sequence[RegionWindow], offloaded: frozenset[int], changes: _PlanChanges, event_bytes: list[int],
    copy_bytes: list[int] | None,
) -> tuple[list[int], float, list[int]]:
    """Each recomputed region's burst where its backward starts (raising that event's bytes, and the copies' share
    of them when ``copy_bytes`` is given), the recomputed kernels' time and the units run again."""
    burst_bytes = []
    recompute_ms = 0.0
    rerun_units: list[int] = []
    for r, (region, window) in enumerate(zip(regions, windows)):
        if window.first_backward_event is None or r in offloaded:  # an offloaded region re-runs nothing
            burst_bytes.append(0)
            continue
        c = window.first_backward_event
        before_recompute = trace.events[c].start_bytes + sum(changes.plan[: c + 1]) - changes.copy_bytes_at_burst[r]
        replay = _replay_peak(trace, region, window, region_of, r, early_stop=stops_early(actions[r]))
        if window.last_recomputed_unit is not None:
            rerun = range(region.first_unit, window.last_recomputed_unit + 1)
            recompute_ms += sum(trace.units[u].forward_ms for u in rerun)
            rerun_units += rerun
        burst = before_recompute + replay
        burst_bytes.append(burst)
        if burst > event_bytes[c]:
            if copy_bytes is not None:
                copy_bytes[c] += burst - event_bytes[c]
            event_bytes[c] = burst
    return burst_bytes, recompute_ms, rerun_units


def _check_gradient_lifetimes(trace: StepTrace, actions: Sequence[Action]) -> None:
    if Action.RECOMPUTE_OWN in actions and not trace.gradient_lifetimes:
        raise ValueError(
            f"this trace cannot score {Action.RECOMPUTE_OWN.value!r}: it has no gradient lifetimes (the action holds "
            "output gradients); trace the step with gradient_lifetimes=True"
        )


def _predict_fast(trace: StepTrace, costs: CostModel, region_actions: Sequence[RegionAction]) -> Timeline:
    """``_predict(trace, costs, region_actions, detailed=False).timeline``, vectorised over storages."""
    arrays = storage_arrays(trace)
    num_events = arrays.num_events
    if num_events == 0:  # nothing to vectorise; the reference says what is wrong
        return _predict(trace, costs, region_actions, detailed=False).timeline
    actions = [ra.action for ra in region_actions]
    _check_gradient_lifetimes(trace, actions)
    regions = [ra.region for ra in region_actions]
    ordered = sorted(regions, key=lambda region: region.first_unit)
    if ordered and (
        max(region.last_unit for region in ordered) >= arrays.num_units
        or any(after.first_unit <= before.last_unit for before, after in itertools.pairwise(ordered))
    ):
        unit_regions(arrays.num_units, regions)  # raises the reference's error (past the last unit, or overlap)
    region_of = np.full(arrays.num_units + 1, -1, dtype=np.int64)  # the extra last entry: unit -1, outside the graph
    for r, region in enumerate(regions):
        region_of[region.first_unit : region.last_unit + 1] = r
    facts = [_region_facts(trace, arrays, ra.region, ra.action) for ra in region_actions]
    plan_delta = np.zeros(num_events + 1, dtype=np.int64)
    copy_bytes_at_burst = np.zeros(len(facts), dtype=np.int64)
    late_raises = np.zeros((2, num_events), dtype=np.int64)  # the reference's ``late_raises``, per event
    if facts:
        storage_deltas(arrays, region_of, facts, actions, plan_delta, copy_bytes_at_burst, late_raises)
    if Action.RECOMPUTE_OWN in actions and storage_index(trace).unowned:  # one per cast leaf: the reference's loop
        last_backward = [f.last_backward if f.last_backward >= 0 else None for f in facts]
        regions_of_units = [r if r >= 0 else None for r in region_of[: arrays.num_units].tolist()]
        for first, last, nbytes in late_leaf_gradients(trace, regions_of_units, last_backward, actions):
            plan_delta[first] += nbytes
            plan_delta[last + 1] -= nbytes
    running = np.cumsum(plan_delta[:num_events])
    event_bytes = arrays.peak_bytes + running
    raised = late_raises[1] > 0
    late_bytes = late_raises[0] + late_raises[1] + running
    event_bytes[raised] = np.maximum(event_bytes[raised], late_bytes[raised])

    burst_bytes = []
    recompute_ms = 0.0
    rerun_units: list[int] = []
    for r, fact in enumerate(facts):
        c = fact.first_backward
        if c < 0:
            burst_bytes.append(0)
            continue
        before_recompute = int(arrays.start_bytes[c]) + int(running[c]) - int(copy_bytes_at_burst[r])
        if fact.rerun_units:
            recompute_ms += fact.recompute_ms  # each region's sum, added in region order, as ``_predict`` adds them
            rerun_units += fact.rerun_units
        burst = before_recompute + fact.replay_bytes
        burst_bytes.append(burst)
        event_bytes[c] = max(event_bytes[c], burst)

    peak_event = int(event_bytes.argmax())  # the first of equal peaks, as max() over the events
    machinery = 0.0  # as ``machinery_ms``, region by region
    prices: dict[Action, tuple[float, float]] = {}
    for action, fact in zip(actions, facts):
        price = prices.get(action)
        if price is None:
            found = costs.price(action)
            price = prices[action] = (found.region_ms, found.saved_tensor_ms)
        machinery += price[0] + fact.saved_tensors * price[1]
    return Timeline(
        event_bytes=tuple(event_bytes.tolist()),
        burst_bytes=tuple(burst_bytes),
        peak_bytes=int(event_bytes[peak_event]),
        peak_event=peak_event,
        recompute_ms=recompute_ms,
        rerun_units=tuple(rerun_units),
        overhead_ms=recompute_ms + machinery,
        machinery_ms=machinery,
    )


def _region_facts(trace: StepTrace, arrays: StorageArrays, region: Region, action: Action) -> RegionFacts:
    key = (region, action)
    facts = arrays.region_facts.get(key)
    if facts is not None:
        return facts
    (window,) = region_windows(trace, (RegionAction(region=region, action=action),))
    rerun: list[int] = []
    recompute_ms = 0.0
    replay = 0
    if window.first_backward_event is not None:
        replay = replay_peak_alone(trace, arrays, region, window, early_stop=stops_early(action))
        if window.last_recomputed_unit is not None:
            rerun = list(range(region.first_unit, window.last_recomputed_unit + 1))
            recompute_ms = sum(arrays.forward_ms[region.first_unit : window.last_recomputed_unit + 1])
    facts = RegionFacts(
        first_backward=-1 if window.first_backward_event is None else window.first_backward_event,
        last_backward=-1 if window.last_backward_event is None else window.last_backward_event,
        replay_bytes=replay,
        rerun_units=rerun,
        recompute_ms=recompute_ms,
        saved_tensors=arrays.saved_tensors_before[region.last_unit + 1] - arrays.saved_tensors_before[region.first_unit],
    )
    if len(arrays.region_facts) >= REGION_FACTS_SIZE:
        arrays.region_facts.clear()
    arrays.region_facts[key] = facts
    return facts


def _plan_free_event(
    storage: StorageLife,
    region_of: list[int | None],
    windows: list[RegionWindow],
    base_free: int,
    offloaded: frozenset[int] = frozenset(),
    moved: tuple[MovedStorage, ...] = (),
) -> int:
    """Event after which the original storage is gone under the plan.

    Three things change a storage's life: recomputing the region that made and saved it (autograd no longer holds it
    for those savers), a recomputed region that reads it (the checkpoint holds it until the region's backward is
    done), and moving it to the host pool (``moved``: autograd holds a handle instead, for the savers in
    ``offloaded`` regions; on a device whose copies run beside compute, the pool holds it while in flight). Anything
    else, Python references included, stays as measured.
    """
    if storage.free_event is None:
        return base_free
    home = region_at(region_of, storage.producer_unit)
    home = None if home in offloaded else home  # an offloaded region holds nothing of its own
    held_by_regions = [
        windows[r].last_backward_event
        for r in {region_at(region_of, user) for user in storage.user_units}
        if r is not None and r != home and r not in offloaded and windows[r].last_backward_event is not None
    ]
    saved_in_home = home is not None and any(region_at(region_of, s) == home for s in storage.saver_units)
    if not saved_in_home and not moved:
        return max([base_free, *held_by_regions])
    holds = [storage.last_forward_use_event, *held_by_regions]
    for saver, release in zip(storage.saver_units, storage.saver_release_events):
        saver_region = region_at(region_of, saver)
        # autograd keeps it for a unit in no region, and for one in an offloaded region that did not move it
        if saver_region is None or (saver_region in offloaded and not moved):
            holds.append(release)
    holds += [copy.in_flight_until_event for copy in moved]
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
    output). What a unit made that no unit owns (autocast's cached casts, made before its kernel) is not made
    again: its rise leaves those bytes out.
    """
    storages = storage_index(trace)
    last = window.last_saver_unit if early_stop else region.last_unit
    live = 0
    peak = 0
    readers_left: dict[int, int] = {}  # storage index -> last unit of the region that reads it
    transient_bytes: dict[int, int] = {}
    for unit in range(region.first_unit, last + 1):
        event = storages.forward_event_of_unit.get(unit)
        kept = storages.unowned_bytes_of_unit[unit]  # in the event's bytes, not made again
        if early_stop and unit == last and event is not None and event.pack_peak_bytes is not None:
            return max(peak, live + event.pack_peak_bytes - event.start_bytes - kept)
        rise = event.peak_bytes - event.start_bytes - kept if event is not None else 0
        peak = max(peak, live + rise)
        for storage in storages.made_by_unit[unit]:
            if storage.free_event is not None and storage.free_event <= storage.alloc_event:
                continue  # a temporary of the unit itself: inside ``rise``
            saved_in_region = any(region_at(region_of, s) == r for s in storage.saver_units)
            if saved_in_region or any(region_at(region_of, u) != r for u in storage.user_units):
                live += storage.nbytes
                continue
            later_readers = [u for u in storage.user_units if region_at(region_of, u) == r and u > unit]
            if later_readers:
                live += storage.nbytes
                readers_left[storage.index] = max(later_readers)
                transient_bytes[storage.index] = storage.nbytes
        peak = max(peak, live)
        for index in [i for i, last_reader in readers_left.items() if last_reader <= unit]:
            live -= transient_bytes.pop(index)
            del readers_left[index]
    return peak
