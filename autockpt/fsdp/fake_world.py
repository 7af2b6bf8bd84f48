"""One rank's sharded training step, measured in this process for a world of N ranks: torch's fake process group
(``torch.testing._internal.distributed.fake_pg``), a copy of the model on the meta device sharded by
``fully_shard`` on a 1-D mesh of N, made fake by ``to_empty`` under ``FakeTensorMode``, then its forward and backward
under ``FSDPMemTracker``, whose peak and breakdown by its categories are read. The optimizer's steps are added from
``OptimizerSteps``: what its first two ``optimizer.step()`` calls make and leave, measured once per model on plain fakes
of the shards (they touch the parameters, their gradients and the states only: the same under every decision). The
figures are the loop's second step's (its states live throughout), which peaks at least as high as the first.

No real tensor is made and no collective runs: the fake process group completes every collective at once and every
rank sees rank 0's view. FSDP2 pads every rank's shard to rank 0's size (``_fsdp_param.py``: the sharded parameter's
storage is ``padded_sharded_param_size``, "0th always padded", and the all-gather and reduce-scatter buffers are
padded alike), so parameters, gradients, all-gather and reduce-scatter bytes are equal on every rank; what is made
from the unpadded local shard (the optimizer's states, ``zeros_like`` of it) is largest on rank 0, whose chunk is the
largest. Rank 0's figures are therefore every rank's, or an upper bound of them (by less than one row of each
parameter per rank).

The default process group must be the fake one while measuring: planning refuses to run in a process where a real
process group is initialised (plan before ``init_process_group``, or in one process, save the plan and load it on the
ranks); a fake group made here is destroyed afterwards, one that existed before is left.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from autockpt.fsdp.offload import unit_pool
from autockpt.fsdp.shard import ROOT, shard
from autockpt.measure.eager_paths import ValueReads, eager_library_paths, is_data_dependent_error, recorded_reads
from autockpt.records.fsdp_plan import TimelinePoint

logger = logging.getLogger(__name__)


_UNBOUNDED_POOL_BYTES = 2**62  # the fake world's pool: a meta buffer, as large as the units need


@dataclass(frozen=True, kw_only=True, slots=True)
class RankMemory:
    """One rank's measured peak and what it held then, by ``FSDPMemTracker``'s categories (bytes)."""

    peak_bytes: int
    breakdown: tuple[tuple[str, int], ...]  # ("Sharded Param", bytes), ("Activation", bytes), ...
    host_pool_bytes: int = 0  # the host pool one step needs (slot bytes), when units were offloaded
    moved: tuple[tuple[str, int, int], ...] = ()  # per offloaded unit: (name, slot bytes, storages moved)
    timeline: tuple[TimelinePoint, ...] = ()  # the measured step at the units' boundaries (``_timeline``)
    # the second optimizer.step(): what is live as it starts, and at its foreach peak (empty: no step, or no foreach)
    step_start: tuple[tuple[str, int], ...] = ()
    step_foreach_peak: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSteps:
    """The optimizer's first two ``optimizer.step()`` calls on one rank's shards, by ``FSDPMemTracker``'s categories
    (``_optimizer_steps``): the same whatever is checkpointed or offloaded, so measured once per model."""

    states: tuple[tuple[str, int], ...]  # what the first step leaves: its states, live from then on
    first_added: tuple[tuple[str, int], ...]  # the first step's peak over the bytes live as it starts
    second_added: tuple[tuple[str, int], ...]  # the second step's peak over the bytes live as it starts
    foreach: bool  # some parameter group steps with the foreach implementation on the ranks' device


def existing_fake_group(world_size: int) -> bool:
    """True when the fake process group of ``world_size`` ranks is already the default group, False when there is
    none; a real process group, or a fake one of another size, is refused (planning is called before the step is
    traced, so the refusal comes at once)."""
    if not dist.is_initialized():
        return False
    backend = str(dist.get_backend())
    if backend != "fake":
        raise RuntimeError(
            f"a real process group ({backend}, world size {dist.get_world_size()}) is initialised in this "
            "process; plan_fsdp measures ranks on torch's fake process group, which must be the default one. "
            "Plan before init_process_group (or in one process: fplan.save(path), then "
            "autockpt.load_fsdp_plan(path) on every rank)"
        )
    if dist.get_world_size() != world_size:
        raise RuntimeError(
            f"a fake process group of world size {dist.get_world_size()} is already initialised; planning for "
            f"world size {world_size} needs its own: destroy it first (dist.destroy_process_group())"
        )
    return True


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """The fake process group of ``world_size`` ranks as the default group, for the block's duration (made and
    destroyed here unless it existed before)."""
    if existing_fake_group(world_size):
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (the model is not touched; shared
    parameters stay shared)."""
    from autockpt.measure.fake_copy import fake_copies

    def to_meta(tensor: torch.Tensor) -> torch.Tensor:
        made = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            return nn.Parameter(made, requires_grad=tensor.requires_grad)
        return made

    (copied,), _ = fake_copies((model,), (), to_meta, {}, [])
    return copied


def measure_sharded_step(
    model: nn.Module, *, world_size: int, units: Sequence[str], checkpointed: Sequence[str],
    reshard_after_forward: bool, mp_policy: Any, inputs: Any,
    step_loss: Callable[[Any, Any], torch.Tensor], make_optimizer: Callable[[list], Any] | None,
    selective: Sequence[str] = (), offloaded: Sequence[str] = (), device_type: str = "cpu",
    checkpointed_parts: Sequence[str] = (), loss_chunk: tuple[str, int] | None = None,
    optimizer_steps: OptimizerSteps | None = None,
) -> RankMemory:
    """Rank 0's peak over a training step (the loop's second: the optimizer's states made) of ``model`` sharded over
    ``world_size`` ranks, the ``checkpointed`` units under checkpoint, the ``selective`` ones under selective
    checkpoint, the ``checkpointed_parts`` (modules inside kept units) each under checkpoint, the ``offloaded`` ones in
    a host pool (autockpt's own, measuring fakes: ``HostPool(fake_tensors=True)``, as large as they need).
    ``inputs``: (args, kwargs, target), one rank's batch (real or meta tensors: the step runs on fakes of them);
    ``step_loss(output, target)`` the loss; ``device_type``: the device the ranks will run on ("cuda", "cpu"), whose
    default decides whether the optimizer steps with its foreach implementation; ``loss_chunk``: (the root's
    projection, chunk tokens) whose loss runs in chunks (``runtime/logits_standin.py``), or None;
    ``optimizer_steps``: ``make_optimizer``'s steps on this model's shards (``measure_optimizer_steps``), measured here
    when not given. Runs inside ``fake_world(world_size)``.

    The optimizer's steps are priced as the bytes live when each starts (after backward; the states on the second)
    plus what it adds at its peak, measured on plain fake tensors of the local shards' shapes, each group with the
    implementation the ranks run (``_optimizer_steps``): under FakeTensorMode, ``FSDPMemTracker`` never sees the
    foreach implementation's temporaries of DTensor parameters freed (torch 2.13: 208 MB of optimizer states where real
    tensors hold 104 MB, 4 blocks of width 512 at world 1). The peak is the largest of the forward and backward's (the
    states added) and the two steps'."""
    arguments = {"world_size": world_size, "units": units, "checkpointed": checkpointed,
                 "reshard_after_forward": reshard_after_forward, "mp_policy": mp_policy, "inputs": inputs,
                 "step_loss": step_loss, "make_optimizer": make_optimizer, "selective": selective,
                 "offloaded": offloaded, "device_type": device_type, "checkpointed_parts": checkpointed_parts,
                 "loss_chunk": loss_chunk, "optimizer_steps": optimizer_steps}
    # the eager model's course, as on the ranks (a library seeing fake tensors would mask and repeat instead)
    args, kwargs, _ = inputs
    reads = recorded_reads(model, args, kwargs)
    if reads is not None:
        try:
            with eager_library_paths():
                return _measure_sharded_step(model, ValueReads(reads), **arguments)
        except Exception as error:
            if not is_data_dependent_error(error):
                raise
            logger.info("the eager course reads values a fake step does not have: the traced course is measured "
                        "instead (%s)", error)
    else:
        logger.info("a model or batch without values (meta): its traced course is measured, which may differ from "
                    "the eager one where the eager course reads values (masks, packed positions)")
    return _measure_sharded_step(model, None, **arguments)


def _measure_sharded_step(
    model: nn.Module, reads: ValueReads | None, *, world_size: int, units: Sequence[str], checkpointed: Sequence[str],
    reshard_after_forward: bool, mp_policy: Any, inputs: Any,
    step_loss: Callable[[Any, Any], torch.Tensor], make_optimizer: Callable[[list], Any] | None,
    selective: Sequence[str], offloaded: Sequence[str], device_type: str, checkpointed_parts: Sequence[str],
    loss_chunk: tuple[str, int] | None, optimizer_steps: OptimizerSteps | None,
) -> RankMemory:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    device = "cpu"
    sharded = _fake_sharded(model, world_size, units, checkpointed, reshard_after_forward, mp_policy,
                            selective=selective, offloaded=offloaded, checkpointed_parts=checkpointed_parts,
                            loss_chunk=loss_chunk)
    with FakeTensorMode(allow_non_fake_inputs=True):
        sharded.to_empty(device=device)
        args, kwargs, target = pytree.tree_map_only(
            torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device=device), inputs
        )
        if make_optimizer is not None and optimizer_steps is None:
            optimizer_steps = _optimizer_steps(make_optimizer, _trained(sharded), device_type)
        tracker = FSDPMemTracker(sharded)  # no optimizer: its steps are ``optimizer_steps``
        tracker.track_inputs((args, kwargs, target))
        copies = gloo_reduce_scatter_copies() if device_type == "cpu" and world_size > 1 else contextlib.nullcontext()
        with tracker, copies:
            # the forward's reads of values answered as the real model read them (``ValueReads``)
            with reads.replayed() if reads is not None else contextlib.nullcontext():
                output = sharded(*args, **kwargs)
            loss = step_loss(output, target)
            del output  # as in the one-expression step: the output lives on only where backward saved it
            loss.backward()
            del loss
            after_backward = _by_category(tracker.get_tracker_snapshot("current")[torch.device(device)])
        snapshot = _by_category(tracker.get_tracker_snapshot("peak")[torch.device(device)])
        timeline = _timeline(tracker, sharded, units, torch.device(device))
    step_start: dict[str, int] = {}  # what is live as the second optimizer.step() starts, by category
    step_foreach_peak: dict[str, int] = {}
    if optimizer_steps is not None:
        states = dict(optimizer_steps.states)  # live through the loop's second step, which is the one measured
        snapshot, timeline = _added(snapshot, states), [_point_with(point, states) for point in timeline]
        step_start = _added(after_backward, states)
        during = [_added(after_backward, dict(optimizer_steps.first_added)),  # the first step makes the states
                  _added(step_start, dict(optimizer_steps.second_added))]
        snapshot = max([snapshot, *during], key=lambda bytes_by: sum(bytes_by.values()))
        step_foreach_peak = during[-1] if optimizer_steps.foreach else {}
    timeline += [TimelinePoint(label=label, breakdown=tuple(point.items())) for label, point in
                 (("optimizer.step() starts", step_start), ("optimizer.step() peak (foreach)", step_foreach_peak))
                 if point]
    breakdown = tuple(snapshot.items())
    peak = sum(snapshot.values())
    logger.debug("world %d, %d of %d units checkpointed, %d selective, %d offloaded, %d parts: rank peak %d B",
                 world_size, len(checkpointed), len(units), len(selective), len(offloaded), len(checkpointed_parts),
                 peak)
    pool = unit_pool(sharded)
    figures = {"peak_bytes": peak, "breakdown": breakdown, "timeline": tuple(timeline),
               "step_start": tuple(step_start.items()), "step_foreach_peak": tuple(step_foreach_peak.items())}
    if pool is None:
        return RankMemory(**figures)
    moved = {name: [0, 0] for name in offloaded}
    for slot in pool.step_slots():  # the measured step's: the same in every step
        moved[units[slot.region_index]][0] += slot.slot_bytes
        moved[units[slot.region_index]][1] += 1
    return RankMemory(**figures, host_pool_bytes=pool.stats().peak_occupancy_bytes,
                      moved=tuple((name, b, n) for name, (b, n) in moved.items()))


def _fake_sharded(model: nn.Module, world_size: int, units: Sequence[str], checkpointed: Sequence[str],
                  reshard_after_forward: bool, mp_policy: Any, **decisions: Any) -> nn.Module:
    """A meta copy of ``model`` sharded over the fake world of ``world_size`` ranks under the decisions given (its
    offloaded units in a fake host pool as large as they need)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))  # outside FakeTensorMode
    return shard(meta_copy(model), units, checkpointed, mesh, reshard_after_forward=reshard_after_forward,
                 mp_policy=mp_policy, host_pool_bytes=_UNBOUNDED_POOL_BYTES, fake_tensors=True, **decisions)


def _trained(sharded: nn.Module) -> list[torch.Tensor]:
    return [p for p in sharded.parameters() if p.requires_grad]


def measure_optimizer_steps(
    model: nn.Module, *, world_size: int, units: Sequence[str], reshard_after_forward: bool, mp_policy: Any,
    make_optimizer: Callable[[list], Any], device_type: str = "cpu",
) -> OptimizerSteps:
    """``make_optimizer``'s first two steps on rank 0's shards of ``model`` (``measure_sharded_step``'s arguments),
    measured once for every decision's step. Runs inside ``fake_world(world_size)``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    sharded = _fake_sharded(model, world_size, units, (), reshard_after_forward, mp_policy)
    with FakeTensorMode(allow_non_fake_inputs=True):
        sharded.to_empty(device="cpu")
        return _optimizer_steps(make_optimizer, _trained(sharded), device_type)


def _added(bytes_by: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """Bytes by category, ``more``'s added (its categories in ``bytes_by``'s order, new ones after)."""
    return {**bytes_by, **{k: bytes_by.get(k, 0) + v for k, v in more.items() if v}}


def _point_with(point: TimelinePoint, more: dict[str, int]) -> TimelinePoint:
    return TimelinePoint(label=point.label, breakdown=tuple(_added(dict(point.breakdown), more).items()))


@contextlib.contextmanager
def gloo_reduce_scatter_copies() -> Iterator[None]:
    """FSDP2's reduce-scatters as gloo runs them, for ranks on CPU: gloo copies the input during the (synchronous)
    call (``experiments/probes/probe_gloo_reduce_scatter.py``: 16,777,216 B allocated for as large an input), which
    the fake process group does not; a peak at a reduce-scatter (a unit's gradients, the root's last) is otherwise
    under-predicted by that copy (issue 48: 4.8 % at a chunked loss's floor). NCCL's collectives allocate nothing
    through PyTorch's allocator: not applied for CUDA ranks."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    original = DefaultReduceScatter.__call__

    def with_copy(self: Any, output_tensor: torch.Tensor, input_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        copied = torch.empty_like(input_tensor)  # noqa: F841  held for the call, as gloo holds its copy
        return original(self, output_tensor, input_tensor, *args, **kwargs)

    DefaultReduceScatter.__call__ = with_copy  # type: ignore[method-assign]
    try:
        yield
    finally:
        DefaultReduceScatter.__call__ = original  # type: ignore[method-assign]


def _by_category(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot of one device by category name, without its total."""
    return {getattr(key, "value", str(key)): int(value) for key, value in snapshot.items() if key != "Total"}


# the moments of a unit the timeline shows, by FSDPMemTracker's states: after FSDP2's pre-hook (parameters gathered),
# the unit's peak, after its post-hook
_FORWARD_MOMENTS = (("Before Pre-Forward", "forward starts"), ("After Pre-Forward", "forward, gathered"),
                    ("Peak Forward", "forward peak"), ("After Post-Forward", "forward ends"))
_BACKWARD_MOMENTS = (("After Pre-Backward", "backward, gathered"), ("Peak Backward", "backward peak"),
                     ("After Post-Backward", "backward ends"))


def _timeline(tracker: Any, sharded: nn.Module, units: Sequence[str], device: torch.device) -> list[TimelinePoint]:
    """The last step ``tracker`` saw at the units' boundaries, in the order they run: the root's forward start,
    each inner unit's forward moments in order, the root's forward end; the root's backward start, the inner units'
    backward moments in reverse, the root's backward end (its peaks span the others' and are left out)."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModState

    modules = dict(sharded.named_modules())
    inner = [u for u in units if u != ROOT]

    def point(unit: str, state: str, label: str) -> TimelinePoint | None:
        stats = tracker.memory_tracking.get(modules[unit])
        taken = stats.snapshots.get(_FSDPModState(state)) if stats is not None else None
        if not taken or device not in taken[-1]:
            return None
        return TimelinePoint(label=f"{unit or '(root)'} {label}",
                             breakdown=tuple(_by_category(taken[-1][device]).items()))

    moments = [(ROOT, *_FORWARD_MOMENTS[1])]
    moments += [(unit, *moment) for unit in inner for moment in _FORWARD_MOMENTS]
    moments += [(ROOT, *_FORWARD_MOMENTS[3]), (ROOT, *_BACKWARD_MOMENTS[0])]
    moments += [(unit, *moment) for unit in reversed(inner) for moment in _BACKWARD_MOMENTS]
    moments += [(ROOT, *_BACKWARD_MOMENTS[2])]
    return [p for p in (point(*moment) for moment in moments) if p is not None]


# MemTracker's categories as FSDPMemTracker names them; FSDPMemTracker counts what optimizer.step() makes as OptState
_AS_FSDP_CATEGORY = {"Parameter": "Sharded Param", "Gradient": "Sharded Grad", "Optstate": "OptState",
                     "Temp": "OptState"}


def _foreach_groups(optimizer: Any, device_type: str) -> list[bool]:
    """Per parameter group, whether it steps with the foreach implementation on ``device_type``'s tensors: its
    ``foreach`` True, or None (torch's default) on CUDA, where torch picks foreach for the tensors it supports
    (DTensor included); never a fused group, or an optimizer without the option."""
    return [not group.get("fused") and (group.get("foreach", False) is True
                                        or (group.get("foreach", False) is None and device_type == "cuda"))
            for group in optimizer.param_groups]


def _optimizer_steps(make_optimizer: Callable[[list], Any], params: Sequence[torch.Tensor],
                     device_type: str) -> OptimizerSteps:
    """What each of two ``optimizer.step()`` calls adds at its peak over the bytes live when it starts, and the states
    the first leaves, by ``FSDPMemTracker``'s categories ("OptState": the states and the temporaries): the optimizer
    ``make_optimizer`` makes over plain fake tensors of the sharded parameters' local shapes, each given a gradient,
    its groups stepping as torch steps them on ``device_type`` (``_foreach_groups``; fused kept), measured by a
    ``MemTracker`` per step (it sees plain fakes freed, the foreach temporaries too). Under the caller's
    FakeTensorMode."""
    from torch.distributed._tools.mem_tracker import MemTracker

    shards = [nn.Parameter(torch.empty(p.to_local().shape if hasattr(p, "to_local") else p.shape, dtype=p.dtype,
                                       device=p.device)) for p in params]
    optimizer = make_optimizer(shards)
    foreach = _foreach_groups(optimizer, device_type)
    for group, uses_foreach in zip(optimizer.param_groups, foreach):
        if not group.get("fused"):
            group["foreach"] = uses_foreach
    added, states = [], {}
    for step in range(2):
        for shard_ in shards:
            shard_.grad = torch.empty_like(shard_)
        tracker = MemTracker()
        # the gradients too: untracked, MemTracker counts one as a state where a step copies it (SGD's momentum)
        tracker.track_external(*shards, *(shard_.grad for shard_ in shards), optimizer)
        with tracker:
            device = shards[0].device
            start = _by_category(tracker.get_tracker_snapshot("current")[device])
            optimizer.step()
            peak = _by_category(tracker.get_tracker_snapshot("peak")[device])
            if step == 0:
                states = _as_fsdp_categories(_by_category(tracker.get_tracker_snapshot("current")[device]), start)
        optimizer.zero_grad()
        added.append(_as_fsdp_categories(peak, start))
    return OptimizerSteps(states=tuple(states.items()), first_added=tuple(added[0].items()),
                          second_added=tuple(added[1].items()), foreach=any(foreach))


def _as_fsdp_categories(bytes_by: dict[str, int], start: dict[str, int]) -> dict[str, int]:
    """``MemTracker``'s bytes by category over ``start``'s, by ``FSDPMemTracker``'s category names."""
    over: dict[str, int] = {}
    for category, nbytes in bytes_by.items():
        name = _AS_FSDP_CATEGORY.get(category, category)
        over[name] = over.get(name, 0) + nbytes - start.get(category, 0)
    return over
