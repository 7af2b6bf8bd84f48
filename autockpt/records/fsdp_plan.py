"""``FSDPPlan``: what ``plan_fsdp`` decided for a model sharded by FSDP2 over N ranks (``UnitDecision`` per unit),
with ``summary()``, ``save()`` (JSON by the one plan codec, ``codec.py``: schema "autockpt.fsdp_plan"; the files of
0.2 still load), ``report()`` (markdown or HTML, written by ``present/fsdp_report.py``) and ``load_fsdp_plan``.

Bytes are ``int`` bytes per rank; GB = 10^9 bytes and GiB = 2^30 bytes, both written wherever a size is shown.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from autockpt.record_types import ModelFingerprint, Provenance
from autockpt.records import codec
from autockpt.records.plan import presentation_writer
from autockpt.units import format_bytes

logger = logging.getLogger(__name__)

class UnitDecision(str, Enum):
    """What a plan does with one FSDP unit's activations: keep them all, recompute one module inside it (parts:
    e.g. its attention or its MLP, ``FSDPPlan.checkpointed_parts``), recompute all but the outputs of matmuls and
    attention (torch's selective activation checkpointing, torchtitan's op list), recompute the whole unit, keep
    them all in the host pool between forward and backward (offload), or recompute the whole unit with its inputs in
    the host pool (full_offload)."""

    KEEP = "keep"
    PARTS = "parts"
    SELECTIVE = "selective"
    FULL = "full"
    OFFLOAD = "offload"
    FULL_OFFLOAD = "full_offload"


@dataclass(frozen=True, kw_only=True, slots=True)
class TimelinePoint:
    """One rank's bytes by ``FSDPMemTracker``'s categories at one moment of the step: ``label`` says which (a unit's
    forward or backward start, peak or end, ``optimizer.step()``)."""

    label: str
    breakdown: tuple[tuple[str, int], ...]

    @property
    def total_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.breakdown)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankFigures:
    """One rank's predicted peak and what it holds then, by ``FSDPMemTracker``'s categories ("Sharded Param",
    "Unsharded Param", "Sharded Grad", "Unsharded Grad", "Activation", "Temp", "All Gather", "Reduce Scatter",
    "OptState", "Inputs", "Buffer"), summing to ``peak_bytes``.

    Measured in one process on torch's fake process group, which shows every rank rank 0's view. FSDP2 pads every
    rank's shard to rank 0's size, so parameters, gradients and the collectives' buffers are the same on every rank;
    the optimizer's states follow the unpadded shard, largest on rank 0. Each rank's figures are rank 0's: exact for
    every byte but the optimizer states, an upper bound by less than one row per parameter for those.

    ``timeline``: the second training step at FSDP2's unit boundaries, in the order they run (each unit's forward
    start after its all-gather, its forward peak and end, the same in backward, then ``optimizer.step()``); empty in
    plans saved before it was recorded."""

    rank: int
    peak_bytes: int
    breakdown: tuple[tuple[str, int], ...]
    timeline: tuple[TimelinePoint, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class FSDPPlan:
    """Per-rank checkpointing of FSDP units for ``world_size`` ranks (``autockpt.plan_fsdp``); ``apply_fsdp`` runs it.

    ``units``: the modules ``fully_shard`` wraps, the root ("") last; ``checkpointed``: those whose whole forward is
    recomputed in backward; ``selective``: those checkpointed selectively (the outputs of matmuls and attention saved,
    the rest recomputed); ``decision(unit)`` gives either as a ``UnitDecision``. ``selective_peak_bytes`` and
    ``selective_step_ms``: every unit selective (torchtitan's selective op list per block), measured and predicted as
    the others (None in plans of schema version 1). ``offloaded``: units run in the host pool (``host_pool_bytes``
    per rank, within ``host_pool_limit_bytes``): all they save for backward, or only their inputs when also in
    ``checkpointed``. ``checkpointed_parts``: modules inside units that are otherwise kept (full module names, e.g.
    "layers.3.mlp"), each recomputed alone (``UnitDecision.PARTS``). ``predicted_peak_bytes`` (the plan's),
    ``baseline_peak_bytes`` (nothing checkpointed) and ``min_feasible_bytes`` (every unit but the root checkpointed
    whole: the floor) are the largest rank's peak over two training steps (forward, backward, optimizer step; the
    first step makes the states), inputs included, measured on the fake process group. ``predicted_step_ms``: the
    step time model (compute, recomputation, exposed collectives; ``docs/fsdp.md``), ``overhead_pct`` against
    nothing checkpointed (``baseline_step_ms``); ``floor_step_ms`` is every unit checkpointed's, by the same model
    and times."""

    world_size: int
    units: tuple[str, ...]
    checkpointed: tuple[str, ...]
    reshard_after_forward: bool
    mixed_precision: str
    budget_bytes: int
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    min_feasible_bytes: int
    ranks: tuple[RankFigures, ...]
    predicted_step_ms: float
    baseline_step_ms: float
    floor_step_ms: float  # every unit checkpointed (full checkpointing per block), by the same time model
    exposed_collective_ms: float
    interconnect_gb_per_s: float | None
    provenance: Provenance
    # the model planned (``records/fingerprint.py``); ``apply_fsdp`` checks its parameters. Plans of 0.2 carry
    # ``parameter_digest`` instead (sha256 of parameter names, shapes, dtypes and the units: ``shard.parameter_digest``)
    fingerprint: ModelFingerprint | None = None
    parameter_digest: str | None = None
    notes: tuple[str, ...] = ()
    selective: tuple[str, ...] = ()  # units under selective checkpointing (disjoint from ``checkpointed``)
    selective_peak_bytes: int | None = None  # every unit selective, measured on the fake process group
    selective_step_ms: float | None = None  # every unit selective, by the same time model
    offloaded: tuple[str, ...] = ()  # units run in the host pool: their activations, or if checkpointed their inputs
    host_pool_bytes: int = 0  # the host pool per rank the offloaded units need (slot bytes of one step)
    host_pool_limit_bytes: int | None = None  # the bound the plan was given (``host_pool_gb``); None: no offload
    exposed_copy_ms: float = 0.0  # the offloaded units' copies the step waits for, by the time model
    optimizer_step_ms: float = 0.0  # optimizer.step() in every step time above (memory-bound; 0 without a target)
    checkpointed_parts: tuple[str, ...] = ()  # modules inside kept units, each checkpointed alone (schema 4)
    # the root's output projection (module path) whose cross-entropy runs in chunks of ``loss_chunk_tokens`` tokens
    # (``runtime/logits_standin.py``; schema 9): "" and 0 where the loss runs as the model computes it
    loss_projection: str = ""
    loss_chunk_tokens: int = 0

    def __post_init__(self) -> None:
        both = set(self.checkpointed) & set(self.selective)
        if both:
            raise ValueError(
                f"units {sorted(both)} are both fully and selectively checkpointed: give each one decision"
            )
        if "" in self.checkpointed or "" in self.selective or "" in self.offloaded:
            raise ValueError(
                "the root unit ('') is never checkpointed or offloaded: take it out of checkpointed / selective / "
                "offloaded"
            )
        if set(self.offloaded) & set(self.selective):
            raise ValueError(
                f"units {sorted(set(self.offloaded) & set(self.selective))} are both selective and offloaded: a "
                "selective unit is not offloaded"
            )
        whole = {*self.checkpointed, *self.selective, *self.offloaded}
        for part in self.checkpointed_parts:
            owner = self.unit_of(part)
            if owner is None or owner in whole:
                raise ValueError(
                    f"checkpointed part {part!r} must lie inside a unit that is otherwise kept ("
                    + ("it lies in no unit" if owner is None else f"{owner!r} is already checkpointed or offloaded")
                    + "): take it out of checkpointed_parts"
                )

        if bool(self.loss_projection) != (self.loss_chunk_tokens > 0):
            raise ValueError(
                f"loss_projection {self.loss_projection!r} and loss_chunk_tokens {self.loss_chunk_tokens} go together: "
                "give both (the loss in chunks) or neither"
            )

    def unit_of(self, module: str) -> str | None:
        """The inner unit that holds ``module`` (a full module name), or None."""
        return next((u for u in self.units if u and module.startswith(u + ".")), None)

    def parts_of(self, unit: str) -> tuple[str, ...]:
        """The checkpointed parts (full module names) inside ``unit``."""
        return tuple(p for p in self.checkpointed_parts if self.unit_of(p) == unit)

    def decision(self, unit: str) -> UnitDecision:
        """``unit``'s decision: FULL (in ``checkpointed``), FULL_OFFLOAD (in ``checkpointed`` and ``offloaded``),
        OFFLOAD (in ``offloaded``), SELECTIVE (in ``selective``), PARTS (some of its modules in
        ``checkpointed_parts``) or KEEP."""
        if unit not in self.units:
            raise KeyError(f"{unit!r} is not a unit of this plan (units: {', '.join(map(repr, self.units))})")
        offloaded = unit in self.offloaded
        if unit in self.checkpointed:
            return UnitDecision.FULL_OFFLOAD if offloaded else UnitDecision.FULL
        if offloaded:
            return UnitDecision.OFFLOAD
        if unit in self.selective:
            return UnitDecision.SELECTIVE
        return UnitDecision.PARTS if self.parts_of(unit) else UnitDecision.KEEP

    @property
    def overhead_pct(self) -> float:
        """Predicted step time above nothing checkpointed's, in percent."""
        return 100.0 * (self.predicted_step_ms / self.baseline_step_ms - 1.0) if self.baseline_step_ms > 0 else 0.0

    def summary(self) -> str:
        inner = [u for u in self.units if u]
        lines = [
            (f"FSDP2 plan for world size {self.world_size}: of {len(inner)} units {len(self.checkpointed)} "
            f"checkpointed whole, {len(self.selective)} selectively, {len(self.offloaded)} offloaded, "
            f"{len({self.unit_of(p) for p in self.checkpointed_parts})} with parts checkpointed (and the root "
            "sharded), "
            f"reshard_after_forward={self.reshard_after_forward}, mixed precision: {self.mixed_precision}"),
            f"  per-rank budget   {format_bytes(self.budget_bytes)}",
            f"  predicted peak    {format_bytes(self.predicted_peak_bytes)} (largest rank, fake process group)",
            (f"  nothing checkpointed {format_bytes(self.baseline_peak_bytes)}; every unit checkpointed "
            + ("whole (its inputs offloaded where that is lower) " if self.host_pool_limit_bytes is not None else "")
            + f"{format_bytes(self.min_feasible_bytes)} (the floor)"
            + (f"; every unit selective {format_bytes(self.selective_peak_bytes)}"
               if self.selective_peak_bytes is not None else "")),
            (f"  predicted step    {self.predicted_step_ms:.3f} ms ({self.overhead_pct:+.1f} % against nothing "
            f"checkpointed, {self.floor_step_ms:.3f} ms with every unit; {self.exposed_collective_ms:.3f} ms of "
            f"collectives exposed; {self.optimizer_step_ms:.3f} ms of optimizer step)"),
            f"  checkpointed      {', '.join(self.checkpointed) or '(none)'}",
            f"  selective         {', '.join(self.selective) or '(none)'}",
            f"  parts             {', '.join(self.checkpointed_parts) or '(none)'}",
            (f"  loss              {self.loss_projection} and its cross-entropy in chunks of {self.loss_chunk_tokens} "
             "tokens" if self.loss_chunk_tokens else "  loss              as the model computes it"),
            (f"  offloaded         {', '.join(self.offloaded) or '(none)'}: a host pool of "
             f"{format_bytes(self.host_pool_bytes)} per rank (bound {format_bytes(self.host_pool_limit_bytes)}), "
             f"{self.exposed_copy_ms:.3f} ms of copies exposed" if self.host_pool_limit_bytes is not None
             else "  offloaded         (no host pool given: host_pool_gb=0)"),
            f"  known by          {self.provenance.describe()}",
            "  rank 0 at its peak: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.ranks[0].breakdown if v),
        ]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON (no pickle); ``autockpt.load_fsdp_plan`` reads it back."""
        path = codec.save_record(self, path, codec.FSDP_SCHEMA)
        logger.info("FSDP plan saved to %s", path)
        return path

    def report(self, path: str | Path) -> Path:
        """A report file: HTML when ``path`` ends in .html/.htm, else markdown: the per-rank breakdown at the peak
        and rank 0's timeline over the step by category (drawn in HTML), both against the budget
        (``autockpt/present/fsdp_report.py``)."""
        presentation_writer("autockpt.present.fsdp_report:write_fsdp_report")(self, path)
        return Path(path)


def load_fsdp_plan(path: str | Path) -> FSDPPlan:
    """Read a plan written by ``FSDPPlan.save`` (of this version, or of 0.2)."""
    return codec.read_record(path, FSDPPlan, codec.FSDP_SCHEMA)
