"""Prepare: (StepTrace, CostModel, action, candidate regions) -> Problem. Scores what every budget's program shares.

Each candidate region is scored alone by the simulator: ``gain_I(e)`` is how many bytes fewer (or, during its
recomputation, more) the step holds at event e when only I runs under the action, and ``cost_I`` its added
milliseconds. Backward events, where the peak and the recomputation bursts are, each get a memory row of their own;
forward events are grouped per segment and each group is charged its largest baseline bytes minus the smallest gain
in it, which over-estimates memory.

*Seed plans* (the baseline policies: every_n, sqrt_n, presets) are scored by the simulator too; their regions join
the candidates, and a seed plan under the budget that adds less step time than the program's answer is returned
instead (``default.py``), so a solved plan is never worse than a baseline at the same budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from autockpt.core.solve.base import Problem, ScoredCandidate, Scorer, Seed, SeedPlan
from autockpt.core.solve.blocks import prepare_blocks
from autockpt.core.structure import RepeatedBlocks
from autockpt.types import Action, CostModel, Phase, Region, StepTrace, Timeline


def prepare(
    trace: StepTrace,
    costs: CostModel,
    action: Action,
    segments: Sequence[Region],
    candidates: Sequence[Region],
    seed_plans: Sequence[SeedPlan] = (),
    structure: RepeatedBlocks | None = None,
) -> Problem:
    """Score what every budget's program shares. With ``structure`` (repeated blocks found in the graph), each
    distinct block is also scored once for the block program, which then solves every budget it can reach; the flat
    program still finds the memory floor (its candidates may cross block boundaries, which can reach lower)."""
    scorer = Scorer(trace, costs, action)
    score = scorer.simulate
    baseline = score(())
    seeds = [Seed(seed.name, seed.regions, score(seed.regions)) for seed in seed_plans if seed.regions]
    known = set(candidates)
    extra = sorted({r for seed in seeds for r in seed.regions if r not in known}, key=lambda r: (r.first_unit, r.last_unit))
    blocks = _event_blocks(trace, segments)
    scored, lowest_single = score_candidates(score, [*candidates, *extra], baseline, blocks)
    if lowest_single is not None:
        # regions interact (a recomputation burst can sit on another region's gain), so the programs, which add
        # gains up, can miss that one region alone lowers the peak; scoring simulated it anyway
        seeds.append(lowest_single)
    return Problem(
        scorer=scorer,
        baseline=baseline,
        scored=scored,
        block_base=[max(baseline.event_bytes[e] for e in block) for block in blocks],
        block_of_event=_block_of_event(blocks, len(trace.events)),
        blocks=prepare_blocks(scorer, structure, [*candidates, *extra], baseline) if structure else None,
        seeds=seeds,
    )


def _event_blocks(trace: StepTrace, segments: Sequence[Region]) -> list[list[int]]:
    """Group events for the memory constraints.

    Backward events, where the peak and the recomputation bursts are, each get a constraint of their own; forward
    events are grouped per segment (forward memory only falls when something is checkpointed); events outside the
    graph (loss, autograd start) stand alone.
    """
    segment_of = {}
    for s, segment in enumerate(segments):
        for unit in range(segment.first_unit, segment.last_unit + 1):
            segment_of[unit] = s
    grouped: dict[int, list[int]] = {}
    singles: list[list[int]] = []
    for event in trace.events:
        if event.unit < 0 or event.phase is Phase.BACKWARD:
            singles.append([event.index])
        else:
            grouped.setdefault(segment_of[event.unit], []).append(event.index)
    return list(grouped.values()) + singles


def _block_of_event(blocks: list[list[int]], num_events: int) -> list[int]:
    block_of = [0] * num_events
    for index, block in enumerate(blocks):
        for event in block:
            block_of[event] = index
    return block_of


def score_candidates(
    score: Callable[[Sequence[Region]], Timeline], candidates: Sequence[Region], baseline: Timeline, blocks: list[list[int]]
) -> tuple[list[ScoredCandidate], Seed | None]:
    """The candidates that free anything, with their gains per event block; and the one region whose checkpointing
    alone gives the lowest simulated peak (None when no single region lowers it)."""
    scored = []
    lowest_single: Seed | None = None
    # events in block order, and where each block starts in it: a block's gain is a minimum over a slice
    order = np.fromiter((e for block in blocks for e in block), dtype=np.int64)
    starts = np.cumsum([0] + [len(block) for block in blocks[:-1]], dtype=np.int64)
    baseline_bytes = np.asarray(baseline.event_bytes, dtype=np.int64)
    for region in candidates:
        alone = score((region,))
        if alone.peak_bytes < (lowest_single.timeline if lowest_single else baseline).peak_bytes:
            lowest_single = Seed("single region", (region,), alone)
        gains_by_event = baseline_bytes - np.asarray(alone.event_bytes, dtype=np.int64)
        if gains_by_event.max() <= 0:
            continue  # never frees anything
        block_gains = np.minimum.reduceat(gains_by_event[order], starts)
        (nonzero,) = np.nonzero(block_gains)
        gains = dict(zip(nonzero.tolist(), block_gains[nonzero].tolist()))
        scored.append(ScoredCandidate(region, alone.overhead_ms, gains, alone.host_pool_bytes))
    return scored, lowest_single
