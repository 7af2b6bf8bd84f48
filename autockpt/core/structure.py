"""Repeated blocks: runs of units that repeat identically (a transformer's layers, a stage's residual blocks).

Found from the measured graph alone: every unit gets a signature (its op, FLOPs, output bytes, bytes saved for
backward) and a *family* is a stretch of the unit sequence that repeats with some period. Model and module names are
never read. The profiler times one instance per family; the block solver (``solve/blocks.py``) scores each family's block once and splits the budget across the
instances; the simulator still scores the assembled plan on the whole timeline, so a wrong guess here costs plan
quality, never a broken budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from autockpt.types import Graph, Region, StepTrace, Unit

logger = logging.getLogger(__name__)

MIN_BLOCK_UNITS = 4  # shorter periods are op-level patterns (q, k, v projections), not blocks


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockFamily:
    """Identical consecutive instances of one block, in unit order."""

    instances: tuple[Region, ...]

    @property
    def block_units(self) -> int:
        return self.instances[0].last_unit - self.instances[0].first_unit + 1


@dataclass(frozen=True, kw_only=True, slots=True)
class RepeatedBlocks:
    """Every family found; families do not overlap."""

    families: tuple[BlockFamily, ...]

    def covered_units(self) -> int:
        return sum(f.block_units * len(f.instances) for f in self.families)


def crossing_bytes(profile: StepTrace) -> list[int]:
    """Bytes of activations alive across the cut after unit p (p = 0 .. n-2)."""
    num_units = len(profile.units)
    diff = [0] * (num_units + 1)
    for storage in profile.storages:
        if not storage.user_units:
            continue
        first = max(storage.producer_unit, 0)
        last = max(storage.user_units) - 1
        if first <= last:
            diff[first] += storage.nbytes
            diff[last + 1] -= storage.nbytes
    crossing, running = [], 0
    for p in range(num_units - 1):
        running += diff[p]
        crossing.append(running)
    return crossing


def find_repeated_blocks(
    graph: Graph, profile: StepTrace, *, min_instances: int = 2, min_block_units: int = MIN_BLOCK_UNITS
) -> RepeatedBlocks:
    """Families of repeated blocks, largest coverage first, until no stretch of ``min_instances`` repeats is left."""
    num_units = len(profile.units)
    signature = _signatures(graph, profile)
    crossing = crossing_bytes(profile)
    taken = np.zeros(num_units, dtype=bool)
    families: list[BlockFamily] = []
    while True:
        best = _largest_repeat(signature, taken, min_instances, min_block_units)
        if best is None:
            break
        instances = _aligned_instances(crossing, *best)
        saves = any(profile.units[u].saved_bytes > 0 for u in range(instances[0].first_unit, instances[0].last_unit + 1))
        if saves:  # a block that saves nothing for backward has nothing to checkpoint (mask arithmetic)
            families.append(BlockFamily(instances=instances))
        taken[instances[0].first_unit : instances[-1].last_unit + 1] = True
    result = RepeatedBlocks(families=tuple(sorted(families, key=lambda f: f.instances[0].first_unit)))
    logger.debug(
        "repeated blocks: %s (%d of %d units)",
        [(f.block_units, len(f.instances)) for f in result.families], result.covered_units(), num_units,
    )
    return result


def _signatures(graph: Graph, profile: StepTrace) -> np.ndarray:
    """One integer per unit; equal integers mean the units cost the same and do the same op."""
    codes: dict[tuple, int] = {}
    keys = [
        (_op_kind(graph, unit), cost.flops, cost.output_bytes, cost.saved_bytes)
        for unit, cost in zip(graph.units, profile.units)
    ]
    return np.array([codes.setdefault(key, len(codes)) for key in keys], dtype=np.int64)


def _op_kind(graph: Graph, unit: Unit) -> str:
    """The op, with a call of a leaf submodule named by its class: layer 3's Linear does what layer 4's does."""
    if unit.op.startswith("module:"):
        try:
            return "module:" + type(graph.executable.get_submodule(unit.op.removeprefix("module:"))).__qualname__
        except AttributeError:
            return unit.op
    return unit.op


def _largest_repeat(
    signature: np.ndarray, taken: np.ndarray, min_instances: int, min_block_units: int
) -> tuple[int, int, int] | None:
    """(period, first unit, last unit) of the periodic stretch covering the most units in whole instances.

    For a period p, units u with signature[u] == signature[u + p] that are not yet taken form runs; a run from s to e
    means units s .. e + p repeat with period p. Ties go to the shorter period (the block, not a pair of blocks).
    """
    num_units = len(signature)
    best: tuple[int, int, int, int] | None = None  # (covered units, period, first unit, last unit)
    for period in range(min_block_units, num_units // min_instances + 1):
        same = (signature[:-period] == signature[period:]) & ~taken[:-period] & ~taken[period:]
        if not same.any():
            continue
        padded = np.concatenate(([0], same.astype(np.int8), [0]))
        switches = np.diff(padded)
        starts, ends = np.flatnonzero(switches == 1), np.flatnonzero(switches == -1)  # run = starts .. ends - 1
        longest = int((ends - starts).argmax())
        first, last = int(starts[longest]), int(ends[longest]) - 1 + period
        covered = (last - first + 1) // period * period
        if covered // period >= min_instances and (best is None or covered > best[0]):
            best = (covered, period, first, last)
    return None if best is None else best[1:]


def _aligned_instances(crossing: list[int], period: int, first: int, last: int) -> tuple[Region, ...]:
    """Whole instances inside units first .. last, shifted so the cuts between them cross the fewest bytes (a
    transformer's residual stream rather than the middle of its attention), as a person would cut."""
    count = (last - first + 1) // period
    spare = (last - first + 1) - count * period

    def cut_bytes(unit_after_cut: int) -> int:  # bytes crossing the cut just before ``unit_after_cut``
        return crossing[unit_after_cut - 1] if 0 < unit_after_cut <= len(crossing) else 0

    start = min(range(first, first + spare + 1), key=lambda s: (cut_bytes(s) + cut_bytes(s + count * period), s))
    return tuple(Region(first_unit=start + k * period, last_unit=start + (k + 1) * period - 1) for k in range(count))
