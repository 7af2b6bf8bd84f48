"""One rank's sharded training step, measured in this process for a world of N ranks: torch's fake process group
(``torch.testing._internal.distributed.fake_pg``), a copy of the model on the meta device sharded by
``fully_shard`` on a 1-D mesh of N, made fake by ``to_empty`` under ``FakeTensorMode``, the optimizer's states made by a
step on zero gradients, then one training step (the loop's second) under ``FSDPMemTracker``, whose peak and breakdown
by its categories are read: the second step peaks at least as high as the first, which holds the same bytes but the
states, and measuring it alone takes half the time of both (the same figures, to the byte, on the test decoders with
and without mixed precision, foreach and checkpointing).

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
) -> RankMemory:
    """Rank 0's peak over a training step (the loop's second: the optimizer's states made) of ``model`` sharded over
    ``world_size`` ranks, the ``checkpointed`` units under checkpoint, the ``selective`` ones under selective
    checkpoint, the ``checkpointed_parts`` (modules inside kept units) each under checkpoint, the ``offloaded`` ones in
    a host pool (autockpt's own, measuring fakes: ``HostPool(fake_tensors=True)``, as large as they need).
    ``inputs``: (args, kwargs, target), one rank's batch (real or meta tensors: the step runs on fakes of them);
    ``step_loss(output, target)`` the loss; ``device_type``: the device the ranks will run on ("cuda", "cpu"), whose
    default decides whether the optimizer steps with its foreach implementation; ``loss_chunk``: (the root's
    projection, chunk tokens) whose loss runs in chunks (``runtime/logits_standin.py``), or None. Runs inside
    ``fake_world(world_size)``.

    The sharded step runs the optimizer's for-loop implementation (``foreach=False``; fused kept): under
    FakeTensorMode, ``FSDPMemTracker`` never sees the foreach implementation's temporaries of DTensor parameters freed
    (torch 2.13: 208 MB of optimizer states where real tensors hold 104 MB, 4 blocks of width 512 at world 1). Where
    a parameter group steps with foreach (``foreach=True``, or None, torch's default, on CUDA), each step is priced
    once more as the bytes live when it starts plus what a foreach step adds over that (its states on the first step,
    its temporaries), measured on plain fake tensors of the local shards' shapes (``_foreach_step_bytes``: tracked
    exactly); the peak is the larger of the two."""
    arguments = {"world_size": world_size, "units": units, "checkpointed": checkpointed,
                 "reshard_after_forward": reshard_after_forward, "mp_policy": mp_policy, "inputs": inputs,
                 "step_loss": step_loss, "make_optimizer": make_optimizer, "selective": selective,
                 "offloaded": offloaded, "device_type": device_type, "checkpointed_parts": checkpointed_parts,
                 "loss_chunk": loss_chunk}
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
    loss_chunk: tuple[str, int] | None,
) -> RankMemory:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh

    device = "cpu"
    mesh = init_device_mesh(device, (world_size,))  # outside FakeTensorMode
    sharded = shard(meta_copy(model), units, checkpointed, mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=mp_policy, selective=selective, offloaded=offloaded,
                    host_pool_bytes=_UNBOUNDED_POOL_BYTES, fake_tensors=True, checkpointed_parts=checkpointed_parts,
                    loss_chunk=loss_chunk)
    with FakeTensorMode(allow_non_fake_inputs=True):
        sharded.to_empty(device=device)
        args, kwargs, target = pytree.tree_map_only(
            torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device=device), inputs
        )
        params = [p for p in sharded.parameters() if p.requires_grad]
        optimizer, foreach = _optimizer_with_states(make_optimizer, params, device_type)
        starts: dict[str, int] = {}  # what is live as the measured optimizer.step() starts, by category
        tracker = FSDPMemTracker(sharded, optimizer)
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
            if optimizer is not None:  # the last thing measured: no gradients to clear after it
                starts = _by_category(tracker.get_tracker_snapshot("current")[torch.device(device)])
                optimizer.step()
        snapshot = _by_category(tracker.get_tracker_snapshot("peak")[torch.device(device)])
        timeline = _timeline(tracker, sharded, units, torch.device(device))
        during: list[dict[str, int]] = []  # each foreach step at its peak
        if any(foreach):
            # the first step starts with what the second does but the states, which it makes
            first = {**starts, "OptState": 0}
            for start, added in zip((first, starts), _foreach_step_bytes(make_optimizer, params, foreach)):
                during.append({**start, **{k: start.get(k, 0) + v for k, v in added.items() if v}})
            snapshot = max([snapshot, *during], key=lambda bytes_by: sum(bytes_by.values()))
    step_start = tuple(starts.items())
    step_foreach_peak = tuple(during[-1].items()) if during else ()
    timeline += [TimelinePoint(label=label, breakdown=point) for label, point in
                 (("optimizer.step() starts", step_start), ("optimizer.step() peak (foreach)", step_foreach_peak))
                 if point]
    breakdown = tuple(snapshot.items())
    peak = sum(snapshot.values())
    logger.debug("world %d, %d of %d units checkpointed, %d selective, %d offloaded, %d parts: rank peak %d B",
                 world_size, len(checkpointed), len(units), len(selective), len(offloaded), len(checkpointed_parts),
                 peak)
    pool = unit_pool(sharded)
    figures = {"peak_bytes": peak, "breakdown": breakdown, "timeline": tuple(timeline), "step_start": step_start,
               "step_foreach_peak": step_foreach_peak}
    if pool is None:
        return RankMemory(**figures)
    moved = {name: [0, 0] for name in offloaded}
    for slot in pool.step_slots():  # the measured step's: the same in every step
        moved[units[slot.region_index]][0] += slot.slot_bytes
        moved[units[slot.region_index]][1] += 1
    return RankMemory(**figures, host_pool_bytes=pool.stats().peak_occupancy_bytes,
                      moved=tuple((name, b, n) for name, (b, n) in moved.items()))


def _optimizer_with_states(make_optimizer: Callable[[list], Any] | None, params: list[torch.Tensor],
                           device_type: str) -> tuple[Any, list[bool]]:
    """The optimizer over the sharded ``params``, stepping with its for-loop implementation (``measure_sharded_step``
    says why), with the states a first step makes, and per parameter group whether the ranks step it with foreach on
    ``device_type`` (``_foreach_groups``). The states are made by a step on zero gradients, without a forward or
    backward (they would be half a measurement's time): the step measured is the loop's second, which peaks at least
    as high as its first (the same bytes, the states too). No ``make_optimizer``: (None, [])."""
    if make_optimizer is None:
        return None, []
    optimizer = make_optimizer(params)
    foreach = _foreach_groups(optimizer, device_type)
    for group in optimizer.param_groups:
        if not group.get("fused"):
            group["foreach"] = False
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad()
    return optimizer, foreach


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


def _foreach_step_bytes(make_optimizer: Callable[[list], Any], params: Sequence[torch.Tensor],
                        foreach: Sequence[bool]) -> list[dict[str, int]]:
    """What each of two foreach ``optimizer.step()`` calls adds at its peak over the bytes live when it starts, by
    ``FSDPMemTracker``'s categories ("OptState": the states made on the first step and the temporaries): the
    optimizer ``make_optimizer`` makes over plain fake tensors of the sharded parameters' local shapes, each given a
    gradient, its groups foreach as ``foreach`` says, measured by a ``MemTracker`` per step (it sees plain fakes
    freed). Under the caller's FakeTensorMode."""
    from torch.distributed._tools.mem_tracker import MemTracker

    shards = [nn.Parameter(torch.empty(p.to_local().shape if hasattr(p, "to_local") else p.shape, dtype=p.dtype,
                                       device=p.device)) for p in params]
    optimizer = make_optimizer(shards)
    for group, uses_foreach in zip(optimizer.param_groups, foreach):
        if not group.get("fused"):
            group["foreach"] = uses_foreach
    added = []
    for _ in range(2):
        for shard_ in shards:
            shard_.grad = torch.empty_like(shard_)
        tracker = MemTracker()
        tracker.track_external(*shards, optimizer)
        with tracker:
            device = shards[0].device
            start = _by_category(tracker.get_tracker_snapshot("current")[device])
            optimizer.step()
            peak = _by_category(tracker.get_tracker_snapshot("peak")[device])
        optimizer.zero_grad()
        step_added: dict[str, int] = {}
        for category, nbytes in peak.items():
            name = _AS_FSDP_CATEGORY.get(category, category)
            step_added[name] = step_added.get(name, 0) + nbytes - start.get(category, 0)
        added.append(step_added)
    return added
