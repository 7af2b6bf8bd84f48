"""Block program: solve each distinct repeated block once, then split the budget across its instances.

The flat program (``milp.py``) gives every candidate region of every layer its own variable and every backward event
its own memory row; with a dozen identical layers that is hundreds of interchangeable variables, and the solver
spends its time proving that permutations of one answer are no better. Here:

1. **Inner problem, once per family of identical blocks.** The candidate regions inside one instance (the middle
   one, the *representative*) are simulated alone there. Every set of non-overlapping such regions is a *block
   plan*; its effect is summarised by its recompute milliseconds, the bytes it stops holding between the block's
   forward and its backward (*retained gain*), and the worst bytes during the block's own forward and backward
   (*need*, one per instance because the bytes held around each instance differ). Block plans another one beats on
   all three are dropped: a menu of a few dozen.
2. **Outer problem.** One choice from the menu per instance (or one of the *other* regions: outside every block,
   or whole runs of consecutive instances, as every_n does). While instance k runs forward or backward, the
   instances before it still hold their activations and the ones after hold none, so the worst bytes in k's window
   are ``need[k, plan_k] - sum of retained gains of the earlier instances``: one memory row per instance, exact
   when gains add up. Events outside every block get a row each.

As in the flat program, disjoint regions are assumed to act independently; the simulator scores the assembled plan
on the whole timeline, and ``solve_prepared`` moves the effective budget until it fits.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence

import numpy as np
import pulp

from autockpt.core.solve.base import Problem, ProgramAnswer, Scorer, SolverOptions
from autockpt.core.solve.block_chain import overlaps_any, prepare_chain, retained_gain, solve_block_chain
from autockpt.core.solve.block_types import BlockInstance, BlockPlan, BlockProblem, OtherRegion
from autockpt.core.solve.candidates import safe_regions
from autockpt.core.solve.pulp_tools import (
    add_no_good_cut,
    add_no_overlap,
    has_solution,
    is_proven_optimal,
    solve_and_write,
)
from autockpt.core.structure import RepeatedBlocks
from autockpt.types import Phase, PlanStatus, Region, SolverStats, Timeline
from autockpt.units import GB

logger = logging.getLogger(__name__)

MAX_BLOCK_PLANS = 20_000  # disjoint region sets enumerated per family; more than this: solve flat
MAX_INSTANCES_PER_RUN = 12  # longest run of whole instances offered as one region (every_n with n up to this)
_DOMINANCE_CHUNK = 256  # menu plans compared with the kept ones at once (bounds the comparison's memory)


def prepare_blocks(
    scorer: Scorer, structure: RepeatedBlocks, candidates: Sequence[Region], baseline: Timeline
) -> BlockProblem | None:
    """Score each family's block once and build its menu; None when no family is usable (solve flat instead)."""
    profile = scorer.trace
    base = np.asarray(baseline.event_bytes, dtype=np.int64)
    units_of_event = np.array([e.unit for e in profile.events])
    backward = np.array([e.phase is Phase.BACKWARD for e in profile.events])
    instances: list[BlockInstance] = []
    menus: list[list[BlockPlan]] = []
    for family in structure.families:
        found = _family_instances(family.instances, len(menus), units_of_event, backward)
        if len(found) < 2:
            continue
        menu = _menu(scorer, found, candidates, base)
        if menu is None:
            continue
        instances += found
        menus.append(menu)
    if not instances:
        return None
    instances.sort(key=lambda i: i.region.first_unit)
    need = [
        np.array([(base[i.window] - plan.window_gains).max() for plan in menus[i.family]], dtype=np.int64)
        for i in instances
    ]
    forward_ms = np.array([u.forward_ms for u in profile.units])
    # priced at each instance with the times of the units it re-runs, as the simulator that scores the assembled plan
    # does (the profile times one instance per family, but a profile timed everywhere has per-instance times), plus
    # the checkpoint machinery of its regions
    cost = [
        np.array([
            forward_ms[i.region.first_unit + np.array(plan.rerun_offsets, dtype=np.int64)].sum()
            + scorer.machinery_ms([Region(first_unit=i.region.first_unit + a, last_unit=i.region.first_unit + b)
                                   for a, b in plan.relative])
            for plan in menus[i.family]
        ])
        for i in instances
    ]
    in_window = np.zeros(len(base), dtype=bool)
    for instance in instances:
        in_window[instance.window] = True
    others = _other_regions(scorer, instances, candidates, base)
    problem = BlockProblem(
        instances=instances, menus=menus, need_bytes=need, cost_ms=cost, others=others, base_bytes=base,
        outside_events=np.flatnonzero(~in_window),
    )
    problem.chain = prepare_chain(problem)
    logger.debug(
        "block program: %d instances of %d families, menus %s, %d other regions",
        len(instances), len(menus), [len(m) for m in menus], len(others),
    )
    return problem


def _family_instances(
    regions: Sequence[Region], family: int, units_of_event: np.ndarray, backward: np.ndarray
) -> list[BlockInstance]:
    """The instances whose event windows line up with the representative's (same phases, same unit offsets)."""
    def window_of(region: Region) -> np.ndarray:
        return np.flatnonzero((units_of_event >= region.first_unit) & (units_of_event <= region.last_unit))

    representative = regions[len(regions) // 2]
    rep_window = window_of(representative)
    rep_key = (units_of_event[rep_window] - representative.first_unit, backward[rep_window])
    found = []
    for region in regions:
        window = window_of(region)
        same = len(window) == len(rep_window) and np.array_equal(
            units_of_event[window] - region.first_unit, rep_key[0]
        ) and np.array_equal(backward[window], rep_key[1])
        forward_events, backward_events = window[~backward[window]], window[backward[window]]
        if same and len(forward_events) and len(backward_events) and forward_events.max() < backward_events.min():
            found.append(BlockInstance(region, family, window, int(forward_events.max()), int(backward_events.min())))
    return found


def _menu(scorer: Scorer, instances: list[BlockInstance], candidates: Sequence[Region], base: np.ndarray) -> list[BlockPlan] | None:
    """The block plans worth offering for one family, scored at its representative instance."""
    profile = scorer.trace
    block_units = instances[0].region.last_unit - instances[0].region.first_unit + 1
    relative = {(0, block_units - 1)}  # the whole block, as every_1 checkpoints it
    for instance in instances:
        start, end = instance.region.first_unit, instance.region.last_unit
        relative |= {(c.first_unit - start, c.last_unit - start) for c in candidates if start <= c.first_unit and c.last_unit <= end}
    # a region must be safe and save something in every instance, since each may take it
    for instance in instances:
        start = instance.region.first_unit
        regions = [Region(first_unit=start + a, last_unit=start + b) for a, b in relative]
        relative = {(r.first_unit - start, r.last_unit - start) for r in safe_regions(profile, regions)}
    representative = instances[len(instances) // 2]
    start = representative.region.first_unit
    singles: list[BlockPlan] = []
    for a, b in sorted(relative):
        alone, gains = _alone(scorer, Region(first_unit=start + a, last_unit=start + b), base)
        if gains.max() <= 0:
            continue  # frees nothing anywhere
        rerun = tuple(u - start for u in alone.rerun_units)
        singles.append(BlockPlan(
            ((a, b),), rerun, alone.overhead_ms, retained_gain(gains, representative), gains[representative.window]
        ))
    plans = _disjoint_combinations(singles, len(representative.window))
    if plans is None:
        logger.debug("a block of %d units has over %d plans; solving flat", block_units, MAX_BLOCK_PLANS)
        return None
    return _undominated(plans, [base[i.window] for i in instances])


def _alone(scorer: Scorer, region: Region, base: np.ndarray) -> tuple[Timeline, np.ndarray]:
    """``region`` checkpointed alone: its timeline, and the bytes it saves at every event (negative: costs)."""
    alone = scorer.simulate((region,))
    return alone, base - np.asarray(alone.event_bytes, dtype=np.int64)


def _disjoint_combinations(singles: list[BlockPlan], window_length: int) -> list[BlockPlan] | None:
    """Every set of non-overlapping single regions (the empty set first), with costs and gains added up."""
    empty = BlockPlan((), (), 0.0, 0, np.zeros(window_length, dtype=np.int64))
    plans = [empty]

    def extend(plan: BlockPlan, after_unit: int, first_index: int) -> bool:
        for index in range(first_index, len(singles)):
            single = singles[index]
            if single.relative[0][0] <= after_unit:
                continue
            combined = BlockPlan(
                plan.relative + single.relative, plan.rerun_offsets + single.rerun_offsets, plan.cost_ms + single.cost_ms,
                plan.retained_gain_bytes + single.retained_gain_bytes, plan.window_gains + single.window_gains,
            )
            plans.append(combined)
            if len(plans) > MAX_BLOCK_PLANS or not extend(combined, single.relative[0][1], index + 1):
                return False
        return True

    return plans if extend(empty, -1, 0) else None


def _undominated(plans: list[BlockPlan], window_bases: list[np.ndarray]) -> list[BlockPlan]:
    """Drop each plan that another beats or equals on added time, retained gain and need at every instance."""
    need = np.array([[(b - p.window_gains).max() for b in window_bases] for p in plans], dtype=np.int64)
    cost = np.array([p.cost_ms for p in plans])
    retained = np.array([p.retained_gain_bytes for p in plans])
    kept = [0]  # the empty plan is always on the menu
    order = sorted(range(1, len(plans)), key=lambda i: (cost[i], -retained[i]))

    def beaten(by: list[int], these: list[int]) -> np.ndarray:
        """Per plan of ``these``, whether a plan of ``by`` beats or equals it (all pairs at once)."""
        a, b = np.array(by), np.array(these)
        return ((cost[a][:, None] <= cost[b][None, :]) & (retained[a][:, None] >= retained[b][None, :])
                & (need[a][:, None, :] <= need[b][None, :, :]).all(axis=2)).any(axis=0)

    # in order, a chunk at a time: the plans kept before a chunk rule out most of it at once (menus of up to 17,216
    # plans; one at a time, in Python, was most of the block solver's time); each plan left is then compared with the
    # plans of its chunk kept before it, as the order requires
    for start in range(0, len(order), _DOMINANCE_CHUNK):
        chunk = order[start : start + _DOMINANCE_CHUNK]
        before = len(kept)
        for i, out in zip(chunk, beaten(kept, chunk)):
            if not out and not (len(kept) > before and beaten(kept[before:], [i])[0]):
                kept.append(i)
    return [plans[i] for i in kept]


def _other_regions(
    scorer: Scorer, instances: list[BlockInstance], candidates: Sequence[Region], base: np.ndarray
) -> list[OtherRegion]:
    """Regions outside every instance (embedding, head), and runs of whole consecutive instances of one family."""
    regions = [c for c in candidates if not overlaps_any(c, instances)]
    by_family: dict[int, list[BlockInstance]] = {}
    for instance in instances:
        by_family.setdefault(instance.family, []).append(instance)
    for members in by_family.values():
        for a, b in itertools.combinations(range(len(members) + 1), 2):
            run = members[a:b]
            contiguous = all(x.region.last_unit + 1 == y.region.first_unit for x, y in itertools.pairwise(run))
            if 2 <= len(run) <= MAX_INSTANCES_PER_RUN and contiguous:
                regions.append(Region(first_unit=run[0].region.first_unit, last_unit=run[-1].region.last_unit))
    others = []
    for region in safe_regions(scorer.trace, list(dict.fromkeys(regions))):
        alone, gains = _alone(scorer, region, base)
        if gains.max() > 0:
            others.append(OtherRegion(region, alone.overhead_ms, gains))
    return others


def build_block_program(
    problem: BlockProblem, budget: float | None, excluded: Sequence[tuple[Region, ...]] = ()
) -> tuple[pulp.LpProblem, Callable[[], tuple[Region, ...]]]:
    """The outer program at ``budget`` (None: minimise the peak) and a function reading the chosen regions."""
    prob = pulp.LpProblem("autockpt_blocks_floor" if budget is None else "autockpt_blocks_plan", pulp.LpMinimize)
    instances, menus, others = problem.instances, problem.menus, problem.others
    # x_k_m: 1 if instance k runs plan m of its family's menu (m >= 1; none chosen: the empty plan)
    x = [
        [pulp.LpVariable(f"x_{k}_{m}", cat=pulp.LpBinary) for m in range(1, len(menus[i.family]))]
        for k, i in enumerate(instances)
    ]
    # y_c: 1 if other region c (outside the blocks, or a run of whole instances) is checkpointed
    y = [pulp.LpVariable(f"y_{c}", cat=pulp.LpBinary) for c in range(len(others))]
    peak = None
    if budget is None:
        peak = pulp.LpVariable("peak_gb", lowBound=0)  # P: the peak to minimise, in GB so coefficients stay scaled
        prob += peak
    else:
        prob += pulp.LpAffineExpression(
            [(x[k][m - 1], problem.cost_ms[k][m]) for k, i in enumerate(instances) for m in range(1, len(menus[i.family]))]
            + [(y[c], o.cost_ms) for c, o in enumerate(others)]
        )

    overlapping = [[c for c, o in enumerate(others) if o.region.overlaps(i.region)] for i in instances]
    # [Constraint] one plan per instance, and none where an other region covers it
    for k in range(len(instances)):
        members = x[k] + [y[c] for c in overlapping[k]]
        if len(members) > 1:
            prob += pulp.lpSum(members) <= 1, f"one_plan_instance_{k}"
    # [Constraint] other regions do not overlap each other
    add_no_overlap(prob, [o.region for o in others], y)
    # [Constraint] not a set already simulated over the budget
    everything = [v for row in x for v in row] + y
    for n, regions in enumerate(excluded):
        chosen = _variables_for(problem, regions, x, y)
        if chosen is not None:
            add_no_good_cut(prob, f"not_plan_{n}", chosen, everything)

    rows = _memory_rows(problem, x, y, overlapping)
    variables = {v.name: v for row in x for v in row} | {v.name: v for v in y}
    for r, (key, constant) in enumerate(rows.items()):
        worst = constant + sum(c for _, c in key if c > 0)
        if budget is not None and worst <= budget:
            continue  # holds whatever is chosen
        expression = pulp.LpAffineExpression([(variables[name], c) for name, c in key], constant=constant)
        if peak is not None:
            expression.addterm(peak, -GB)
        prob += pulp.LpConstraint(expression, pulp.LpConstraintLE, f"memory_row_{r}", budget or 0)

    def chosen_regions() -> tuple[Region, ...]:
        choice = [next((m for m, v in enumerate(row, start=1) if (v.value() or 0) > 0.5), 0) for row in x]
        return problem.regions_of(choice, [c for c, v in enumerate(y) if (v.value() or 0) > 0.5])

    return prob, chosen_regions


def _memory_rows(
    problem: BlockProblem, x: list[list[pulp.LpVariable]], y: list[pulp.LpVariable], overlapping: list[list[int]]
) -> dict[tuple, int]:
    """The memory rows of the block program, as (variable name, coefficient) terms -> constant: the worst bytes in
    each instance's window and at each event outside the blocks. Identical rows but the constant collapse to one
    (the largest constant)."""
    instances, menus, others = problem.instances, problem.menus, problem.others
    rows: dict[tuple, int] = {}

    def add_row(terms: list[tuple[pulp.LpVariable, int]], constant: int) -> None:
        key = tuple(sorted((v.name, c) for v, c in terms if c != 0))
        rows[key] = max(rows.get(key, constant), constant)

    retained = [[p.retained_gain_bytes for p in menus[i.family][1:]] for i in instances]
    for k, instance in enumerate(instances):
        # [Constraint] worst bytes in instance k's window: its plan's need, less what earlier instances do not hold
        need = problem.need_bytes[k]
        terms = [(x[k][m - 1], int(need[m] - need[0])) for m in range(1, len(need))]
        for j, earlier in enumerate(instances):
            if earlier.forward_end < instance.window[0] and earlier.backward_start > instance.window[-1]:
                terms += [(x[j][m], -int(r)) for m, r in enumerate(retained[j])]
        window_base = problem.base_bytes[instance.window]
        for c, other in enumerate(others):
            window_gains = other.gains[instance.window]
            if c in overlapping[k]:
                terms.append((y[c], int((window_base - window_gains).max() - need[0])))
            else:
                terms.append((y[c], -int(window_gains.min())))
        add_row(terms, int(need[0]))
    for event in problem.outside_events:
        # [Constraint] bytes of each event outside the blocks
        terms = []
        for j, instance in enumerate(instances):
            if instance.forward_end < event < instance.backward_start:
                terms += [(x[j][m], -int(r)) for m, r in enumerate(retained[j])]
        terms += [(y[c], -int(o.gains[event])) for c, o in enumerate(others)]
        add_row(terms, int(problem.base_bytes[event]))
    return rows


def solve_block_program(
    problem: Problem,
    budget: float | None,
    options: SolverOptions,
    solver: str,
    *,
    excluded: Sequence[tuple[Region, ...]] = (),
) -> ProgramAnswer:
    """The outer program at ``budget``: by the chain's dynamic program when it applies (milliseconds), else as a
    MILP; ``budget`` None: the lowest peak the block program reaches (the MILP). ``excluded``: region sets the answer
    must not be (the chain cannot rule a set out: it answers the same at the same budget)."""
    blocks = problem.blocks
    if blocks is None:
        raise ValueError("solve_block_program needs a problem prepared with repeated blocks (Problem.blocks)")
    if budget is not None:
        regions = solve_block_chain(blocks, int(budget))
        if regions is not NotImplemented:
            word = "Optimal Solution Found" if regions is not None else "No Solution Exists"
            stats = SolverStats(status=f"{word} (block chain)", relative_gap=0.0, variables=0, constraints=0, programs=1)
            return ProgramAnswer(regions=regions, status=PlanStatus.OPTIMAL, stats=stats)
    prob, chosen_regions = build_block_program(blocks, budget, excluded)
    stats = solve_and_write(prob, solver, options)
    if not has_solution(prob):
        return ProgramAnswer(regions=() if budget is None else None, status=PlanStatus.FEASIBLE, stats=stats)
    return ProgramAnswer(
        regions=chosen_regions(), status=PlanStatus.OPTIMAL if is_proven_optimal(prob) else PlanStatus.FEASIBLE,
        stats=stats,
    )


def _variables_for(
    problem: BlockProblem, regions: Sequence[Region], x: list[list[pulp.LpVariable]], y: list[pulp.LpVariable]
) -> list[pulp.LpVariable] | None:
    """The variables set to 1 by the plan ``regions``; None if the program cannot express it."""
    chosen: list[pulp.LpVariable] = []
    remaining = set(regions)
    for k, instance in enumerate(problem.instances):
        start = instance.region.first_unit
        inside = tuple(sorted(
            (r.first_unit - start, r.last_unit - start) for r in regions
            if instance.region.first_unit <= r.first_unit and r.last_unit <= instance.region.last_unit
        ))
        if not inside:
            continue
        menu = problem.menus[instance.family]
        item = next((m for m, plan in enumerate(menu) if plan.relative == inside), None)
        if item is None:
            return None
        chosen.append(x[k][item - 1])
        remaining -= {Region(first_unit=start + a, last_unit=start + b) for a, b in inside}
    for c, other in enumerate(problem.others):
        if other.region in remaining:
            chosen.append(y[c])
            remaining.discard(other.region)
    return None if remaining else chosen
