"""``plan_fsdp``: per FSDP2 unit, keep, checkpoint one of its parts, checkpoint selectively, checkpoint whole or
(with a host pool) offload, per rank, for a model sharded by ``fully_shard`` over N ranks, planned in one process
(``docs/fsdp.md``).

1. The single-device step on one rank's batch is captured and traced (``Planner.from_model``, fake trace): each
   unit's forward time, the part of it that is not matmuls or attention (what selective checkpointing recomputes),
   the bytes autograd saves inside it, and the same for each module inside it (its parts: a direct child, or a
   child of a ModuleList/ModuleDict child, e.g. "self_attn" and "mlp" of a decoder layer).
2. On torch's fake process group (``fake_world.py``) the sharded step is measured with every unit but the root
   treated alike: nothing checkpointed (the baseline), every unit whole (the floor), every unit selective, every
   unit with the same part checkpointed (for the parts that hold the most saved bytes, ``_part_candidates``) and,
   with a host pool, every unit offloaded and every unit whole with its inputs offloaded (the floor when lower and
   the pool holds it). Offloading runs autockpt's own host pool on the fakes (``HostPool(fake_tensors=True)``).
3. The multiple-choice knapsack (``choose.py``) gives each unit one decision at the least added time (recomputation,
   exposed copies) whose estimated bytes freed (the unit's share of what every unit so treated frees, measured) cover
   what the budget needs, within the host pool's bound; the choice is measured on the fake process group, and while
   it overshoots the knapsack is asked for more. The predicted peak and host pool are that measurement.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autockpt.core.devices import device_spec
from autockpt.core.roofline import link_price
from autockpt.errors import InfeasibleBudgetError
from autockpt.fsdp.choose import (
    UnitOption,
    UnitTimes,
    cheapest_choice,
    offload_copy_ms,
    optimizer_step_ms,
    step_time,
)
from autockpt.fsdp.fake_world import (
    RankMemory,
    existing_fake_group,
    fake_world,
    measure_optimizer_steps,
    measure_sharded_step,
)
from autockpt.fsdp.root_loss import NONE as NO_ROOT_LOSS
from autockpt.fsdp.root_loss import RootLoss, root_loss
from autockpt.fsdp.shard import (
    ROOT,
    check_units,
    check_unsharded_module,
    describe_mp_policy,
)
from autockpt.fsdp.unit_times import default_units, part_candidates, unit_times
from autockpt.measure.costs import calibrate
from autockpt.measure.loop import named_optimizer
from autockpt.measure.loss import checked_loss, default_loss
from autockpt.measure.sources import example_arguments
from autockpt.measure.timing import RooflineTiming, priced_device
from autockpt.planning.options import PlanOptions, budget_to_bytes, pool_bytes_of, resolve_options
from autockpt.planning.planner import Planner
from autockpt.record_types import ModelFingerprint
from autockpt.records.fingerprint import model_fingerprint
from autockpt.records.fsdp_plan import FSDPPlan, RankFigures, UnitDecision
from autockpt.runtime.offload import available_host_bytes
from autockpt.types import LinkPrice, describe_value
from autockpt.units import format_bytes

logger = logging.getLogger(__name__)


def plan_fsdp(
    model: nn.Module, *, world_size: int, budget_gb: float | None = None, budget_bytes: int | None = None,
    example_inputs: Any = (), example_kwargs: Any = None, example_target: Any = None,
    loss_fn: Callable[..., Any] | None = None, units: Sequence[str] | None = None,
    reshard_after_forward: bool = True, mp_policy: Any = None, options: PlanOptions | None = None,
    **option_keywords: Any,
) -> FSDPPlan:
    """Plan checkpointing per FSDP unit (keep, one part such as its attention or MLP, selective or whole) for
    ``model`` sharded by FSDP2 over ``world_size`` ranks, under a per-rank budget.

    ``example_inputs`` / ``example_kwargs`` / ``example_target``: ONE rank's batch (real or meta tensors; the model
    may be on the meta device and is not changed). ``loss_fn(output, target)`` with a target, ``loss_fn(output)``
    without (default: ``output.loss``, else the sum of the floating-point outputs).

    Options: ``options=PlanOptions(...)`` or its fields as keyword arguments; those it cannot honour are refused by
    name (``FSDP_REFUSED``). ``optimizer``: None (the default, as everywhere: no step), "adamw", "adam", "sgd", or a
    function making one from a list of parameters (``torch.optim.AdamW``, ``functools.partial(...)``); with one, the
    budget covers forward, backward and two optimizer steps (the first makes the states) and the rank's inputs, the
    step as torch runs it on the target's device type (this machine's without a target): on CUDA a group's
    ``foreach=None`` (the default) means the foreach step and its temporaries. ``trace``: "auto" or "fake" (the step
    of N ranks is never run: always a fake trace).
    ``units``: the module names ``fully_shard`` wraps (default: the repeated blocks autockpt finds in the traced
    step); the root is always sharded last and never checkpointed. ``mp_policy``: a
    ``torch.distributed.fsdp.MixedPrecisionPolicy`` or None. ``target``: a device name ("h100-sxm-80gb") or
    ``DeviceSpec``: roofline times and its GPU-to-GPU link for the collectives; its memory is the budget when none
    is given. ``host_pool_gb``: a host pool per rank (GB = 10^9 bytes, or "auto") that units may be offloaded into
    (keep or checkpoint whole, with what they save, or their inputs, moved to the host between forward and backward);
    0 (default): nothing offloaded. Raises ``InfeasibleBudgetError`` (``min_feasible_bytes``: every unit checkpointed,
    with its inputs offloaded when the pool holds them) below the floor."""
    if budget_gb is not None or budget_bytes is not None:
        budget_to_bytes(budget_gb, budget_bytes)  # a bad budget is refused before anything is traced
    planner = FSDPPlanner.from_model(
        model, world_size=world_size, example_inputs=example_inputs, example_kwargs=example_kwargs,
        example_target=example_target, loss_fn=loss_fn, units=units, reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy, options=options, **option_keywords,
    )
    return planner.plan(budget_gb, budget_bytes=budget_bytes)


# what an FSDP plan cannot honour: it decides per unit (keep, parts, selective, whole, offload) with its own
# knapsack, for a loop of full steps that holds the output, and has no module to return
FSDP_REFUSED = ("checkpoint", "gradient_accumulation_steps", "solver", "strict", "compiled", "output_held",
                "device_memory_bytes")


class FSDPPlanner:
    """One model's FSDP2 step captured, traced and timed once at one world size (``from_model``); ``plan`` answers
    any number of per-rank budgets from it, each fake-process-group measurement made once and kept for the next
    budget (``plan_fsdp`` is ``FSDPPlanner.from_model(...).plan(budget)``)."""

    def __init__(self, model: nn.Module, *, world_size: int, unit_names: tuple[str, ...], times: dict[str, UnitTimes],
                 spec: Any, pool_limit: int | None, reshard_after_forward: bool, mp_policy: Any,
                 make_optimizer: Callable[[list], Any] | None, device_type: str, provenance: Any,
                 fingerprint: ModelFingerprint, measure: Callable[[Mapping[str, UnitOption], int], RankMemory],
                 loss: RootLoss = NO_ROOT_LOSS, link: LinkPrice | None = None) -> None:
        self.model, self.world_size, self.unit_names, self.spec = model, world_size, unit_names, spec
        self.link = link  # the host link offloading is priced over (with a host pool; ``_link``)
        self.inner = [u for u in unit_names if u != ROOT]
        self.root, self.blocks = times[ROOT], [times[u] for u in self.inner]
        self.pool_limit, self.reshard_after_forward, self.mp_policy = pool_limit, reshard_after_forward, mp_policy
        self.make_optimizer, self.device_type, self.provenance = make_optimizer, device_type, provenance
        self.fingerprint, self.loss = fingerprint, loss
        self._measure_on_fakes = measure
        self._measured: dict[tuple[int, frozenset], RankMemory] = {}  # by loss chunk and what the decisions do

    @classmethod
    def from_model(
        cls, model: nn.Module, *, world_size: int, example_inputs: Any = (), example_kwargs: Any = None,
        example_target: Any = None, loss_fn: Callable[..., Any] | None = None, units: Sequence[str] | None = None,
        reshard_after_forward: bool = True, mp_policy: Any = None, options: PlanOptions | None = None,
        **option_keywords: Any,
    ) -> FSDPPlanner:
        """The step captured and traced on one rank's batch (fake trace), the units found and timed; the arguments
        are ``plan_fsdp``'s, checked here."""
        options = resolve_options(options, option_keywords, entry_point="plan_fsdp", refused=FSDP_REFUSED)
        trace, timing, target = options.trace, options.timing, options.target
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(
                f"world_size must be an integer >= 1 (the number of ranks), got {describe_value(world_size)}"
            )
        if trace not in ("auto", "fake"):
            raise ValueError(
                f"plan_fsdp traces the step with trace='fake' only (no real step is run for N ranks); got trace={trace!r}"
            )
        check_unsharded_module(
            model, "plan the model as it is before fully_shard (a fresh instance, or one on the meta device)"
        )
        existing_fake_group(world_size)  # a real process group is refused before anything is traced
        spec = device_spec(target) if target is not None else None
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be True or False, got {describe_value(reshard_after_forward)}")
        _check_mp_policy(mp_policy)
        pool_limit = None if options.host_pool_gb == 0 else pool_bytes_of(options.host_pool_gb, available_host_bytes)
        make_optimizer = _optimizer_factory(options.optimizer)
        step_loss = _step_loss(loss_fn, example_target)
        args, kwargs = example_arguments(example_inputs, example_kwargs)  # a list is the arguments, as everywhere

        if timing == "auto" and spec is not None and getattr(mp_policy, "param_dtype", None) is not None:
            timing = RooflineTiming(spec, dtype=mp_policy.param_dtype)  # the dtype FSDP computes in, not the trace's
        trace_target = pytree.tree_map_only(
            torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype) if t.device.type == "meta" else t,
            example_target,
        )  # the fake trace makes fakes of the inputs, not of what the loss closes over
        planner = Planner.from_model(
            model, example_inputs=args, example_kwargs=kwargs, loss_fn=lambda out: step_loss(out, trace_target),
            trace="fake", timing=timing, target=target,
        )
        unit_names = check_units(model, units) if units is not None else default_units(model, planner.graph,
                                                                                        planner.trace)
        times = unit_times(model, unit_names, planner.graph, planner.trace, mp_policy)
        loss = root_loss(model, planner, tuple(unit_names), options.loss_chunk_tokens)
        # the device the ranks run on: torch's optimizers default to foreach on CUDA, whose temporaries count
        device_type = spec.device_type if spec is not None else "cuda" if torch.cuda.is_available() else "cpu"
        optimizer_steps = None  # the same whatever the decisions: measured once, added to each decision's step
        if make_optimizer is not None:
            with fake_world(world_size):
                optimizer_steps = measure_optimizer_steps(
                    model, world_size=world_size, units=unit_names, reshard_after_forward=reshard_after_forward,
                    mp_policy=mp_policy, make_optimizer=make_optimizer, device_type=device_type,
                )

        def measure(decisions: Mapping[str, UnitOption], chunk_tokens: int) -> RankMemory:
            return measure_sharded_step(
                model, world_size=world_size, units=unit_names, reshard_after_forward=reshard_after_forward,
                mp_policy=mp_policy, inputs=(args, kwargs, example_target), step_loss=step_loss,
                make_optimizer=make_optimizer, device_type=device_type, **_as_sets(decisions),
                loss_chunk=(loss.projection, chunk_tokens) if chunk_tokens else None, optimizer_steps=optimizer_steps,
            )

        return cls(model, world_size=world_size, unit_names=tuple(unit_names), times=times, spec=spec,
                   pool_limit=pool_limit, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                   make_optimizer=make_optimizer, device_type=device_type, provenance=planner.provenance,
                   fingerprint=model_fingerprint(model, planner.graph, args, kwargs), measure=measure, loss=loss,
                   link=_link(spec, timing) if pool_limit is not None else None)

    def measure(self, decisions: Mapping[str, UnitOption], chunk_tokens: int = 0) -> RankMemory:
        """The sharded step under ``decisions`` on the fake process group (the root's loss in chunks of
        ``chunk_tokens`` tokens; 0: as the model computes it), measured once per distinct decisions."""
        key = (chunk_tokens, _key(decisions))
        if key not in self._measured:
            with fake_world(self.world_size):
                self._measured[key] = self._measure_on_fakes(decisions, chunk_tokens)
        return self._measured[key]

    def plan(self, budget_gb: float | None = None, *, budget_bytes: int | None = None) -> FSDPPlan:
        """The least-time decisions per unit whose measured peak keeps the per-rank budget (GB = 10^9 bytes; the
        target's memory when none is given). Raises ``InfeasibleBudgetError`` below the floor."""
        existing_fake_group(self.world_size)  # refused under a real process group, measured already or not
        if budget_gb is None and budget_bytes is None and self.spec is not None:
            budget = self.spec.memory_bytes
        else:
            budget = budget_to_bytes(budget_gb, budget_bytes)
        # the root's loss as the model computes it, and in each chunk that lowers the floor (every unit checkpointed
        # whole) where the budget is under the unmodified step's peak: the fastest plan of them, stating the lowest
        # floor; a chunk that leaves the floor as it is sets no peak (the loss is not where the step peaks)
        lowering = self._floor_lowering_chunks()
        chunks = (0, *lowering) if self.measure({}).peak_bytes > budget else (0,)
        if self.loss.fixed and self.loss.chunk_tokens:  # a chunk given: that program alone, as for one device
            chunks = lowering = self.loss.chunk_tokens
        plans, refusals = [], []
        floors: dict[int, int] = {}  # per program weighed (its chunk of tokens; 0: the loss unchunked), its floor
        for chunk_tokens in chunks:
            if chunk_tokens and plans and plans[0].predicted_step_ms <= plans[0].baseline_step_ms + self.loss.extra_ms:
                break  # a plan with the loss in chunks takes the step and the logits made again: none is faster
            try:
                plans.append(self._plan_at(budget, chunk_tokens))
                floors[chunk_tokens] = plans[-1].min_feasible_bytes
            except InfeasibleBudgetError as refusal:
                refusals.append(refusal)
                floors[chunk_tokens] = refusal.min_feasible_bytes
        if not plans:
            raise min(refusals, key=lambda refusal: refusal.min_feasible_bytes)
        # the floor stated is the lowest of them all, the chunks not planned included (a budget the loss unchunked
        # or in larger chunks keeps leaves the others unplanned, and they may reach lower)
        for other in set(lowering) - set(floors):
            every, floor_decision = self._every_whole(other)
            floors[other] = every[floor_decision].peak_bytes
        best = min(plans, key=lambda the_plan: the_plan.predicted_step_ms)
        floor_chunk = min(floors, key=lambda chunk: (floors[chunk], chunk))
        notes = best.notes
        if floors[floor_chunk] < best.min_feasible_bytes:  # another program's floor: said (the plan's figures aren't)
            loss = f"in chunks of {floor_chunk} tokens" if floor_chunk else "as the model computes it"
            said = (f"the floor stated ({format_bytes(floors[floor_chunk])}) is reached with the root's loss {loss}; "
                    f"this plan's own program reaches {format_bytes(best.min_feasible_bytes)}")
            notes += (said,)
        return dataclasses.replace(best, min_feasible_bytes=floors[floor_chunk], notes=notes)

    def _floor_lowering_chunks(self) -> tuple[int, ...]:
        """The chunks weighed (``RootLoss.chunk_tokens``) under which every unit checkpointed whole peaks lower than
        with the loss as the model computes it (one measurement each, kept)."""
        whole = _every(self.inner, UnitDecision.FULL)
        unchunked = self.measure(whole).peak_bytes
        return tuple(chunk for chunk in self.loss.chunk_tokens if self.measure(whole, chunk).peak_bytes < unchunked)

    def _every_whole(self, chunk_tokens: int) -> tuple[dict[UnitDecision, RankMemory], UnitDecision]:
        """Every unit given each whole-unit decision (full; with a pool offload and full with its inputs offloaded),
        measured with the root's loss in chunks of ``chunk_tokens`` tokens, and the decision of the floor among them."""
        inner = self.inner
        every = {
            decision: self.measure(_every(inner, decision), chunk_tokens) if inner else self.measure({}, chunk_tokens)
            for decision in (UnitDecision.FULL, *([UnitDecision.OFFLOAD, UnitDecision.FULL_OFFLOAD]
                                                  if self.pool_limit is not None else []))
        }
        floor_decision = UnitDecision.FULL
        if (UnitDecision.FULL_OFFLOAD in every and every[UnitDecision.FULL_OFFLOAD].host_pool_bytes <= self.pool_limit
                and every[UnitDecision.FULL_OFFLOAD].peak_bytes < every[UnitDecision.FULL].peak_bytes):
            floor_decision = UnitDecision.FULL_OFFLOAD
        return every, floor_decision

    def _plan_at(self, budget: int, chunk_tokens: int) -> FSDPPlan:
        """``plan`` with the root's loss in chunks of ``chunk_tokens`` tokens (0: as the model computes it)."""
        inner, blocks, pool_limit = self.inner, self.blocks, self.pool_limit
        measure = functools.partial(self.measure, chunk_tokens=chunk_tokens)
        baseline = measure({})
        every, floor_decision = self._every_whole(chunk_tokens)
        floor = every[floor_decision]
        if budget < floor.peak_bytes:
            offload_hint = " (or host_pool_gb=... to offload units' inputs to the host)" if pool_limit is None else ""
            inputs_moved = " and its inputs offloaded" if floor_decision is UnitDecision.FULL_OFFLOAD else ""
            inputs_moved += f" and the loss in chunks of {chunk_tokens} tokens" if chunk_tokens else ""
            raise InfeasibleBudgetError(
                f"a per-rank budget of {format_bytes(budget)} is below the smallest peak checkpointing reaches at "
                f"world size {self.world_size}: {format_bytes(floor.peak_bytes)} with every one of the {len(inner)} "
                f"units checkpointed whole{inputs_moved}. Give budget_bytes >= {floor.peak_bytes}, more ranks, or a "
                f"smaller per-rank batch{offload_hint}",
                budget_bytes=budget, min_feasible_bytes=floor.peak_bytes,
            )
        every[UnitDecision.SELECTIVE] = _measure_selective(measure, inner) if inner else baseline
        # every unit with the same part checkpointed: only needed when something must be freed
        part_choices = {name: {u.name: UnitOption(decision=UnitDecision.PARTS, freed_bytes=0.0, parts=(name,))
                               for u in blocks if u.part(name) is not None}
                        for name in (part_candidates(blocks) if baseline.peak_bytes > budget else ())}
        every_part = {name: measure(choice) for name, choice in part_choices.items()}
        options = _unit_options(blocks, baseline, every, every_part, self.link)
        floor_options = {u: next(o for o in options[u] if o.decision is floor_decision) for u in inner}
        known_before = len(self._measured)
        decisions, measured = _fit([u.name for u in blocks], options, budget, baseline, floor, floor_options,
                                   measure, pool_limit)
        tries = len(self._measured) - known_before
        return self._record(budget, decisions, measured, floor, every, list(every_part), self.link, tries, chunk_tokens)

    def _record(self, budget: int, decisions: dict[str, UnitOption], measured: RankMemory, floor: RankMemory,
                every: Mapping[UnitDecision, RankMemory], parts_tried: list[str], link: LinkPrice | None, tries: int,
                chunk_tokens: int) -> FSDPPlan:
        """The plan of ``decisions``: their measured figures, the time model's step times, and notes on how."""
        baseline = self.measure({})  # the unmodified step (its loss as the model computes it)
        extra_ms = self.loss.extra_ms if chunk_tokens else 0.0  # the logits made again in backward
        root, blocks, inner, spec, pool_limit = self.root, self.blocks, self.inner, self.spec, self.pool_limit
        chosen = _as_sets(decisions)
        gb_per_s = spec.interconnect_gb_per_s if spec is not None else None
        optimizer_ms = (optimizer_step_ms(dict(baseline.step_start), dict(baseline.step_foreach_peak) or None,
                                          spec.hbm_gb_per_s)
                        if spec is not None and baseline.step_start else 0.0)  # the same in every plan of this model
        kwargs_time = {"world_size": self.world_size, "gb_per_s": gb_per_s,
                       "reshard_after_forward": self.reshard_after_forward, "optimizer_ms": optimizer_ms}
        copies = {u: o.copy_ms for u, o in decisions.items()}
        parts = {u: o.parts for u, o in decisions.items() if o.decision is UnitDecision.PARTS}
        predicted = step_time(root, blocks, set(chosen["checkpointed"]), selective=set(chosen["selective"]),
                              copies_ms=copies, parts=parts, **kwargs_time)
        predicted = dataclasses.replace(predicted, step_ms=predicted.step_ms + extra_ms)
        plain = step_time(root, blocks, set(), **kwargs_time)
        full = step_time(root, blocks, set(inner), **kwargs_time)
        all_selective = step_time(root, blocks, set(), selective=set(inner), **kwargs_time)
        notes = [
            (f"{tries} fake-process-group measurement(s) of chosen sets; per unit keep, "
             + (f"one of the parts {', '.join(parts_tried)} checkpointed, " if parts_tried else
                "" if baseline.peak_bytes <= budget else "no part worth measuring alone, ")
             + "selective (matmul and attention outputs saved), full"
             + (", offload or full with its inputs offloaded" if pool_limit is not None else
                " (host_pool_gb=None: nothing offloaded)")),
            "collectives priced at 0 ms: no GPU-to-GPU link figure (give target=...)" if not gb_per_s else
            f"collectives priced over {gb_per_s:g} GB/s each way per GPU ({spec.name if spec else ''}), ring algorithms",
            (f"optimizer.step() priced at {optimizer_ms:.3f} ms: its bytes read and written over "
             f"{spec.hbm_gb_per_s:g} GB/s of device memory bandwidth"
             if spec is not None and self.make_optimizer is not None
             else "optimizer.step() not priced (no target)" if self.make_optimizer is not None
             else "no optimizer step"),
        ]
        if link is not None:
            notes.append(f"host copies priced at {link.device_to_host_gb_per_s:.3g} / {link.host_to_device_gb_per_s:.3g} "
                         f"GB/s to / from the host ({spec.name if spec else 'measured on this machine'}), "
                         + ("hidden behind a neighbouring unit's compute" if link.overlaps_compute else "synchronous"))
        if chunk_tokens:
            notes.append(f"loss: the root's projection {self.loss.projection} and its cross-entropy in chunks of "
                         f"{chunk_tokens} tokens (the logits made again in backward: +{extra_ms:.3f} ms); in a training "
                         "step the model's output holds a stand-in for the logits, computed in full where read")
        elif self.loss.note:
            notes.append(self.loss.note)
        if self.make_optimizer is not None:
            notes.append(f"optimizer.step() counted as torch runs it on {self.device_type}: groups with foreach=True (or "
                         "None, the default, on cuda) with their foreach temporaries, the others with the for-loop step")
        logger.info("FSDP plan: of %d units %d checkpointed whole, %d selectively, %d offloaded, %d with parts, peak "
                    "%s under %s", len(inner), len(chosen["checkpointed"]), len(chosen["selective"]),
                    len(chosen["offloaded"]), len(parts), format_bytes(measured.peak_bytes), format_bytes(budget))
        return FSDPPlan(
            world_size=self.world_size, units=self.unit_names, checkpointed=chosen["checkpointed"],
            selective=chosen["selective"], offloaded=chosen["offloaded"], host_pool_bytes=measured.host_pool_bytes,
            host_pool_limit_bytes=pool_limit, exposed_copy_ms=predicted.exposed_copy_ms,
            selective_peak_bytes=every[UnitDecision.SELECTIVE].peak_bytes,
            selective_step_ms=all_selective.step_ms + extra_ms,
            reshard_after_forward=self.reshard_after_forward, mixed_precision=describe_mp_policy(self.mp_policy),
            budget_bytes=budget, predicted_peak_bytes=measured.peak_bytes, baseline_peak_bytes=baseline.peak_bytes,
            min_feasible_bytes=floor.peak_bytes,
            ranks=tuple(RankFigures(rank=r, peak_bytes=measured.peak_bytes, breakdown=measured.breakdown,
                                    timeline=measured.timeline)
                        for r in range(self.world_size)),
            predicted_step_ms=predicted.step_ms, baseline_step_ms=plain.step_ms, floor_step_ms=full.step_ms + extra_ms,
            exposed_collective_ms=predicted.exposed_collective_ms, interconnect_gb_per_s=gb_per_s,
            optimizer_step_ms=optimizer_ms, checkpointed_parts=chosen["checkpointed_parts"],
            provenance=self.provenance, fingerprint=self.fingerprint, notes=tuple(notes),
            loss_projection=self.loss.projection if chunk_tokens else "", loss_chunk_tokens=chunk_tokens,
        )


def _every(units: Sequence[str], decision: UnitDecision) -> dict[str, UnitOption]:
    """Every one of ``units`` given ``decision`` (a whole-unit one), as the knapsack's options (no estimates)."""
    return {u: UnitOption(decision=decision, freed_bytes=0.0) for u in units}


def _key(decisions: Mapping[str, UnitOption]) -> frozenset:
    """What ``decisions`` do to the model, without their estimates: measurements are shared by it."""
    return frozenset((u, o.key) for u, o in decisions.items() if o.decision is not UnitDecision.KEEP)


def _as_sets(decisions: Mapping[str, UnitOption]) -> dict[str, tuple[str, ...]]:
    """Options per unit as ``shard``'s arguments: checkpointed (whole), selective, offloaded, and the parts
    checkpointed (full module names)."""
    def having(*kinds: UnitDecision) -> tuple[str, ...]:
        return tuple(u for u, o in decisions.items() if o.decision in kinds)

    return {"checkpointed": having(UnitDecision.FULL, UnitDecision.FULL_OFFLOAD),
            "selective": having(UnitDecision.SELECTIVE),
            "offloaded": having(UnitDecision.OFFLOAD, UnitDecision.FULL_OFFLOAD),
            "checkpointed_parts": tuple(f"{u}.{part}" for u, o in decisions.items()
                                        if o.decision is UnitDecision.PARTS for part in o.parts)}


def _unit_options(
    blocks: Sequence[UnitTimes], baseline: RankMemory, every: Mapping[UnitDecision, RankMemory],
    every_part: Mapping[str, RankMemory], link: LinkPrice | None,
) -> dict[str, list[UnitOption]]:
    """Each unit's options but keep: bytes freed estimated as the unit's share of what every unit so treated frees
    (measured): by its saved bytes (or its part's) in the single-device trace for checkpointing, by the slot bytes
    it moved for offloading; time added: its recomputation (whole, selective or the part's forward) and its exposed
    copies (``offload_copy_ms``); pool bytes: the slots it moved."""
    total_saved = sum(u.saved_bytes for u in blocks)
    options: dict[str, list[UnitOption]] = {u.name: [] for u in blocks}
    for name, measured in every_part.items():
        having = [(u, part) for u in blocks if (part := u.part(name)) is not None]
        part_saved = sum(part.saved_bytes for _, part in having)
        for unit, part in having:
            share = part.saved_bytes / part_saved if part_saved else 1.0 / len(having)
            options[unit.name].append(UnitOption(
                decision=UnitDecision.PARTS, parts=(name,), recompute_ms=part.forward_ms,
                freed_bytes=share * (baseline.peak_bytes - measured.peak_bytes),
            ))
    for decision, measured in every.items():
        freed = baseline.peak_bytes - measured.peak_bytes
        moved = {name: (nbytes, storages) for name, nbytes, storages in measured.moved}
        total_moved = sum(b for b, _ in moved.values())
        for unit in blocks:
            if decision in (UnitDecision.OFFLOAD, UnitDecision.FULL_OFFLOAD):
                nbytes, storages = moved.get(unit.name, (0, 0))
                share = nbytes / total_moved if total_moved else 0.0
                copies = (offload_copy_ms(nbytes, storages, link, unit.forward_ms, 2 * unit.forward_ms) if link
                          else 0.0)
            else:
                nbytes, share, copies = 0, unit.saved_bytes / total_saved if total_saved else 0.0, 0.0
            recompute = {UnitDecision.FULL: unit.forward_ms, UnitDecision.FULL_OFFLOAD: unit.forward_ms,
                         UnitDecision.SELECTIVE: unit.selective_recompute_ms}.get(decision, 0.0)
            options[unit.name].append(UnitOption(decision=decision, freed_bytes=share * freed, recompute_ms=recompute,
                                                 copy_ms=copies, pool_bytes=nbytes))
    return options


def _link(spec: Any, timing: Any) -> LinkPrice:
    """The host link offloading is priced over: the priced device's (``priced_device``: the target, or the device
    whose roofline gives the times), else the one measured on this machine (once per planner: every budget's plan is
    priced alike)."""
    priced = priced_device(spec, timing)
    return link_price(priced) if priced is not None else calibrate(torch.device("cpu"), (), link=True).link


def _measure_selective(measure: Callable[..., RankMemory], inner: Sequence[str]) -> RankMemory:
    """Every unit selective, measured; torch's refusal when a unit's recomputation differs from its forward (a
    key/value cache it appended to, a random op) said in plan terms."""
    try:
        return measure(_every(inner, UnitDecision.SELECTIVE))
    except RuntimeError as error:
        if "not found in storage" not in str(error):
            raise
        raise RuntimeError(
            "selective checkpointing of the units failed: a unit's recomputation in backward did not repeat its "
            "forward (it reads state its forward changed, e.g. a key/value cache: give example_kwargs="
            "{'use_cache': False} or set model.config.use_cache = False for a Hugging Face model; or random ops). "
            f"torch said: {str(error).splitlines()[0]}"
        ) from error


def _fit(
    units: list[str], options: Mapping[str, Sequence[UnitOption]], budget: int, baseline: RankMemory,
    floor: RankMemory, floor_decisions: dict[str, UnitOption],
    measure: Callable[[Mapping[str, UnitOption]], RankMemory], pool_limit: int | None,
) -> tuple[dict[str, UnitOption], RankMemory]:
    """The least-time decisions per unit that measure under ``budget``: the multiple-choice knapsack on the
    estimated bytes freed (``_unit_options``), measured; asked again for more while it overshoots; the floor in the
    end (which fits). ``measure`` keeps what it measured (``FSDPPlanner.measure``)."""
    if baseline.peak_bytes <= budget:
        return {}, baseline
    if baseline.peak_bytes <= floor.peak_bytes:  # nothing to go by: the floor, which fits
        return floor_decisions, floor
    need, at_least = float(baseline.peak_bytes - budget), 0.0
    while True:
        choice = cheapest_choice(units, options, need, at_least_bytes=at_least, pool_limit_bytes=pool_limit)
        if choice is None or _key(choice) == _key(floor_decisions):  # nothing more to ask for: the floor
            return floor_decisions, floor
        measured = measure(choice)
        if measured.peak_bytes <= budget and (pool_limit is None or measured.host_pool_bytes <= pool_limit):
            return choice, measured
        need += max(measured.peak_bytes - budget, 1)  # the overshoot, taken off the next answer
        at_least = sum(o.freed_bytes for o in choice.values())


def _check_mp_policy(mp_policy: Any) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, got {describe_value(mp_policy)}"
        )


def _optimizer_factory(optimizer: Any) -> Callable[[list], Any] | None:
    if optimizer is None:
        return None
    if isinstance(optimizer, str):  # a name PlanOptions checked ("none" is None there)
        return named_optimizer(optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer: give a function making one from the sharded parameters (e.g. torch.optim.AdamW or "
            f"functools.partial(torch.optim.AdamW, lr=...)), not an instance ({type(optimizer).__name__}): FSDP "
            "shards the parameters, so the optimizer is made over the sharded ones"
        )
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a name, None or a callable, got {describe_value(optimizer)}")
    return optimizer


def _step_loss(loss_fn: Any, example_target: Any) -> Callable[[Any, Any], torch.Tensor]:
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {describe_value(loss_fn)}")
    if example_target is not None and loss_fn is None:
        raise ValueError(
            "example_target was given without loss_fn: give loss_fn(output, target) (e.g. "
            "lambda logits, target: F.cross_entropy(logits.flatten(0, 1), target.flatten()))"
        )
    if loss_fn is None:
        plain = checked_loss(default_loss)
        return lambda output, target: plain(output)
    if example_target is None:
        checked = checked_loss(loss_fn)
        return lambda output, target: checked(output)
    return lambda output, target: checked_loss(lambda out: loss_fn(out, target))(output)
