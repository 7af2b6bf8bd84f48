"""The block program's outer problem solved as a dynamic program over the chain of instances (``solve_block_chain``):
exact up to rounding retained gains down, in milliseconds where the MILP (``blocks.build_block_program``) takes
seconds; ``blocks.solve_block_program`` tries it first."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autockpt.core.solve.block_types import BlockInstance, BlockProblem, Chain, ChainOption
from autockpt.types import Region

STATES = 10_000  # retained-gain buckets; gains are rounded down, so rows are pessimistic by < instances / STATES of the range
MAX_OTHER_SETS = 64  # sets of regions outside the blocks tried one by one; more than this: the MILP solves it


def solve_block_chain(problem: BlockProblem, budget: int) -> tuple[Region, ...] | None | type[NotImplemented]:
    """The outer problem solved exactly (up to rounding retained gains down) by dynamic programming.

    When instance k runs, the instances before it hold their retained gains and the ones after hold nothing, so every
    memory row is a lower bound on the retained gain summed over a prefix of the chain. A dynamic program over that
    prefix sum, once per set of regions outside the blocks, finds the cheapest plan in milliseconds where the MILP
    spends seconds telling identical layers apart. Returns the regions, None if no plan meets ``budget`` in the
    model, or NotImplemented when the problem is not such a chain (the MILP then solves it).
    """
    chain = problem.chain
    if chain is None:
        return NotImplemented
    best: tuple[float, tuple[Region, ...]] | None = None
    for other_set in chain.outside_sets:
        chosen = [chain.outside[i] for i in other_set]
        found = _cheapest_chain(problem, chain.options, chosen, budget, chain.outside_prefix)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    return None if best is None else best[1]


def prepare_chain(problem: BlockProblem) -> Chain | None:
    """The chain form of the outer problem, or None when its rows are not a chain or too many outside sets."""
    outside_prefix = _prefix_of_outside_rows(problem)
    if outside_prefix is None:
        return None
    outside = [c for c, o in enumerate(problem.others) if not overlaps_any(o.region, problem.instances)]
    outside_sets = _disjoint_sets([problem.others[c].region for c in outside], MAX_OTHER_SETS)
    if outside_sets is None:
        return None
    runs = [c for c in range(len(problem.others)) if c not in outside]
    return Chain(_chain_options(problem, runs), outside_prefix, outside, outside_sets)


def _prefix_of_outside_rows(problem: BlockProblem) -> list[int] | None:
    """Per outside event, how many leading instances hold their gains there; None when the rows are not a chain
    (instance k's window must see exactly the k instances before it, every outside event a prefix of them)."""
    instances = problem.instances

    def prefix(active: list[bool]) -> int | None:
        count = sum(active)
        return count if all(active[:count]) else None

    for k, instance in enumerate(instances):
        active = [j.forward_end < instance.window[0] and j.backward_start > instance.window[-1] for j in instances]
        if prefix(active) != k:
            return None
    outside = []
    for event in problem.outside_events:
        count = prefix([j.forward_end < event < j.backward_start for j in instances])
        if count is None:
            return None
        outside.append(count)
    return outside


def _disjoint_sets(regions: list[Region], limit: int) -> list[tuple[int, ...]] | None:
    """Every set of pairwise non-overlapping regions (as indices), or None if there are more than ``limit``."""
    sets: list[tuple[int, ...]] = [()]
    for index, region in enumerate(regions):
        sets += [s + (index,) for s in sets if not any(region.overlaps(regions[i]) for i in s)]
        if len(sets) > limit:
            return None
    return sets


def _chain_options(problem: BlockProblem, runs: list[int]) -> list[list[ChainOption]]:
    """Per instance: the options starting there (its menu plans, runs of whole instances from it)."""
    options: list[list[ChainOption]] = []
    first_of = {i.region.first_unit: k for k, i in enumerate(problem.instances)}
    for k, instance in enumerate(problem.instances):
        menu = problem.menus[instance.family]
        here = [
            ChainOption(k, 1, float(problem.cost_ms[k][m]), plan.retained_gain_bytes, problem.need_bytes[k][m : m + 1], m, None)
            for m, plan in enumerate(menu)
        ]
        for index in runs:
            run = problem.others[index]
            if first_of.get(run.region.first_unit) != k:
                continue
            covered = [i for i in problem.instances if run.region.overlaps(i.region)]
            need = np.array([(problem.base_bytes[i.window] - run.gains[i.window]).max() for i in covered])
            retained = retained_gain(run.gains, covered[-1])
            here.append(ChainOption(k, len(covered), run.cost_ms, retained, need, None, index))
        options.append(here)
    return options


def _cheapest_chain(
    problem: BlockProblem, options: list[list[ChainOption]], chosen_others: list[int], budget: int, outside_prefix: list[int]
) -> tuple[float, tuple[Region, ...]] | None:
    """The cheapest choice of options along the chain with ``chosen_others`` checkpointed too."""
    instances, others = problem.instances, problem.others
    num = len(instances)
    # the chosen outside regions lower every row by their gain there (constant over an instance's window)
    window_relief = [sum(int(others[c].gains[i.window].min()) for c in chosen_others) for i in instances]
    most_retained = _most_retained(options)
    bucket = max(1, -(-most_retained // STATES))
    size = most_retained // bucket + 1
    lower = [0] * (num + 1)  # per prefix length: the least retained bucket the outside events allow
    for event, count in zip(problem.outside_events, outside_prefix):
        bytes_here = int(problem.base_bytes[event]) - sum(int(others[c].gains[event]) for c in chosen_others)
        lower[count] = max(lower[count], _buckets_needed(bytes_here - budget, bucket))
    cost = [np.full(size, np.inf) for _ in range(num + 1)]
    back = [np.full(size, -1, dtype=np.int64) for _ in range(num + 1)]  # option id that reached each state
    prev_state = [np.full(size, -1, dtype=np.int64) for _ in range(num + 1)]
    cost[0][0] = 0.0
    states = np.arange(size)
    # per prefix length, the range of states reached so far (outside it every cost is infinite): an option is
    # weighed over that range only, not over all ``size`` states (most prefixes reach few)
    reached = [[size, -1] for _ in range(num + 1)]
    reached[0] = [0, 0]
    option_list: list[ChainOption] = []
    for k in range(num + 1):
        cost[k][states < lower[k]] = np.inf
        if k == num:
            break
        for option in options[k]:
            if option.retained_gain_bytes < 0:
                continue
            # worst bytes in each covered instance's window: need - (earlier gains) - outside relief <= budget
            relief = np.array(window_relief[k : k + option.length])
            least = _buckets_needed(int((option.need_bytes - relief).max()) - budget, bucket)
            shift = option.retained_gain_bytes // bucket
            first, last = max(reached[k][0], lower[k], least), min(reached[k][1], size - 1 - shift)
            if first > last:
                continue
            candidate = cost[k][first : last + 1] + option.cost_ms
            target = slice(first + shift, last + shift + 1)
            better = candidate < cost[k + option.length][target]
            if better.any():  # masked copies: boolean indexing gathers and scatters, twice the passes
                option_list.append(option)
                np.copyto(cost[k + option.length][target], candidate, where=better)
                np.copyto(back[k + option.length][target], len(option_list) - 1, where=better)
                np.copyto(prev_state[k + option.length][target], states[first : last + 1], where=better)
                span = reached[k + option.length]
                span[0], span[1] = min(span[0], first + shift), max(span[1], last + shift)
    end = cost[num]
    if not np.isfinite(end).any():
        return None
    state, position = int(end.argmin()), num
    plan_of = [0] * num
    runs: list[int] = []
    while position > 0:
        option = option_list[int(back[position][state])]
        state = int(prev_state[position][state])
        position = option.first
        if option.plan is not None:
            plan_of[option.first] = option.plan
        else:
            runs.append(option.other)
    total = float(end.min()) + sum(others[c].cost_ms for c in chosen_others)
    return total, problem.regions_of(plan_of, [*chosen_others, *runs])


def _most_retained(options: list[list[ChainOption]]) -> int:
    """The largest retained gain any path along the chain can add up (sizes the state space, not a guess)."""
    best = [0] + [-1] * len(options)
    for k, here in enumerate(options):
        for option in here:
            best[k + option.length] = max(best[k + option.length], best[k] + max(option.retained_gain_bytes, 0))
    return max(best[-1], 0)


def _buckets_needed(bytes_needed: int, bucket: int) -> int:
    """Fewest retained buckets that relieve ``bytes_needed`` bytes (rounded up: buckets are rounded-down bytes)."""
    return 0 if bytes_needed <= 0 else -(-bytes_needed // bucket)


def overlaps_any(region: Region, instances: Sequence[BlockInstance]) -> bool:
    return any(region.overlaps(i.region) for i in instances)


def retained_gain(gains: np.ndarray, instance: BlockInstance) -> int:
    """Bytes not held between ``instance``'s forward and its backward (the least over those events)."""
    between = gains[instance.forward_end + 1 : instance.backward_start]
    return int(between.min()) if len(between) else 0
