"""Which regions may be checkpointed: contiguous unit ranges that are safe and worth considering.

For fx and export graphs, the unit sequence is cut where few bytes cross the cut (a transformer's residual stream
between sub-blocks, a chain's single activation), spread over the graph; a candidate region is any run of up to
``max_segments_per_region`` consecutive pieces. For module-level captures, a candidate is one call of a submodule.
Found from the measured graph, never from model-specific names.
"""

from __future__ import annotations

from dataclasses import dataclass

from autockpt.core.structure import crossing_bytes
from autockpt.types import CaptureKind, Graph, Region, StepTrace


def candidate_regions(
    graph: Graph, profile: StepTrace, *, max_segments: int = 48, max_segments_per_region: int = 12
) -> tuple[list[Region], list[Region]]:
    """Return (elementary segments, candidate regions)."""
    num_units = len(profile.units)
    if num_units == 0:
        return [], []
    if graph.kind is CaptureKind.MODULE:
        segments = [Region(first_unit=u, last_unit=u) for u in range(num_units)]
        calls: dict[str, int] = {}
        for span in graph.module_spans:
            calls[span.path] = calls.get(span.path, 0) + 1
        regions = {
            (s.first_unit, s.last_unit)
            for s in graph.module_spans
            if s.path and calls[s.path] == 1 and s.last_unit < num_units
        }
        candidates = [Region(first_unit=f, last_unit=l) for f, l in sorted(regions)]
    else:
        # a graph with few units gets a segment per unit: nothing is lost to cut placement
        segments = (
            [Region(first_unit=u, last_unit=u) for u in range(num_units)]
            if num_units <= max_segments else equal_saved_segments(profile, max_segments)
        )
        candidates = [
            Region(first_unit=segments[a].first_unit, last_unit=segments[b].last_unit)
            for a in range(len(segments))
            for b in range(a, min(len(segments), a + max_segments_per_region))
        ]
        candidates += _cheap_runs(profile) + _without_leading_non_savers(profile, candidates)
        candidates = list(dict.fromkeys(candidates))  # unique, in order
    saves = [u.saved_bytes > 0 for u in profile.units]
    hazards = mutation_hazards(profile)
    useful = [r for r in candidates if any(saves[r.first_unit : r.last_unit + 1]) and not is_unsafe(r, hazards)]
    return segments, useful


def safe_regions(profile: StepTrace, regions: list[Region]) -> list[Region]:
    """The regions checkpoint can re-run correctly (no in-place write into one of their inputs)."""
    hazards = mutation_hazards(profile)
    return [r for r in regions if not is_unsafe(r, hazards)]


def equal_saved_segments(profile: StepTrace, max_segments: int) -> list[Region]:
    """Cut where few bytes cross, one cut per slice of equal saved-for-backward bytes.

    Slicing by saved bytes spreads the cuts where activations are (not over cheap index arithmetic), and picking the
    smallest crossing inside each slice lands on natural boundaries such as a residual stream between sub-blocks.
    """
    num_units = len(profile.units)
    crossing = crossing_bytes(profile)
    if not crossing:
        return [Region(first_unit=0, last_unit=num_units - 1)]
    cumulative, running = [], 0
    for unit in profile.units:
        running += unit.saved_bytes
        cumulative.append(running)
    total = max(running, 1)

    def first_unit_reaching(fraction: float) -> int:
        target = fraction * total
        return next((u for u, c in enumerate(cumulative) if c >= target), num_units - 1)

    cuts: set[int] = set()
    for k in range(1, max_segments):
        low = min(first_unit_reaching((k - 0.5) / max_segments), len(crossing) - 1)
        high = min(first_unit_reaching((k + 0.5) / max_segments), len(crossing) - 1)
        middle = first_unit_reaching(k / max_segments)
        cuts.add(min(range(low, high + 1), key=lambda p: (crossing[p], abs(p - middle))))
    segments, start = [], 0
    for cut in sorted(cuts):
        if cut >= start:
            segments.append(Region(first_unit=start, last_unit=cut))
            start = cut + 1
    if start <= num_units - 1:
        segments.append(Region(first_unit=start, last_unit=num_units - 1))
    return segments


def _cheap_runs(profile: StepTrace) -> list[Region]:
    """Maximal runs of units FlopCounterMode counts no FLOPs for (pointwise, normalisation, reshapes).

    Checkpointing such a run keeps the outputs of the matmuls, convolutions and attention around it and recomputes
    only cheap work: the selective recomputation that costs least time per byte saved.
    """
    runs, start = [], None
    for unit in profile.units:
        if unit.flops == 0:
            start = unit.index if start is None else start
        elif start is not None:
            runs.append(Region(first_unit=start, last_unit=unit.index - 1))
            start = None
    if start is not None:
        runs.append(Region(first_unit=start, last_unit=len(profile.units) - 1))
    return runs


def _without_leading_non_savers(profile: StepTrace, regions: list[Region]) -> list[Region]:
    """Each region with the units at its start that save nothing cut off.

    Cuts are placed by saved bytes, so a unit that saves nothing (the op reading the model input, an add) rarely ends
    a segment, and every region starting there also re-runs it. Trimmed, its output becomes an input the checkpoint
    holds instead of a tensor recomputed: another trade-off the program should see.
    """
    trimmed = []
    for region in regions:
        first = region.first_unit
        while first < region.last_unit and profile.units[first].saved_bytes == 0:
            first += 1
        if first == region.first_unit or profile.units[first].saved_bytes == 0:
            continue  # nothing to cut off, or nothing left that saves
        cut_off = range(region.first_unit, first)
        region_ms = sum(profile.units[u].forward_ms for u in range(region.first_unit, region.last_unit + 1))
        # cutting off views and index arithmetic saves no time: only offer the trimmed region when real work goes
        cut_off_work = any(profile.units[u].flops > 0 for u in cut_off) or (
            sum(profile.units[u].forward_ms for u in cut_off) >= 0.05 * region_ms
        )
        if cut_off_work:
            trimmed.append(Region(first_unit=first, last_unit=region.last_unit))
    return trimmed


@dataclass(frozen=True, slots=True)
class MutationHazard:
    producer_unit: int
    user_units: tuple[int, ...]
    mutator_units: tuple[int, ...]


def mutation_hazards(profile: StepTrace) -> list[MutationHazard]:
    """Storages some unit writes into in place after they were made."""
    return [
        MutationHazard(s.producer_unit, s.user_units, s.mutator_units)
        for s in profile.storages
        if any(m > s.producer_unit for m in s.mutator_units)
    ]


def is_unsafe(region: Region, hazards: list[MutationHazard]) -> bool:
    """Would checkpointing ``region`` see an in-place write into one of its inputs?

    ``torch.utils.checkpoint`` saves a region's inputs and checks, when it recomputes, that they were not modified.
    An input is a storage made before the region and read inside it; a write into it inside the region, or after
    the region in forward, makes the recomputation read a changed value (autograd raises).
    """
    for hazard in hazards:
        if hazard.producer_unit >= region.first_unit:
            continue
        reads_inside = any(region.first_unit <= u <= region.last_unit for u in hazard.user_units)
        writes_inside = any(region.first_unit <= m <= region.last_unit for m in hazard.mutator_units)
        writes_after = any(m > region.last_unit for m in hazard.mutator_units)
        if writes_inside or (reads_inside and writes_after):
            return True
    return False
