"""Which FSDP units to checkpoint, whole or selectively, or offload, and what a choice costs in time: values only
(no torch).

Time model of one rank's step (``docs/fsdp.md``): compute is the single-device trace's forward time of every unit,
backward twice forward (as the roofline takes it), plus the forward time of each checkpointed unit again
(recomputation); a selectively checkpointed unit recomputes its forward but its matmuls and attention
(``selective_recompute_ms``); a unit with some of its parts (modules inside it: ``UnitPart``) checkpointed recomputes
their forward. Collectives are priced from bytes over the link, ring algorithms: an all-gather or a
reduce-scatter of ``b`` bytes over ``N`` ranks moves ``b (N - 1) / N`` bytes through each rank's link, at
``interconnect_gb_per_s`` each way. Forward: the root's all-gather first (exposed), then each unit's all-gather hides
behind the previous unit's forward compute (FSDP2's prefetch) and is exposed by what it is longer. Backward, units in
reverse: a unit's all-gather (again, with ``reshard_after_forward``) and the next unit's reduce-scatter hide behind
that next unit's backward compute (recomputation included); the last reduce-scatters are exposed. No link figure:
collectives cost 0. The optimizer step is memory-bound (``optimizer_step_ms``): the bytes it reads and writes over
the device's memory bandwidth, the same for every plan; without a target it is left out.

Offloading adds the copies to and from the host (``offload_copy_ms``, over the target's host link or the one measured
here), hidden behind a neighbouring unit's compute where copies overlap it (CUDA), exposed where they do not (CPU).

The choice is a multiple-choice knapsack (PuLP, ``cheapest_choice``): each unit exactly one of keep, one of its
parts checkpointed, selective, full, offload or full with its inputs offloaded, each with its estimated bytes freed,
the time it adds and the host pool it needs; the least added time whose bytes freed reach what the budget needs,
within the host pool's bound.
The caller measures the choice on the fake process group and asks again, needing more, until it fits.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import pulp

from autockpt.core.solve.base import SolverOptions
from autockpt.core.solve.pulp_tools import has_solution, make_solver, solver_name
from autockpt.records.fsdp_plan import UnitDecision
from autockpt.types import LinkPrice

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitPart:
    """A region inside a unit that can be checkpointed alone: a module in it (``name`` relative to the unit, e.g.
    "self_attn"), its forward time and what autograd saves inside it in the single-device trace."""

    name: str
    forward_ms: float
    saved_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitTimes:
    """One FSDP unit, in forward order: its forward compute and the bytes of its collectives (whole, unsharded)."""

    name: str
    forward_ms: float
    all_gather_bytes: int  # the unit's parameters in the dtype they are gathered in (mixed precision's param dtype)
    reduce_scatter_bytes: int  # its gradients in the reduce dtype
    saved_bytes: int  # what autograd saves for backward inside it in the single-device trace (the knapsack's weight)
    selective_recompute_ms: float = 0.0  # its forward but the matmuls and attention: selective's recomputation
    parts: tuple[UnitPart, ...] = ()  # the modules inside it that may be checkpointed alone (``UnitDecision.PARTS``)

    def part(self, name: str) -> UnitPart | None:
        """Its part called ``name``, or None when it has none of that name."""
        return next((p for p in self.parts if p.name == name), None)


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
    exposed_copy_ms: float = 0.0  # offloaded units' copies to and from the host the compute waits for
    optimizer_ms: float = 0.0  # optimizer.step() (``optimizer_step_ms``)


def optimizer_step_ms(start: Mapping[str, int], during: Mapping[str, int] | None, hbm_gb_per_s: float | None) -> float:
    """``optimizer.step()`` as memory-bound: it reads the sharded parameters, their gradients and the optimizer's
    states and writes the parameters and states back, and a foreach step writes and reads its temporaries too
    (``during``'s "OptState" over ``start``'s). ``start``: the bytes by ``FSDPMemTracker``'s categories as the step
    starts (its states made); no bandwidth figure: 0."""
    if not hbm_gb_per_s:
        return 0.0
    states = start.get("OptState", 0)
    temporaries = max(0, (during or start).get("OptState", 0) - states)
    moved = 2 * start.get("Sharded Param", 0) + start.get("Sharded Grad", 0) + 2 * states + 2 * temporaries
    return moved / (hbm_gb_per_s * 1e9) * 1e3


def step_time(
    root: UnitTimes, units: Sequence[UnitTimes], checkpointed: AbstractSet[str], *, world_size: int,
    gb_per_s: float | None, reshard_after_forward: bool, selective: AbstractSet[str] = frozenset(),
    copies_ms: Mapping[str, float] | None = None, optimizer_ms: float = 0.0,
    parts: Mapping[str, Sequence[str]] | None = None,
) -> StepTime:
    """The time model of the module docstring; ``units`` the inner units in forward order, ``checkpointed`` those
    recomputed whole, ``selective`` those recomputed selectively, ``parts`` the parts checkpointed (by their names
    in ``UnitTimes.parts``) of the units that are neither, ``copies_ms`` the exposed copy time of the
    offloaded ones (``offload_copy_ms``), ``optimizer_ms`` the optimizer step's (``optimizer_step_ms``)."""
    ag = {u.name: link_ms(u.all_gather_bytes, world_size, gb_per_s) for u in (root, *units)}
    rs = {u.name: link_ms(u.reduce_scatter_bytes, world_size, gb_per_s) for u in (root, *units)}
    forward = root.forward_ms + sum(u.forward_ms for u in units)
    again = {u.name: u.forward_ms if u.name in checkpointed else u.selective_recompute_ms if u.name in selective
             else sum(u.part(p).forward_ms for p in (parts or {}).get(u.name, ())) for u in units}
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
    copies = sum((copies_ms or {}).values())
    return StepTime(step_ms=compute + recompute + exposed + copies + optimizer_ms, compute_ms=compute,
                    recompute_ms=recompute, exposed_collective_ms=exposed, exposed_copy_ms=copies,
                    optimizer_ms=optimizer_ms)


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitOption:
    """One way to treat one unit other than keeping it: its estimated bytes freed at the rank's peak, what it adds
    to the step (recomputation, exposed copies) and the host pool it needs."""

    decision: UnitDecision
    freed_bytes: float
    parts: tuple[str, ...] = ()  # with ``UnitDecision.PARTS``: the parts checkpointed (``UnitPart.name``)
    recompute_ms: float = 0.0  # the unit's forward again (whole, selective, or its checkpointed parts')
    copy_ms: float = 0.0  # offloading's exposed copies to and from the host (``offload_copy_ms``)
    pool_bytes: int = 0

    @property
    def cost_ms(self) -> float:
        """What the option adds to the step: recomputation and exposed copies."""
        return self.recompute_ms + self.copy_ms

    @property
    def key(self) -> tuple[UnitDecision, tuple[str, ...]]:
        """What the option does to the unit (its decision and parts), without its estimates."""
        return self.decision, self.parts


def cheapest_choice(
    units: Sequence[str], options: Mapping[str, Sequence[UnitOption]], need_bytes: float, *,
    at_least_bytes: float = 0.0, pool_limit_bytes: int | None = None,
) -> dict[str, UnitOption] | None:
    """The multiple-choice knapsack: each unit kept or given one of its ``options``, the least added time
    (``cost_ms``) among choices whose estimated bytes freed reach ``need_bytes`` and exceed ``at_least_bytes`` (what
    an earlier choice was estimated to free, when it did not fit) and whose pool bytes stay within
    ``pool_limit_bytes``. Returns the option of every unit not kept, or None when no choice reaches it. An option
    that frees nothing is left out."""
    need = max(need_bytes, at_least_bytes + 1 if at_least_bytes > 0 else 0.0)
    if need <= 0:
        return {}
    usable = {u: [o for o in options.get(u, ()) if o.freed_bytes > 0
                  and (pool_limit_bytes is None or o.pool_bytes <= pool_limit_bytes)] for u in units}
    if need > sum(max((o.freed_bytes for o in usable[u]), default=0.0) for u in units):
        return None
    prob = pulp.LpProblem("fsdp_unit_choices", pulp.LpMinimize)
    picks = {(u, k): pulp.LpVariable(f"x{i}_{k}", cat="Binary") for i, u in enumerate(units)
             for k in range(len(usable[u]))}
    n = len(units)
    # ties (identical blocks) go to the units whose recomputation hides the most: a tiny tilt to the later ones
    prob += pulp.lpSum(x * (usable[u][k].cost_ms + 1e-9 * (n - units.index(u))) for (u, k), x in picks.items())
    for u in units:
        prob += pulp.lpSum(picks[u, k] for k in range(len(usable[u]))) <= 1  # kept when none
    prob += pulp.lpSum(x * usable[u][k].freed_bytes for (u, k), x in picks.items()) >= need
    if pool_limit_bytes is not None:
        prob += pulp.lpSum(x * usable[u][k].pool_bytes for (u, k), x in picks.items()) <= pool_limit_bytes
    options_ = SolverOptions()
    prob.solve(make_solver(solver_name(options_), options_))
    if not has_solution(prob):
        return None
    chosen = {u: usable[u][k] for (u, k), x in picks.items() if (x.value() or 0) > 0.5}
    logger.debug("multiple-choice knapsack: need %.0f B: %s", need, {u: o.key for u, o in chosen.items()})
    return chosen


def offload_copy_ms(
    moved_bytes: int, storages: int, link: LinkPrice, hide_forward_ms: float, hide_backward_ms: float,
) -> float:
    """What offloading a unit adds to the step: its storages copied to the host in forward and back in backward.
    With copies beside the compute (CUDA's streams) each direction hides behind a neighbour's compute
    (``hide_*_ms``: the pool runs one region ahead of the host in forward and restores one region ahead in backward);
    synchronous copies (the CPU) are all exposed. ``storages`` copies each way, each paying the link's latency."""
    extra_latency_ms = (storages - 1) * link.latency_ms  # ``LinkPrice`` prices one copy of the bytes
    out = link.device_to_host_ms(moved_bytes) + extra_latency_ms
    back = link.host_to_device_ms(moved_bytes) + extra_latency_ms
    if not link.overlaps_compute:
        return out + back
    return max(0.0, out - hide_forward_ms) + max(0.0, back - hide_backward_ms)
