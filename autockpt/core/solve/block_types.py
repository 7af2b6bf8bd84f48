"""The values of the block program (``blocks.py``): instances of repeated blocks, their menus of block plans, the
regions outside them, and the chain form of the outer problem. Apart from ``blocks.py`` so that ``base.Problem`` can
hold a prepared block problem without importing the program.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autockpt.types import Region


@dataclass(frozen=True, slots=True)
class BlockInstance:
    region: Region
    family: int
    window: np.ndarray  # its forward and backward events, in time order (aligned with the representative's)
    forward_end: int  # its last forward event
    backward_start: int  # its first backward event


@dataclass(frozen=True, slots=True)
class BlockPlan:
    relative: tuple[tuple[int, int], ...]  # regions as (first, last) unit offsets from the instance's first unit
    rerun_offsets: tuple[int, ...]  # units re-run in backward, as offsets (their forward ms is an instance's recompute)
    cost_ms: float  # at the representative
    retained_gain_bytes: int
    window_gains: np.ndarray  # bytes fewer than unmodified at each event of the window (negative: recompute burst)


@dataclass(frozen=True, slots=True)
class OtherRegion:
    region: Region
    cost_ms: float
    gains: np.ndarray  # per event of the whole timeline


@dataclass(frozen=True, slots=True)
class ChainOption:
    """One way to cover instances ``first .. first + length - 1``: a menu plan (length 1) or a run region."""

    first: int
    length: int
    cost_ms: float
    retained_gain_bytes: int
    need_bytes: np.ndarray  # per covered instance: worst bytes in its window, before earlier instances' gains
    plan: int | None  # menu item, or None for a run
    other: int | None  # the run's index in ``others``


@dataclass(frozen=True, slots=True)
class Chain:
    """What the dynamic program needs that does not depend on the budget."""

    options: list[list[ChainOption]]  # per instance: the options starting there
    outside_prefix: list[int]  # per outside event: how many leading instances hold their gains there
    outside: list[int]  # ``others`` that cover no instance (embedding, head)
    outside_sets: list[tuple[int, ...]]  # sets of them that do not overlap, as positions in ``outside``


@dataclass(slots=True)
class BlockProblem:
    """Everything the outer program needs that does not depend on the budget."""

    instances: list[BlockInstance]
    menus: list[list[BlockPlan]]  # per family; item 0 is the empty plan
    need_bytes: list[np.ndarray]  # per instance: worst bytes in its window under each plan of its family's menu
    cost_ms: list[np.ndarray]  # per instance: added ms (recompute + checkpoint machinery) of each menu plan there
    others: list[OtherRegion]
    base_bytes: np.ndarray  # unmodified bytes per event
    outside_events: np.ndarray  # events in no instance's window
    chain: Chain | None = None  # the outer problem as a chain (None: not a chain, the MILP solves it)

    def regions_of(self, choice: Sequence[int], others: Sequence[int]) -> tuple[Region, ...]:
        """The plan for menu item ``choice[k]`` at every instance k, plus the chosen other regions."""
        regions = [self.others[c].region for c in others]
        for instance, item in zip(self.instances, choice):
            start = instance.region.first_unit
            regions += [Region(first_unit=start + a, last_unit=start + b) for a, b in self.menus[instance.family][item].relative]
        return tuple(sorted(regions, key=lambda r: r.first_unit))
