"""The rules every plan's prediction shares, region by region: where a region is recomputed on the measured timeline
and how far (``region_windows``), which region each unit is in (``unit_regions``), and the gradients autockpt's own
checkpoint holds or makes late (``exit_gradient``, ``late_leaf_gradients``). ``simulate.py``'s reference predictor and
its vectorised twin both read them (``storage_replay.py`` mirrors them over arrays)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autockpt.core.storage_replay import storage_index
from autockpt.types import Action, Region, RegionAction, StepTrace, StorageLife


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
    index = storage_index(trace)
    windows = []
    for region_action in region_actions:
        region, early_stop = region_action.region, stops_early(region_action.action)
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


def stops_early(action: Action) -> bool:
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


def late_leaf_gradients(
    trace: StepTrace,
    region_of: Sequence[int | None],
    last_backward: Sequence[int | None],
    actions: Sequence[Action],
) -> list[tuple[int, int, int]]:
    """(first event, last event, bytes added) for the leaf gradients autockpt's own checkpoint makes late
    (``region_of``: each unit's region; ``last_backward``: each region's last backward event).

    Its backward differentiates the recomputed region with ``torch.autograd.grad``. There the gradient function of
    each cast autocast cached in forward (a float32 parameter's low-precision copy; ``trace.py`` records the event
    the parameter's gradient was made in as the copy's ``gradient_free_event``) is older than everything the
    recomputation recorded, and autograd runs ready nodes newest first, so those casts back to float32 all run at
    the end of the region's backward. Until then each such parameter's low-precision gradient is held and its
    float32 gradient, twice the bytes (autocast casts to 16-bit types), is not made yet: the step holds the copy's
    bytes less. From the region's last backward event on it is as measured; the event the gradient was made in is
    left as measured too (its peak may come before the float32 gradient did).
    """
    changes = []
    for storage in storage_index(trace).unowned:
        made_at = storage.gradient_free_event
        if made_at is None:
            continue
        unit = trace.events[made_at].unit  # the backward event of the unit that used the copy
        r = region_of[unit] if unit >= 0 else None
        last = last_backward[r] if r is not None else None
        if r is not None and actions[r] is Action.RECOMPUTE_OWN and last is not None and made_at + 1 <= last - 1:
            changes.append((made_at + 1, last - 1, -storage.nbytes))
    return changes


def exit_gradient(storage: StorageLife, region_of: Sequence[int | None], home: int) -> tuple[int | None, int | None]:
    """(free event, peak of that event after it) of the gradient of the version of ``storage`` that region ``home``
    returns: the version its last writer in the region made (the producer, or an in-place op after it). The
    storage's last gradient (no later peak) where versions were not recorded."""
    writer = max([storage.producer_unit, *(u for u in storage.mutator_units if region_at(region_of, u) == home)])
    for version in storage.gradient_versions:
        if version.writer_unit == writer:
            return version.free_event, version.late_peak_bytes
    return storage.gradient_free_event, None


def is_region_output(storage: StorageLife, region_of: list[int | None], r: int) -> bool:
    """Made in region ``r`` and read after it: by a unit outside it, by the loss, or as part of the model output."""
    return storage.free_event is None or any(region_at(region_of, u) != r for u in storage.user_units)


def region_at(region_of: list[int | None], unit: int) -> int | None:
    """Region of a unit; work outside the graph (unit -1: the loss, autograd's start) is in none."""
    return region_of[unit] if unit >= 0 else None
