"""One rank's sharded training step, measured in this process for a world of N ranks: torch's fake process group
(``torch.testing._internal.distributed.fake_pg``), a copy of the model on the meta device sharded by
``fully_shard`` on a 1-D mesh of N, made fake by ``to_empty`` under ``FakeTensorMode``, two training steps (the first
makes the optimizer's states) under ``FSDPMemTracker``, whose peak and breakdown by its categories are read.

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
from autockpt.fsdp.shard import shard

logger = logging.getLogger(__name__)


_UNBOUNDED_POOL_BYTES = 2**62  # the fake world's pool: a meta buffer, as large as the units need


@dataclass(frozen=True, kw_only=True, slots=True)
class RankMemory:
    """One rank's measured peak and what it held then, by ``FSDPMemTracker``'s categories (bytes)."""

    peak_bytes: int
    breakdown: tuple[tuple[str, int], ...]  # ("Sharded Param", bytes), ("Activation", bytes), ...
    host_pool_bytes: int = 0  # the host pool one step needs (slot bytes), when units were offloaded
    moved: tuple[tuple[str, int, int], ...] = ()  # per offloaded unit: (name, slot bytes, storages moved)


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
    selective: Sequence[str] = (), offloaded: Sequence[str] = (),
) -> RankMemory:
    """Rank 0's peak over two training steps of ``model`` sharded over ``world_size`` ranks, the ``checkpointed``
    units under checkpoint, the ``selective`` ones under selective checkpoint, the ``offloaded`` ones in a host pool
    (autockpt's own, measuring fakes: ``HostPool(fake_tensors=True)``, as large as they need). ``inputs``: (args,
    kwargs, target), one rank's batch (real or meta tensors: the step runs on fakes of them); ``step_loss(output,
    target)`` the loss. Runs inside ``fake_world(world_size)``.

    The optimizer steps with its for-loop implementation (``foreach=False``; fused kept): under FakeTensorMode,
    ``FSDPMemTracker`` never sees the foreach implementation's temporaries freed (torch 2.13: 130 MB of optimizer
    states where real tensors hold 17 MB, 4 blocks of width 512 at world 4), which would swamp every other figure.
    Foreach's temporaries (at most about the states' size, during ``optimizer.step()``) are therefore not counted."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh

    device = "cpu"
    mesh = init_device_mesh(device, (world_size,))  # outside FakeTensorMode
    sharded = shard(meta_copy(model), units, checkpointed, mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=mp_policy, selective=selective, offloaded=offloaded,
                    host_pool_bytes=_UNBOUNDED_POOL_BYTES, fake_tensors=True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        sharded.to_empty(device=device)
        args, kwargs, target = pytree.tree_map_only(
            torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device=device), inputs
        )
        params = [p for p in sharded.parameters() if p.requires_grad]
        optimizer = make_optimizer(params) if make_optimizer is not None else None
        if optimizer is not None:
            for group in optimizer.param_groups:
                if not group.get("fused"):
                    group["foreach"] = False
        tracker = FSDPMemTracker(sharded, optimizer)
        tracker.track_inputs((args, kwargs, target))
        with tracker:
            for step in range(2):
                step_loss(sharded(*args, **kwargs), target).backward()
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad()
                else:
                    sharded.zero_grad()
                if step == 0:
                    tracker.reset_mod_stats()  # per-module stats only: the peak covers both steps
        snapshot = tracker.get_tracker_snapshot("peak")[torch.device(device)]
    breakdown = tuple((getattr(key, "value", str(key)), int(value)) for key, value in snapshot.items()
                      if key != "Total")
    peak = int(snapshot["Total"])
    logger.debug("world %d, %d of %d units checkpointed, %d selective, %d offloaded: rank peak %d B", world_size,
                 len(checkpointed), len(units), len(selective), len(offloaded), peak)
    pool = unit_pool(sharded)
    if pool is None:
        return RankMemory(peak_bytes=peak, breakdown=breakdown)
    moved = {name: [0, 0] for name in offloaded}
    for slot in pool.step_slots():  # the second step's: the same as the first's
        moved[units[slot.region_index]][0] += slot.slot_bytes
        moved[units[slot.region_index]][1] += 1
    return RankMemory(peak_bytes=peak, breakdown=breakdown, host_pool_bytes=pool.stats().peak_occupancy_bytes,
                      moved=tuple((name, b, n) for name, (b, n) in moved.items()))
