"""Offloading FSDP units: what a unit saves for backward moved into autockpt's host pool (``runtime/offload.py``)
between its forward and its backward, on every rank.

An offloaded unit's forward runs inside ``HostPool.offloading(region)``, outside its checkpoint if it has one, and
inside FSDP2's hooks (which ``fully_shard`` puts on the module's ``__call__``, not on ``forward``): so the all-gathered
parameters are not moved (the pool keeps parameters and views of them), a unit kept whole moves its activations, and
a unit also checkpointed whole moves only its inputs, which torch's non-reentrant checkpoint saves through the
saved-tensor hooks in effect (``_CheckpointFrame.save_inputs``) while its own hooks, innermost, hold the rest.

Regions are the offloaded units' positions among the units, in forward order; in backward the pool restores one
region ahead of the one being unpacked. One pool per model (``UnitPool``), of the plan's ``host_pool_bytes``, made at
the first forward on the device of the step's first input tensor (a model applied on the meta device gets its real
device later, from ``to_empty``). A forward pre-hook on the root, after FSDP2's own, starts every step
(``begin_step``) with the step's inputs and the model's buffers kept where they are. On CUDA the pool is pinned host
memory; on the CPU (gloo tests) it is a second CPU buffer, which a tracker of the CPU's bytes counts and the tests
take off.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autockpt.runtime.offload import HostPool

logger = logging.getLogger(__name__)

_POOL = "_autockpt_unit_pool"  # on the root: its UnitPool
_OFFLOADED = "_autockpt_offloaded_region"  # on an offloaded unit: its region index


class UnitPool:
    """The model's host pool, made at the first forward (``fake_tensors``: for the planner's fake world)."""

    def __init__(self, capacity_bytes: int, *, fake_tensors: bool = False) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self.fake_tensors = fake_tensors
        self.pool: HostPool | None = None

    def begin_step(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if self.pool is None:
            device = inputs[0].device if inputs else next(module.parameters()).device
            self.pool = HostPool(self.capacity_bytes, device, fake_tensors=self.fake_tensors)
            logger.debug("FSDP host pool of %d bytes on %s", self.capacity_bytes, device)
        self.pool.begin_step(kept=[*inputs, *module.buffers()])

    @contextlib.contextmanager
    def offloading(self, region_index: int) -> Iterator[None]:
        if self.pool is None:
            raise RuntimeError(
                "an offloaded FSDP unit ran before the model's first forward: call the root module (the model "
                "apply_fsdp returned), not one of its units alone"
            )
        with self.pool.offloading(region_index):
            yield


def offload_units(model: nn.Module, units: list[str], offloaded: list[str], capacity_bytes: int, *,
                  fake_tensors: bool = False) -> UnitPool:
    """Patch the ``offloaded`` units' forward to run in the model's pool (made here, of ``capacity_bytes``); call
    ``start_steps`` after ``fully_shard`` on the root."""
    modules = dict(model.named_modules())
    holder = UnitPool(capacity_bytes, fake_tensors=fake_tensors)
    for name in offloaded:
        module, region = modules[name], units.index(name)
        if hasattr(module, _OFFLOADED):
            raise ValueError(f"unit {name!r} is already offloaded")
        module.forward = _offloaded_forward(module.forward, holder, region)
        setattr(module, _OFFLOADED, region)
    setattr(model, _POOL, holder)
    return holder


def _offloaded_forward(plain: Any, holder: UnitPool, region: int) -> Any:
    @functools.wraps(plain)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with holder.offloading(region):
            return plain(*args, **kwargs)

    return forward


def start_steps(model: nn.Module, holder: UnitPool) -> None:
    """The root's forward pre-hook that starts each step in the pool; registered after ``fully_shard`` so that
    FSDP2's root hook (prepended) has moved and cast the inputs first."""
    model.register_forward_pre_hook(lambda module, args, kwargs: holder.begin_step(module, args, kwargs),
                                    with_kwargs=True)


def unit_pool(model: nn.Module) -> HostPool | None:
    """The host pool of a model ``apply_fsdp`` sharded with offloaded units (None before its first forward, or when
    the plan offloads nothing): ``stats()`` says what moved; ``capacity_bytes`` its size."""
    holder = getattr(model, _POOL, None)
    return holder.pool if holder is not None else None
