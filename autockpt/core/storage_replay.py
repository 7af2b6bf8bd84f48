"""The simulator's storage index and its fast replay machinery: what ``simulate.py`` reads of a trace, indexed once.

``storage_index``: per unit, the storages it makes, reads or saves, its backward span and forward event; per event,
the bytes of forward-made storages alive. ``storage_arrays``: the trace's storages as flat numpy arrays, with what one
region and its action alone fix (``RegionFacts``, filled by ``simulate``), for the vectorised simulator
(``simulate._predict_fast``): ``storage_deltas`` applies a plan to every storage at once and ``replay_peak_alone`` is
``simulate._replay_peak`` of one region. Both are cached per trace (a few traces at a time).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from autockpt.types import Action, MemoryEvent, Phase, Region, StepTrace, StorageLife


class ReplayWindow(Protocol):
    """What ``replay_peak_alone`` reads of ``region_rules.RegionWindow`` (simulate imports this module, not the other
    way)."""

    last_saver_unit: int | None


@dataclass(frozen=True, slots=True)
class StorageIndex:
    storages_of_unit: tuple[tuple[int, ...], ...]  # per unit: storages it makes, reads or saves
    forward_bytes: tuple[int, ...]  # per event: bytes of forward-made storages alive in the measured step
    made_by_unit: tuple[tuple[StorageLife, ...], ...]  # per unit: the storages it made
    backward_span_of_unit: tuple[tuple[int, int] | None, ...]  # per unit: first and last backward event unpacking
    saves_own_output: frozenset[int]  # units that saved a storage they made
    forward_event_of_unit: dict[int, MemoryEvent]  # unit -> its forward event
    # per unit: bytes of storages made in its forward event that no unit owns (autocast's cached casts)
    unowned_bytes_of_unit: tuple[int, ...]
    unowned: tuple[StorageLife, ...]  # those storages


# Scoring candidates simulates hundreds of plans on one trace: index it once. StepTraces are kept alive here, so an
# id is never reused while its entry exists; a few entries are enough (one planner at a time, tests).
_INDEX_CACHE: dict[int, tuple[StepTrace, StorageIndex]] = {}
_INDEX_CACHE_SIZE = 4


def storage_index(trace: StepTrace) -> StorageIndex:
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
    unowned_bytes = [0] * len(trace.units)
    unowned = []
    for storage in trace.storages:
        if storage.producer_unit >= 0:
            made[storage.producer_unit].append(storage)
        elif trace.events[storage.alloc_event].unit >= 0:  # made while a unit ran, owned by none
            unowned_bytes[trace.events[storage.alloc_event].unit] += storage.nbytes
            unowned.append(storage)
    spans: list[tuple[int, int] | None] = [None] * len(trace.units)
    for event in trace.events:  # a backward event belongs to the unit whose saved tensors it unpacked
        if event.phase is Phase.BACKWARD and event.unit >= 0:
            span = spans[event.unit]
            spans[event.unit] = (event.index, event.index) if span is None else (span[0], event.index)
    index = StorageIndex(
        backward_span_of_unit=tuple(spans),
        saves_own_output=frozenset(u for s in trace.storages for u in s.saver_units if u == s.producer_unit),
        storages_of_unit=tuple(tuple(sorted(s)) for s in related),
        forward_bytes=tuple(itertools.accumulate(alive[:num_events])),
        made_by_unit=tuple(map(tuple, made)),
        forward_event_of_unit={e.unit: e for e in trace.events if e.phase is Phase.FORWARD and e.unit >= 0},
        unowned_bytes_of_unit=tuple(unowned_bytes),
        unowned=tuple(unowned),
    )
    if len(_INDEX_CACHE) >= _INDEX_CACHE_SIZE:
        _INDEX_CACHE.pop(next(iter(_INDEX_CACHE)))
    _INDEX_CACHE[id(trace)] = (trace, index)
    return index


# one entry per trace, kept alive with it (as _INDEX_CACHE: an id is never reused while its entry exists)
_ARRAYS_CACHE: dict[int, tuple[StepTrace, StorageArrays]] = {}


def storage_arrays(trace: StepTrace) -> StorageArrays:
    cached = _ARRAYS_CACHE.get(id(trace))
    if cached is not None and cached[0] is trace:
        return cached[1]
    num_events = len(trace.events)
    storages = trace.storages

    def units(values: Sequence[int]) -> np.ndarray:  # unit -1 (outside the graph) -> region_of's extra last entry
        array = np.array(values, dtype=np.int64)
        array[array < 0] = len(trace.units)
        return array

    # one entry per (storage, unit); savers zipped with their release events, as ``simulate._predict`` zips them
    users = [(s, u) for s, storage in enumerate(storages) for u in storage.user_units]
    savers = [
        (s, u, e)
        for s, storage in enumerate(storages)
        for u, e in zip(storage.saver_units, storage.saver_release_events)
    ]
    mutators = [(s, u) for s, storage in enumerate(storages) for u in storage.mutator_units]
    versions = [(s, v) for s, storage in enumerate(storages) for v in storage.gradient_versions]
    arrays = StorageArrays(
        num_units=len(trace.units),
        num_events=num_events,
        num_storages=len(storages),
        peak_bytes=np.array([e.peak_bytes for e in trace.events], dtype=np.int64),
        start_bytes=np.array([e.start_bytes for e in trace.events], dtype=np.int64),
        nbytes=np.array([s.nbytes for s in storages], dtype=np.int64),
        producer=units([s.producer_unit for s in storages]),
        base_free=np.array(
            [num_events - 1 if s.free_event is None else s.free_event for s in storages], dtype=np.int64
        ),
        never_freed=np.array([s.free_event is None for s in storages], dtype=bool),
        last_forward_use=np.array([s.last_forward_use_event for s in storages], dtype=np.int64),
        gradient_free=np.array(
            [-1 if s.gradient_free_event is None else s.gradient_free_event for s in storages], dtype=np.int64
        ),
        user_owner=np.array([s for s, _ in users], dtype=np.int64),
        user_unit=units([u for _, u in users]),
        saver_owner=np.array([s for s, _, _ in savers], dtype=np.int64),
        saver_unit=units([u for _, u, _ in savers]),
        saver_release=np.array([e for _, _, e in savers], dtype=np.int64),
        mutator_owner=np.array([s for s, _ in mutators], dtype=np.int64),
        mutator_unit=units([u for _, u in mutators]),
        version_owner=np.array([s for s, _ in versions], dtype=np.int64),
        version_writer=units([v.writer_unit for _, v in versions]),
        version_free=np.array([v.free_event for _, v in versions], dtype=np.int64),
        version_late_peak=np.array(
            [-1 if v.late_peak_bytes is None else v.late_peak_bytes for _, v in versions], dtype=np.int64
        ),
        forward_ms=[unit.forward_ms for unit in trace.units],
        saved_tensors_before=[0, *itertools.accumulate(unit.saved_tensors for unit in trace.units)],
    )
    if len(_ARRAYS_CACHE) >= _INDEX_CACHE_SIZE:
        _ARRAYS_CACHE.pop(next(iter(_ARRAYS_CACHE)))
    _ARRAYS_CACHE[id(trace)] = (trace, arrays)
    return arrays


def storage_deltas(
    arrays: StorageArrays,
    region_of: np.ndarray,
    facts: list[RegionFacts],
    actions: list[Action],
    plan_delta: np.ndarray,
    copy_bytes_at_burst: np.ndarray,
    late_raises: np.ndarray,
) -> None:
    """What the plan changes in every storage's life, as ``simulate._predict``'s loop over touched storages does,
    added into the difference array ``plan_delta``; per region, the bytes of the copies its recomputation makes; and
    per event (``late_raises``, shape (2, events)), the peak after held output gradients went and their bytes."""
    none = -1  # an event index or region that does not exist; every real one is >= 0, so it also acts as -infinity
    a = arrays
    first_backward = np.array([f.first_backward for f in facts], dtype=np.int64)
    last_backward = np.array([f.last_backward for f in facts], dtype=np.int64)
    home = region_of[a.producer]
    # regions (not the storage's home) that read it hold it until their backward is done (``simulate._plan_free_event``)
    user_region = region_of[a.user_unit]
    user_home = home[a.user_owner]
    read_elsewhere = user_region != user_home
    held = np.where((user_region >= 0) & read_elsewhere, last_backward[user_region], none)
    held_max = np.full(a.num_storages, none, dtype=np.int64)
    np.maximum.at(held_max, a.user_owner, held)
    saver_region = region_of[a.saver_unit]
    saved_in_home_entry = (saver_region >= 0) & (saver_region == home[a.saver_owner])
    saved_in_home = np.zeros(a.num_storages, dtype=bool)
    saved_in_home[a.saver_owner[saved_in_home_entry]] = True
    # autograd keeps a storage for each saver that is not checkpointed
    kept_for = np.full(a.num_storages, none, dtype=np.int64)
    np.maximum.at(kept_for, a.saver_owner, np.where(saver_region < 0, a.saver_release, none))
    plan_free = np.where(
        saved_in_home,
        np.maximum(np.maximum(a.last_forward_use, held_max), kept_for),
        np.maximum(a.base_free, held_max),
    )
    plan_free[a.never_freed] = a.base_free[a.never_freed]
    # each storage now freed at plan_free instead of base_free, freed earlier or later alike; where the two are the
    # same event the bytes cancel (integers: exactly)
    np.subtract.at(plan_delta, plan_free + 1, a.nbytes)
    np.add.at(plan_delta, a.base_free + 1, a.nbytes)

    at_home = home >= 0
    home_first = np.where(at_home, first_backward[home], none)
    if Action.RECOMPUTE_OWN in actions:
        # the checkpoint holds the gradients of the region's outputs until the region's backward is done (only the
        # regions under autockpt's own checkpoint)
        holds_gradients = np.array([action is Action.RECOMPUTE_OWN for action in actions], dtype=bool)
        home_last = np.where(at_home, last_backward[home], none)
        read_outside = np.zeros(a.num_storages, dtype=bool)
        read_outside[a.user_owner[read_elsewhere]] = True
        output = a.never_freed | read_outside
        gradient_free, late_peak = _exit_gradients(a, region_of, home)
        start = np.maximum(gradient_free + 1, home_first)
        held = at_home & holds_gradients[home] & (home_first >= 0) & (gradient_free >= 0) & output
        holds = held & (start <= home_last)
        np.add.at(plan_delta, start[holds], a.nbytes[holds])
        np.subtract.at(plan_delta, home_last[holds] + 1, a.nbytes[holds])
        late = held & (late_peak >= 0) & (home_first <= gradient_free) & (gradient_free <= home_last)
        np.maximum.at(late_raises[0], gradient_free[late], late_peak[late])
        np.add.at(late_raises[1], gradient_free[late], a.nbytes[late])
    # a fresh copy from the recomputation lives until the last saver of the home region has unpacked it
    copy_until = np.full(a.num_storages, none, dtype=np.int64)
    np.maximum.at(copy_until, a.saver_owner, np.where(saved_in_home_entry, a.saver_release, none))
    copied = saved_in_home & (home_first >= 0)
    np.add.at(copy_bytes_at_burst, home[copied], a.nbytes[copied])
    lives = copied & (home_first <= copy_until)
    np.add.at(plan_delta, home_first[lives], a.nbytes[lives])
    np.subtract.at(plan_delta, copy_until[lives] + 1, a.nbytes[lives])


def _exit_gradients(a: StorageArrays, region_of: np.ndarray, home: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``region_rules.exit_gradient`` of every storage: its gradient's free event (-1: not recorded) and that event's
    later peak (-1: none), for the version its home region returns."""
    writer = a.producer.copy()
    owner_home = home[a.mutator_owner]
    inside = (owner_home >= 0) & (region_of[a.mutator_unit] == owner_home)
    np.maximum.at(writer, a.mutator_owner[inside], a.mutator_unit[inside])
    found = a.version_writer == writer[a.version_owner]
    gradient_free = a.gradient_free.copy()
    late_peak = np.full(a.num_storages, -1, dtype=np.int64)
    gradient_free[a.version_owner[found]] = a.version_free[found]
    late_peak[a.version_owner[found]] = a.version_late_peak[found]
    return gradient_free, late_peak


@dataclass(frozen=True, slots=True)
class RegionFacts:
    """What depends on one region and its action alone (not on the rest of the plan)."""

    first_backward: int  # the window's events, -1 for None
    last_backward: int
    replay_bytes: int  # ``simulate._replay_peak``: its membership tests only ask whether a unit is in this region
    rerun_units: list[int]
    recompute_ms: float  # summed over ``rerun_units`` in order with ``sum``, as ``simulate._predict`` sums it
    saved_tensors: int


@dataclass(frozen=True, slots=True)
class StorageArrays:
    """The trace's storages as flat arrays (ragged unit lists as one entry per (storage, unit), with its owner)."""

    num_units: int
    num_events: int
    num_storages: int
    peak_bytes: np.ndarray  # per event
    start_bytes: np.ndarray  # per event
    nbytes: np.ndarray  # per storage, from here on
    producer: np.ndarray  # units as indices into ``region_of``: num_units (its extra entry) for -1, outside the graph
    base_free: np.ndarray  # the measured free event (the last event when never freed)
    never_freed: np.ndarray
    last_forward_use: np.ndarray
    gradient_free: np.ndarray  # -1: not recorded
    user_owner: np.ndarray  # per (storage, user unit) entry: the storage
    user_unit: np.ndarray
    saver_owner: np.ndarray  # per (storage, saver unit) entry: the storage
    saver_unit: np.ndarray
    saver_release: np.ndarray  # the saver's last backward event unpacking the storage
    mutator_owner: np.ndarray  # per (storage, unit writing it in place) entry: the storage
    mutator_unit: np.ndarray
    version_owner: np.ndarray  # per (storage, gradient version) entry: the storage
    version_writer: np.ndarray  # the unit that wrote the version (as ``producer``)
    version_free: np.ndarray  # its gradient's free event
    version_late_peak: np.ndarray  # that event's peak after the free; -1: never freed
    forward_ms: list[float]  # per unit
    saved_tensors_before: list[int]  # per unit and one past the last: tensors the units before it save
    # per (region, action) simulated on this trace: what they alone fix (bounded: cleared when full)
    region_facts: dict[tuple[Region, Action], RegionFacts] = field(default_factory=dict)
    replay_units: list[_ReplayUnit] = field(default_factory=list)  # ``_replay_units``, made on first use


REGION_FACTS_SIZE = 1 << 16
# per unit: the rise of its forward event to its peak and to its last pack, and the storages it made that outlive it
_ReplayUnit = tuple[int, int | None, tuple[tuple[int, int, int, tuple[int, ...]], ...]]


def replay_peak_alone(
    trace: StepTrace, arrays: StorageArrays, region: Region, window: ReplayWindow, *, early_stop: bool
) -> int:
    """``simulate._replay_peak`` of ``region``: its rules only ask whether a unit is in this region, so the rest of
    the plan does not matter. The same steps, on what ``_replay_units`` keeps per unit: a transient leaves at its last
    reader (where ``simulate._replay_peak``'s scan finds it), and "read outside the region" compares the first and
    last reader."""
    first, last_unit = region.first_unit, region.last_unit
    last = window.last_saver_unit if early_stop else last_unit
    assert last is not None  # a region with a first backward event has a last saver
    replay_units = _replay_units(trace, arrays)
    live = 0
    peak = 0
    leaving: dict[int, int] = {}  # unit -> bytes of transients it is the last reader of
    for unit in range(first, last + 1):
        rise, pack_rise, made = replay_units[unit]
        if early_stop and unit == last and pack_rise is not None:
            return max(peak, live + pack_rise)
        peak = max(peak, live + rise)
        for nbytes, first_user, last_user, savers in made:
            if first_user < first or last_user > last_unit or any(first <= s <= last_unit for s in savers):
                live += nbytes  # read outside the region (a unit outside, or the loss), or saved in it
            elif last_user > unit:
                live += nbytes  # read by a later unit of the region: until that unit ran
                leaving[last_user] = leaving.get(last_user, 0) + nbytes
        peak = max(peak, live)
        live -= leaving.pop(unit, 0)
    return peak


_NO_USER = (1 << 62, -1)  # (first, last) reader of a storage no unit reads: neither outside a region nor later


def _replay_units(trace: StepTrace, arrays: StorageArrays) -> list[_ReplayUnit]:
    """Per unit, for ``replay_peak_alone``: its forward event's rise (to its peak, and to its last pack: None if
    nothing was packed), and the storages it made that outlive it: bytes, first and last reader, savers."""
    if arrays.replay_units:
        return arrays.replay_units
    index = storage_index(trace)
    for unit in range(len(trace.units)):
        event = index.forward_event_of_unit.get(unit)
        kept = index.unowned_bytes_of_unit[unit]  # as ``simulate._replay_peak``: not made again
        rise = event.peak_bytes - event.start_bytes - kept if event is not None else 0
        pack_rise = (
            event.pack_peak_bytes - event.start_bytes - kept
            if event is not None and event.pack_peak_bytes is not None
            else None
        )
        made = tuple(
            (
                storage.nbytes,
                *((min(storage.user_units), max(storage.user_units)) if storage.user_units else _NO_USER),
                storage.saver_units,
            )
            for storage in index.made_by_unit[unit]
            if not (storage.free_event is not None and storage.free_event <= storage.alloc_event)
        )
        arrays.replay_units.append((rise, pack_rise, made))
    return arrays.replay_units
