"""Which FSDP units to checkpoint, whole or selectively, and what a choice costs in time: values only (no torch).

Time model of one rank's step (``docs/fsdp.md``): compute is the single-device trace's forward time of every unit,
backward twice forward (as the roofline takes it), plus the forward time of each checkpointed unit again
(recomputation); a selectively checkpointed unit recomputes its forward but its matmuls and attention
(``selective_recompute_ms``). Collectives are priced from bytes over the link, ring algorithms: an all-gather or a
reduce-scatter of ``b`` bytes over ``N`` ranks moves ``b (N - 1) / N`` bytes through each rank's link, at
``interconnect_gb_per_s`` each way. Forward: the root's all-gather first (exposed), then each unit's all-gather hides behind the previous
unit's forward compute (FSDP2's prefetch) and is exposed by what it is longer. Backward, units in reverse: a unit's
all-gather (again, with ``reshard_after_forward``) and the next unit's reduce-scatter hide behind that next unit's
backward compute (recomputation included); the last reduce-scatters are exposed. No link figure: collectives cost 0.

The choice is a multiple-choice knapsack (PuLP, ``cheapest_choice``): each unit exactly one of keep, selective or
full, each with its estimated bytes freed and its recomputation time; the least recomputation time whose bytes freed
reach what the budget needs. The caller measures the choice on the fake process group and asks again, needing more,
until it fits.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import pulp

from autockpt.core.solve.base import SolverOptions
from autockpt.core.solve.pulp_tools import has_solution, make_solver, solver_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitTimes:
    """One FSDP unit, in forward order: its forward compute and the bytes of its collectives (whole, unsharded)."""

    name: str
    forward_ms: float
    all_gather_bytes: int  # the unit's parameters in the dtype they are gathered in (mixed precision's param dtype)
    reduce_scatter_bytes: int  # its gradients in the reduce dtype
    saved_bytes: int  # what autograd saves for backward inside it in the single-device trace (the knapsack's weight)
    selective_recompute_ms: float = 0.0  # its forward but the matmuls and attention: selective's recomputation


def link_ms(nbytes: int, world_size: int, gb_per_s: float | None) -> float:
    """A ring all-gather or reduce-scatter of ``nbytes`` (the whole tensor) over ``world_size`` ranks."""
    if not gb_per_s or world_size <= 1:
        return 0.0
    return nbytes * (world_size - 1) / world_size / (gb_per_s * 1e9) * 1e3


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTime:
    step_ms: float
    compute_ms: float
    recompute_ms: float
    exposed_collective_ms: float


def step_time(
    root: UnitTimes, units: Sequence[UnitTimes], checkpointed: set[str], *, world_size: int,
    gb_per_s: float | None, reshard_after_forward: bool, selective: AbstractSet[str] = frozenset(),
) -> StepTime:
    """The time model of the module docstring; ``units`` the inner units in forward order, ``checkpointed`` those
    recomputed whole, ``selective`` those recomputed selectively."""
    ag = {u.name: link_ms(u.all_gather_bytes, world_size, gb_per_s) for u in (root, *units)}
    rs = {u.name: link_ms(u.reduce_scatter_bytes, world_size, gb_per_s) for u in (root, *units)}
    forward = root.forward_ms + sum(u.forward_ms for u in units)
    again = {u.name: u.forward_ms if u.name in checkpointed else u.selective_recompute_ms if u.name in selective
             else 0.0 for u in units}
    recompute = sum(again.values())
    exposed = ag[root.name]  # forward: the root's all-gather has nothing to hide behind
    previous_ms = 0.0
    for unit in units:
        exposed += max(0.0, ag[unit.name] - previous_ms)
        previous_ms = unit.forward_ms
    # backward, last unit first: unit i's all-gather and unit i+1's reduce-scatter behind unit i+1's backward
    later: UnitTimes | None = None
    for unit in reversed(units):
        gather = ag[unit.name] if reshard_after_forward else 0.0
        if later is None:
            exposed += gather
        else:
            hide = 2 * later.forward_ms + again[later.name]
            exposed += max(0.0, gather + rs[later.name] - hide)
        later = unit
    exposed += (rs[later.name] if later is not None else 0.0) + rs[root.name]
    compute = 3 * forward
    return StepTime(step_ms=compute + recompute + exposed, compute_ms=compute, recompute_ms=recompute,
                    exposed_collective_ms=exposed)


def cheapest_choice(
    units: Sequence[UnitTimes], full_bytes: Mapping[str, float], selective_bytes: Mapping[str, float],
    need_bytes: float, *, at_least_bytes: float = 0.0,
) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The multiple-choice knapsack: each unit kept, selective or full, the least recomputation time (``forward_ms``
    for full, ``selective_recompute_ms`` for selective) among choices whose estimated bytes freed (``full_bytes``,
    ``selective_bytes`` per unit) reach ``need_bytes`` and exceed ``at_least_bytes`` (what an earlier choice was
    estimated to free, when it did not fit). Returns (full units, selective units), or None when even every unit
    full does not reach it. A selective option that frees nothing (0 bytes or less) is left out."""
    need = max(need_bytes, at_least_bytes + 1 if at_least_bytes > 0 else 0.0)
    if need <= 0:
        return (), ()
    if need > sum(max(full_bytes[u.name], selective_bytes[u.name], 0.0) for u in units):
        return None
    prob = pulp.LpProblem("fsdp_unit_choices", pulp.LpMinimize)
    full = [pulp.LpVariable(f"f{i}", cat="Binary") for i in range(len(units))]
    sel = [pulp.LpVariable(f"s{i}", cat="Binary") for i in range(len(units))]
    n = len(units)
    # ties (identical blocks) go to the units whose recomputation hides the most: a tiny tilt to the later ones
    prob += pulp.lpSum(f * (u.forward_ms + 1e-9 * (n - i)) + s * (u.selective_recompute_ms + 1e-9 * (n - i))
                       for i, (f, s, u) in enumerate(zip(full, sel, units)))
    for f, s, u in zip(full, sel, units):
        prob += f + s <= 1  # keep when neither
        if selective_bytes[u.name] <= 0:
            prob += s == 0
    prob += pulp.lpSum(f * full_bytes[u.name] + s * selective_bytes[u.name]
                       for f, s, u in zip(full, sel, units)) >= need
    options = SolverOptions()
    prob.solve(make_solver(solver_name(options), options))
    if not has_solution(prob):
        return None
    chosen_full = tuple(u.name for f, u in zip(full, units) if (f.value() or 0) > 0.5)
    chosen_sel = tuple(u.name for s, u in zip(sel, units) if (s.value() or 0) > 0.5)
    logger.debug("multiple-choice knapsack: need %.0f B, full %s, selective %s", need, chosen_full, chosen_sel)
    return chosen_full, chosen_sel
