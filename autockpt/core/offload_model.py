"""What offloading does to a step, as the simulator sees it: which storages go to the host pool, when their device
copies are freed and come back, how many bytes the pool needs, and how much of the link's time the step waits for.

The rules are the runtime's (``offload.py``), applied to the measured trace:

* moved: every storage made in forward that a unit of an offloaded region saves for backward, of at least
  ``offload.MIN_STORAGE_BYTES`` (parameters, buffers and the step's inputs are never moved, and are not in the
  trace's storages either). Each moves once per step per version, however many regions save it (a storage
  written in place between two packs, e.g. by an in-place ReLU that saves its output, moves once per version
  packed: the version at a pack counts the writers up to the packing unit); the pool needs ``offload.slot_bytes``
  of each copy.
* its device copy is freed when nothing else holds it (``simulate._plan_free_event``); where copies run beside
  compute (CUDA) the pool also holds it until its copy has finished, which the runtime guarantees by the exit of the
  next offloaded region entered (the first backward event when there is none): the prediction takes that bound.
* it comes back at the first backward event of the next higher-numbered offloaded region (the runtime prefetches one
  region ahead), or at its own region's first backward event when no region is above it, and lives until the last
  saver in an offloaded region has unpacked it.
* time: synchronous copies (CPU) add their whole link time. Overlapped copies (CUDA) add what sticks out of the
  compute beside them: a region's device-to-host copies against the forward up to the next offloaded region's exit;
  a prefetch against the backward of the region whose unpack started it (estimated as that region's forward time
  times the step's measured backward/forward ratio); a fetch on demand adds its whole time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from autockpt.types import Action, CostModel, Phase, RegionAction, StepTrace

# The host pool's rules, shared by this model and the runtime (runtime/offload.py imports them from here).
MIN_STORAGE_BYTES = 1024  # smaller storages stay with autograd: a copy costs more than the bytes are worth
SLOT_ALIGNMENT_BYTES = 512  # every slot starts at a multiple of this in the host buffer


def slot_bytes(storage_bytes: int) -> int:
    """The host bytes a storage of ``storage_bytes`` takes: rounded up to ``SLOT_ALIGNMENT_BYTES``."""
    return -(-storage_bytes // SLOT_ALIGNMENT_BYTES) * SLOT_ALIGNMENT_BYTES


class RegionWindow(Protocol):
    """What this module reads of ``region_rules.RegionWindow`` (simulate imports this module, not the other way)."""

    first_backward_event: int | None


@dataclass(frozen=True, slots=True)
class MovedStorage:
    """One storage the plan moves to the host pool: the events that bound its device copies."""

    pack_event: int  # the forward event whose saver packs it: its pool slot is taken here, for the rest of the step
    in_flight_until_event: int  # the pool holds the original until here (-1: copies are synchronous)
    fetch_event: int  # the copy brought back is allocated here
    last_release_event: int  # ... and freed after the last saver in an offloaded region unpacked it here


@dataclass(frozen=True, slots=True)
class OffloadTransfers:
    """Everything the plan's offloaded regions change."""

    regions: frozenset[int]  # indices (in the plan's region order) of the offloaded regions
    moves: dict[int, tuple[MovedStorage, ...]]  # storage position in the trace -> its moved copies (one per version)
    moved_bytes: int  # per step, each way
    pool_bytes: int  # the host pool the step needs
    exposed_ms: float  # link time the step waits for


NO_TRANSFERS = OffloadTransfers(regions=frozenset(), moves={}, moved_bytes=0, pool_bytes=0, exposed_ms=0.0)


def offload_transfers(
    trace: StepTrace,
    costs: CostModel,
    region_actions: Sequence[RegionAction],
    region_of: Sequence[int | None],
    windows: Sequence[RegionWindow],
) -> OffloadTransfers:
    """The transfers of the plan's offloaded regions (``region_of``: each unit's region; ``windows``: each region's
    backward events, from ``region_rules.region_windows``)."""
    offloaded = [r for r, ra in enumerate(region_actions) if ra.action is Action.OFFLOAD]
    if not offloaded:
        return NO_TRANSFERS
    link = costs.link
    if link is None:
        raise ValueError(
            f"the cost model for {costs.device} has no link prices, which offloading needs; calibrate them with "
            "costs.calibrate(device, actions, link=True)"
        )
    forward_event = {e.unit: e.index for e in trace.events if e.phase is Phase.FORWARD and e.unit >= 0}
    first_backward = min((e.index for e in trace.events if e.phase is Phase.BACKWARD), default=len(trace.events) - 1)
    units_of = {r: range(region_actions[r].region.first_unit, region_actions[r].region.last_unit + 1) for r in offloaded}
    exit_event = {r: max((forward_event[u] for u in units_of[r] if u in forward_event), default=first_backward)
                  for r in offloaded}
    is_offloaded = set(offloaded)

    # one moved copy per (storage, version packed): its savers in offloaded regions
    copies: list[tuple[int, list[int], list[int]]] = []  # (storage position, saver units, their release events)
    for position, storage in enumerate(trace.storages):
        if storage.nbytes < MIN_STORAGE_BYTES:
            continue
        by_version: dict[int, tuple[list[int], list[int]]] = {}
        for unit, release in zip(storage.saver_units, storage.saver_release_events):
            if unit >= 0 and region_of[unit] in is_offloaded:
                version = sum(1 for writer in storage.mutator_units if writer <= unit)
                savers, releases = by_version.setdefault(version, ([], []))
                savers.append(unit)
                releases.append(release)
        copies += [(position, savers, releases) for _, (savers, releases) in sorted(by_version.items())]
    owned: dict[int, list[int]] = {r: [] for r in offloaded}  # region that packs a copy first -> copies
    saving_regions: dict[int, list[int]] = {}  # copy -> offloaded regions whose units pack it
    for copy_index, (_, savers, _) in enumerate(copies):
        regions = sorted({region_of[u] for u in savers})
        saving_regions[copy_index] = regions
        owned[regions[0]].append(copy_index)

    holding = [r for r in offloaded if any(r in regions for regions in saving_regions.values())]
    above = {r: next((h for h in holding if h > r and windows[h].first_backward_event is not None), None)
             for r in holding}

    def fetched_by(r: int) -> int:
        """The region whose first unpack brings ``r``'s storages back (``r`` itself: on demand)."""
        return above[r] if above[r] is not None else r

    moves: dict[int, MovedStorage] = {}  # by copy
    for copy_index, regions in saving_regions.items():
        releases = copies[copy_index][2]
        fetches = [windows[fetched_by(r)].first_backward_event for r in regions]
        fetches = [e for e in fetches if e is not None]
        if not releases or not fetches:
            continue  # never unpacked in backward: nothing comes back
        after = [h for h in offloaded if h > regions[0]]
        in_flight = (exit_event[after[0]] if after else first_backward) if link.overlaps_compute else -1
        packed_by = min(copies[copy_index][1])
        moves[copy_index] = MovedStorage(
            pack_event=forward_event.get(packed_by, first_backward), in_flight_until_event=in_flight, fetch_event=min(fetches), last_release_event=max(releases)
        )
    nbytes = {c: trace.storages[copies[c][0]].nbytes for c in moves}
    by_storage: dict[int, tuple[MovedStorage, ...]] = {}
    for c, moved in moves.items():
        by_storage[copies[c][0]] = (*by_storage.get(copies[c][0], ()), moved)
    return OffloadTransfers(
        regions=frozenset(offloaded), moves=by_storage, moved_bytes=sum(nbytes.values()),
        pool_bytes=sum(slot_bytes(n) for n in nbytes.values()),
        exposed_ms=_exposed_ms(trace, costs, region_actions, offloaded, owned, nbytes, fetched_by),
    )


def _exposed_ms(
    trace: StepTrace,
    costs: CostModel,
    region_actions: Sequence[RegionAction],
    offloaded: list[int],
    owned: dict[int, list[int]],
    nbytes: dict[int, int],  # moved copy -> its storage's bytes
    fetched_by: Callable[[int], int],  # region -> the region whose first unpack fetches it
) -> float:
    link = costs.link
    assert link is not None
    if not link.overlaps_compute:
        return sum(link.device_to_host_ms(n) + link.host_to_device_ms(n) for n in nbytes.values())
    backward_per_forward = (trace.step_ms - trace.forward_ms) / trace.forward_ms if trace.forward_ms > 0 else 2.0
    exposed = 0.0
    last_unit = len(trace.units) - 1
    for k, r in enumerate(offloaded):
        mine = [c for c in owned[r] if c in nbytes]
        if not mine:
            continue
        # device -> host: beside the forward from this region's end to the next offloaded region's end
        until = region_actions[offloaded[k + 1]].region.last_unit if k + 1 < len(offloaded) else last_unit
        beside_ms = sum(trace.units[u].forward_ms for u in range(region_actions[r].region.last_unit + 1, until + 1))
        exposed += max(0.0, sum(link.device_to_host_ms(nbytes[p]) for p in mine) - beside_ms)
        # host -> device: beside the backward of the region whose unpack started the prefetch
        fetch_ms = sum(link.host_to_device_ms(nbytes[p]) for p in mine)
        trigger = fetched_by(r)
        if trigger == r:
            exposed += fetch_ms
        else:
            region = region_actions[trigger].region
            backward_ms = backward_per_forward * sum(
                trace.units[u].forward_ms for u in range(region.first_unit, region.last_unit + 1)
            )
            exposed += max(0.0, fetch_ms - backward_ms)
    return exposed
