"""Baseline checkpointing policies, each returned as regions and scored / rewritten like a solved plan.

Every policy here is what a person would do by hand or what another library does, expressed as
``autockpt.types.Region`` ranges on the captured graph so that the simulator predicts it and the rewriter runs it
exactly as it runs autockpt's own plans:

* ``none`` / ``speed_optimized``: nothing is checkpointed.
* ``every_<N>``: checkpoint every N-th *block* (blocks 0, N, 2N, ...), as Hugging Face
  ``gradient_checkpointing_enable`` (N = 1), torchtitan ``selective_ac_option="N"`` and DeepSpeed/Megatron
  per-layer checkpointing do.
* ``sqrt_n``: Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": the linearised graph of n units is
  cut into about sqrt(n) segments of equal saved-for-backward bytes, each cut moved (within its slice) to the point
  where the fewest bytes cross (the articulation-point condition of the paper); every segment is checkpointed.
* ``memory_efficient``: everything recomputable: every block and every stretch of units before, between and after
  the blocks is a region, so every unit is recomputed (the solver's elementary segments when no block is found).
* ``for_transformers``: the attention and MLP sub-blocks of every block (a block's direct children that have
  children of their own; when a block has fewer than two, the block is split in two at its narrowest interior cut,
  which is the residual stream between attention and MLP in a pre-norm transformer block).
* ``for_convnets``: the residual blocks: the innermost repeated (indexed) modules that have children; blocks when
  there are none.

*Blocks* are found from the graph alone, never from model-specific names: the outermost module paths that end in an
index (children of an ``nn.ModuleList`` / ``nn.Sequential``, e.g. ``transformer.h.3``, ``encoder.block.1``,
``down_blocks.0``). Indexed children that are single layers (an ``nn.Sequential`` of Linear, GELU, Linear, ...) are
grouped by the period of their classes (Linear+GELU) when the pattern repeats at least twice.

Regions that ``torch.utils.checkpoint`` could not run (an in-place write into one of the region's inputs, the
mutation-hazard filter of ``candidates.py``) are split at the offending unit into the longest safe runs; on
module-level captures, where a region must be exactly one submodule call, they are dropped. ``BaselineRegions.notes``
says what was split or dropped.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from autockpt.core.solve.base import SeedPlan
from autockpt.core.solve.candidates import candidate_regions, equal_saved_segments, is_unsafe, mutation_hazards
from autockpt.core.structure import crossing_bytes
from autockpt.types import CaptureKind, Graph, Region, StepTrace

logger = logging.getLogger(__name__)


class BaselinePolicy(str, Enum):
    """The baseline policy families (``every_n`` takes N from the strategy name, e.g. ``every_2``)."""

    NONE = "none"
    EVERY_N = "every_n"
    SQRT_N = "sqrt_n"
    SPEED_OPTIMIZED = "speed_optimized"
    MEMORY_EFFICIENT = "memory_efficient"
    FOR_TRANSFORMERS = "for_transformers"
    FOR_CONVNETS = "for_convnets"


#: The strategies the sweep runs by default, in the order they are reported.
BASELINE_STRATEGIES: tuple[str, ...] = (
    "none", "every_1", "every_2", "every_4", "sqrt_n", "memory_efficient", "for_transformers", "for_convnets",
    "speed_optimized",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    """One repeated block of the model: a module path (or a group of sibling paths) and the units it covers."""

    paths: tuple[str, ...]  # one module path, or consecutive single-layer siblings grouped by their period
    first_unit: int
    last_unit: int

    @property
    def name(self) -> str:
        return self.paths[0] if len(self.paths) == 1 else f"{self.paths[0]}..{self.paths[-1].rsplit('.', 1)[-1]}"

    @property
    def region(self) -> Region:
        return Region(first_unit=self.first_unit, last_unit=self.last_unit)


@dataclass(frozen=True, kw_only=True, slots=True)
class BaselineRegions:
    """What a baseline policy checkpoints on one graph."""

    strategy: str
    policy: BaselinePolicy
    regions: tuple[Region, ...]
    available: bool = True  # False: the policy cannot be expressed on this graph (``notes`` says why)
    notes: tuple[str, ...] = ()


def parse_strategy(strategy: str) -> tuple[BaselinePolicy, int]:
    """``"every_2"`` -> (EVERY_N, 2); ``"sqrt_n"`` -> (SQRT_N, 0)."""
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be a string such as 'every_2' or 'sqrt_n', got {type(strategy).__name__}")
    match = re.fullmatch(r"every_(\d+)", strategy)
    if match:
        n = int(match.group(1))
        if n < 1:
            raise ValueError(f"every_N needs N >= 1, got {strategy!r}")
        return BaselinePolicy.EVERY_N, n
    try:
        policy = BaselinePolicy(strategy)
    except ValueError:
        raise ValueError(
            f"unknown baseline strategy {strategy!r}; choose one of {', '.join(BASELINE_STRATEGIES)} "
            "(every_N for any N >= 1)"
        ) from None
    if policy is BaselinePolicy.EVERY_N:
        raise ValueError("give every_N with its N, e.g. 'every_2'")
    return policy, 0


def baseline_regions(graph: Graph, profile: StepTrace, strategy: str) -> BaselineRegions:
    """The regions ``strategy`` checkpoints on ``graph`` (made safe for ``torch.utils.checkpoint``)."""
    policy, n = parse_strategy(strategy)
    if len(profile.units) != len(graph.units):
        raise ValueError(f"profile has {len(profile.units)} units but the graph {len(graph.units)}: not the same capture")
    notes: list[str] = []
    if policy in (BaselinePolicy.NONE, BaselinePolicy.SPEED_OPTIMIZED):
        return BaselineRegions(strategy=strategy, policy=policy, regions=())
    if policy is BaselinePolicy.SQRT_N and graph.kind is CaptureKind.MODULE:
        return BaselineRegions(
            strategy=strategy, policy=policy, regions=(), available=False,
            notes=(("not available: module-level capture checkpoints whole submodule calls only, so segments of "
                    "sqrt(n) units cannot be expressed"),),
        )
    if policy is BaselinePolicy.EVERY_N:
        blocks = find_blocks(graph)
        if not blocks:
            return _unavailable(strategy, policy, "no repeated blocks (indexed submodules) found in the graph")
        raw = [b.region for i, b in enumerate(blocks) if i % n == 0]
        notes.append(f"{len(raw)} of {len(blocks)} blocks ({blocks[0].name}, ...)")
    elif policy is BaselinePolicy.SQRT_N:
        raw = sqrt_n_segments(profile)
        notes.append(f"{len(raw)} segments for {len(profile.units)} units")
    elif policy is BaselinePolicy.MEMORY_EFFICIENT:
        raw, how = _all_recomputable(graph, profile)
        notes.append(how)
    elif policy is BaselinePolicy.FOR_TRANSFORMERS:
        blocks = find_blocks(graph)
        if not blocks:
            return _unavailable(strategy, policy, "no repeated blocks (indexed submodules) found in the graph")
        raw, how = _sub_blocks(graph, profile, blocks)
        notes.append(how)
    else:  # FOR_CONVNETS
        residual = _innermost_indexed_blocks(graph)
        if residual:
            raw = [b.region for b in residual]
            notes.append(f"{len(raw)} innermost repeated modules ({residual[0].name}, ...)")
        else:
            blocks = find_blocks(graph)
            if not blocks:
                return _unavailable(strategy, policy, "no repeated blocks (indexed submodules) found in the graph")
            raw = [b.region for b in blocks]
            notes.append(f"no indexed module with children: the {len(raw)} blocks instead")
    regions, safety_notes = make_safe(graph, profile, raw)
    notes += safety_notes
    return BaselineRegions(strategy=strategy, policy=policy, regions=tuple(regions), notes=tuple(notes))


def baseline_seed_plans(graph: Graph, profile: StepTrace) -> list[SeedPlan]:
    """Every available policy's regions, handed to the solver so that its plans are never worse than a baseline's."""
    seeds = []
    for strategy in BASELINE_STRATEGIES:
        chosen = baseline_regions(graph, profile, strategy)
        if chosen.available and chosen.regions:
            seeds.append(SeedPlan(strategy, chosen.regions))
    return seeds


# ------------------------------------------------------------------------------------------------ blocks


def find_blocks(graph: Graph) -> tuple[Block, ...]:
    """The model's repeated blocks, in execution order, found from the captured graph's module paths."""
    spans = _unit_spans(graph)
    paths = set(spans)
    has_children = _parents(paths)
    outermost = [p for p in paths if _is_indexed(p) and not any(_is_indexed(a) for a in _ancestors(p))]
    by_container: dict[str, list[str]] = {}
    for path in outermost:
        by_container.setdefault(_container(path), []).append(path)
    blocks: list[Block] = []
    for children in by_container.values():
        children.sort(key=lambda p: spans[p][0])
        if any(c in has_children for c in children):
            blocks += [Block(paths=(c,), first_unit=spans[c][0], last_unit=spans[c][1]) for c in children]
            continue
        groups = _periodic_groups(graph, children)
        for group in groups:
            first = min(spans[p][0] for p in group)
            last = max(spans[p][1] for p in group)
            if graph.kind is CaptureKind.MODULE and len(group) > 1:
                continue  # not one submodule call: cannot be checkpointed at module level
            blocks.append(Block(paths=tuple(group), first_unit=first, last_unit=last))
    return _non_overlapping(blocks)


def _innermost_indexed_blocks(graph: Graph) -> tuple[Block, ...]:
    """Indexed modules with children and no indexed descendant with children (e.g. residual blocks)."""
    spans = _unit_spans(graph)
    has_children = _parents(set(spans))
    candidates = [p for p in spans if _is_indexed(p) and p in has_children]
    innermost = [
        p for p in candidates if not any(q != p and q.startswith(p + ".") for q in candidates)
    ]
    blocks = [Block(paths=(p,), first_unit=spans[p][0], last_unit=spans[p][1]) for p in innermost]
    return _non_overlapping(blocks)


def _sub_blocks(graph: Graph, profile: StepTrace, blocks: Sequence[Block]) -> tuple[list[Region], str]:
    spans = _unit_spans(graph)
    has_children = _parents(set(spans))
    crossing = crossing_bytes(profile)
    regions: list[Region] = []
    split = 0
    for block in blocks:
        children = sorted(
            (p for p in spans if p in has_children and any(_parent(p) == owner for owner in block.paths)),
            key=lambda p: spans[p][0],
        )
        if len(children) >= 2:
            regions += [Region(first_unit=spans[c][0], last_unit=spans[c][1]) for c in children]
            continue
        cut = _narrowest_cut(crossing, block.first_unit, block.last_unit, graph.kind)
        if cut is None:
            regions.append(block.region)
            continue
        split += 1
        regions += [Region(first_unit=block.first_unit, last_unit=cut), Region(first_unit=cut + 1, last_unit=block.last_unit)]
    how = f"sub-blocks of {len(blocks)} blocks"
    if split:
        how += f" ({split} blocks without two sub-modules split at their narrowest interior cut)"
    return _drop_overlaps(regions), how


def _narrowest_cut(crossing: list[int], first: int, last: int, kind: CaptureKind) -> int | None:
    """The cut after unit p, p in the middle half of first..last, where the fewest bytes cross."""
    if kind is CaptureKind.MODULE or last - first < 3:
        return None
    quarter = (last - first) // 4
    window = range(first + quarter, last - quarter)
    window = [p for p in window if p < len(crossing)]
    if not window:
        return None
    middle = (first + last) / 2
    return min(window, key=lambda p: (crossing[p], abs(p - middle)))


def _periodic_groups(graph: Graph, children: list[str]) -> list[list[str]]:
    """Single-layer siblings grouped by the shortest period of their classes that repeats at least twice."""
    kinds = [_module_class(graph, c) for c in children]
    best: tuple[int, int, int] | None = None  # (coverage, -period, -offset): most covered, shortest, earliest
    for period in range(1, len(kinds) // 2 + 1):
        for offset in range(period):
            pattern = kinds[offset : offset + period]
            repeats = 0
            while kinds[offset + repeats * period : offset + (repeats + 1) * period] == pattern:
                repeats += 1
            if repeats >= 2:
                candidate = (repeats * period, -period, -offset)
                best = candidate if best is None or candidate > best else best
    if best is None:
        return []
    coverage, negative_period, negative_offset = best
    period, offset = -negative_period, -negative_offset
    return [children[i : i + period] for i in range(offset, offset + coverage, period)]


def _module_class(graph: Graph, path: str) -> str:
    try:
        return type(graph.model.get_submodule(path)).__qualname__
    except AttributeError:
        return path.rsplit(".", 1)[0]


# ------------------------------------------------------------------------------------------------ segments


def sqrt_n_segments(profile: StepTrace) -> list[Region]:
    """Chen et al. 2016: about sqrt(n) segments of equal saved bytes, each cut where the fewest bytes cross (the
    solver's own segmentation, with sqrt(n) segments)."""
    num_units = len(profile.units)
    if num_units == 0:
        return []
    return equal_saved_segments(profile, max(1, round(math.sqrt(num_units))))


def _all_recomputable(graph: Graph, profile: StepTrace) -> tuple[list[Region], str]:
    """Every block, and every stretch before, between and after the blocks, as its own region."""
    blocks = find_blocks(graph)
    if graph.kind is CaptureKind.MODULE:
        return [b.region for b in blocks], f"all {len(blocks)} blocks (module-level capture: nothing between them)"
    if not blocks:
        segments, _ = candidate_regions(graph, profile)
        return list(segments), f"no blocks: the solver's {len(segments)} elementary segments"
    regions: list[Region] = []
    start = 0
    for block in blocks:
        if block.first_unit > start:
            regions.append(Region(first_unit=start, last_unit=block.first_unit - 1))
        regions.append(block.region)
        start = block.last_unit + 1
    if start < len(graph.units):
        regions.append(Region(first_unit=start, last_unit=len(graph.units) - 1))
    return regions, f"{len(blocks)} blocks and the {len(regions) - len(blocks)} stretches around them"


# ------------------------------------------------------------------------------------------------ safety


def make_safe(graph: Graph, profile: StepTrace, regions: Iterable[Region]) -> tuple[list[Region], list[str]]:
    """Split (fx/export) or drop (module level) regions the mutation-hazard filter of ``candidates.py`` rejects."""
    hazards = mutation_hazards(profile)
    safe: list[Region] = []
    split = dropped = dropped_units = 0
    for region in regions:
        if not is_unsafe(region, hazards):
            safe.append(region)
            continue
        if graph.kind is CaptureKind.MODULE:
            dropped += 1
            continue
        pieces = _safe_runs(region, hazards)
        split += 1
        dropped_units += (region.last_unit - region.first_unit + 1) - sum(p.last_unit - p.first_unit + 1 for p in pieces)
        safe += pieces
    notes = []
    if split:
        notes.append(
            f"{split} regions wrote in place into one of their inputs and were split into safe runs "
            f"({dropped_units} units left out)"
        )
    if dropped:
        notes.append(f"{dropped} regions wrote in place into one of their inputs and were dropped")
    return safe, notes


def _safe_runs(region: Region, hazards: list) -> list[Region]:
    """Greedy: grow a run unit by unit while it stays safe; a unit unsafe on its own is left out."""
    runs: list[Region] = []
    start: int | None = None
    for unit in range(region.first_unit, region.last_unit + 1):
        if start is not None and not is_unsafe(Region(first_unit=start, last_unit=unit), hazards):
            continue
        if start is not None:
            runs.append(Region(first_unit=start, last_unit=unit - 1))
        start = unit if not is_unsafe(Region(first_unit=unit, last_unit=unit), hazards) else None
    if start is not None:
        runs.append(Region(first_unit=start, last_unit=region.last_unit))
    return runs


# ------------------------------------------------------------------------------------------------ helpers


def _unavailable(strategy: str, policy: BaselinePolicy, reason: str) -> BaselineRegions:
    return BaselineRegions(strategy=strategy, policy=policy, regions=(), available=False, notes=(f"not available: {reason}",))


def _unit_spans(graph: Graph) -> dict[str, tuple[int, int]]:
    """Module path -> (first unit, last unit) of everything that path (or a submodule of it) runs.

    fx/export: from the units' module paths, every ancestor path included. Module level: the submodule calls
    (a module called more than once is left out: it cannot be one checkpointed call).
    """
    if graph.kind is CaptureKind.MODULE:
        calls: dict[str, list[tuple[int, int]]] = {}
        for span in graph.module_spans:
            if span.path:
                calls.setdefault(span.path, []).append((span.first_unit, span.last_unit))
        return {path: found[0] for path, found in calls.items() if len(found) == 1 and found[0][1] < len(graph.units)}
    spans: dict[str, tuple[int, int]] = {}
    for unit in graph.units:
        if not unit.module_path:
            continue
        for path in (unit.module_path, *_ancestors(unit.module_path)):
            first, last = spans.get(path, (unit.index, unit.index))
            spans[path] = (min(first, unit.index), max(last, unit.index))
    return spans


def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _parents(paths: set[str]) -> set[str]:
    return {_parent(p) for p in paths if "." in p}


def _is_indexed(path: str) -> bool:
    return path.rsplit(".", 1)[-1].isdigit()


def _container(path: str) -> str:
    return _parent(path)


def _non_overlapping(blocks: Iterable[Block]) -> tuple[Block, ...]:
    kept: list[Block] = []
    for block in sorted(blocks, key=lambda b: (b.first_unit, -b.last_unit)):
        if kept and block.first_unit <= kept[-1].last_unit:
            logger.debug("block %s overlaps %s in unit order; left out", block.name, kept[-1].name)
            continue
        kept.append(block)
    return tuple(kept)


def _drop_overlaps(regions: Iterable[Region]) -> list[Region]:
    kept: list[Region] = []
    for region in sorted(regions, key=lambda r: (r.first_unit, -r.last_unit)):
        if kept and region.first_unit <= kept[-1].last_unit:
            continue
        kept.append(region)
    return kept
