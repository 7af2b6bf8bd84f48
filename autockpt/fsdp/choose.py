"""Which FSDP units to checkpoint, and what a choice costs in time: values only (no torch).

Time model of one rank's step (``docs/fsdp.md``): compute is the single-device trace's forward time of every unit,
backward twice forward (as the roofline takes it), plus the forward time of each checkpointed unit again
(recomputation). Collectives are priced from bytes over the link, ring algorithms: an all-gather or a reduce-scatter
of ``b`` bytes over ``N`` ranks moves ``b (N - 1) / N`` bytes through each rank's link, at ``interconnect_gb_per_s``
each way. Forward: the root's all-gather first (exposed), then each unit's all-gather hides behind the previous
unit's forward compute (FSDP2's prefetch) and is exposed by what it is longer. Backward, units in reverse: a unit's
all-gather (again, with ``reshard_after_forward``) and the next unit's reduce-scatter hide behind that next unit's
backward compute (recomputation included); the last reduce-scatters are exposed. No link figure: collectives cost 0.

The choice is a knapsack (PuLP): the least recomputation time whose saved bytes reach what the budget needs; the
caller measures the chosen set on the fake process group and asks again, needing more, until it fits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
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
    gb_per_s: float | None, reshard_after_forward: bool,
) -> StepTime:
    """The time model of the module docstring; ``units`` the inner units in forward order."""
    ag = {u.name: link_ms(u.all_gather_bytes, world_size, gb_per_s) for u in (root, *units)}
    rs = {u.name: link_ms(u.reduce_scatter_bytes, world_size, gb_per_s) for u in (root, *units)}
    forward = root.forward_ms + sum(u.forward_ms for u in units)
    recompute = sum(u.forward_ms for u in units if u.name in checkpointed)
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
            hide = 2 * later.forward_ms + (later.forward_ms if later.name in checkpointed else 0.0)
            exposed += max(0.0, gather + rs[later.name] - hide)
        later = unit
    exposed += (rs[later.name] if later is not None else 0.0) + rs[root.name]
    compute = 3 * forward
    return StepTime(step_ms=compute + recompute + exposed, compute_ms=compute, recompute_ms=recompute,
                    exposed_collective_ms=exposed)


def cheapest_cover(
    units: Sequence[UnitTimes], need_bytes: float, *, at_least_bytes: float = 0.0,
) -> tuple[str, ...] | None:
    """The units whose recomputation time is least among sets whose ``saved_bytes`` reach ``need_bytes`` and exceed
    ``at_least_bytes`` (what an earlier choice saved, when it did not fit); None when even every unit does not."""
    total = sum(u.saved_bytes for u in units)
    need = max(need_bytes, at_least_bytes + 1 if at_least_bytes > 0 else 0.0)
    if need <= 0:
        return ()
    if need > total:
        return None
    prob = pulp.LpProblem("fsdp_units", pulp.LpMinimize)
    take = [pulp.LpVariable(f"x{i}", cat="Binary") for i in range(len(units))]
    # ties (identical blocks) go to the units whose recomputation hides the most: a tiny tilt to the later ones
    prob += pulp.lpSum(x * (u.forward_ms + 1e-9 * (len(units) - i)) for i, (x, u) in enumerate(zip(take, units)))
    prob += pulp.lpSum(x * u.saved_bytes for x, u in zip(take, units)) >= need
    options = SolverOptions()
    prob.solve(make_solver(solver_name(options), options))
    if not has_solution(prob):
        return None
    chosen = tuple(u.name for x, u in zip(take, units) if (x.value() or 0) > 0.5)
    logger.debug("knapsack: need %.0f B, chose %s", need, chosen)
    return chosen
