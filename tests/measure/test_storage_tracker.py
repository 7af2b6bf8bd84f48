"""autockpt's StorageTracker on what FSDP2 does to storages: DTensors (wrapper subclasses) and
``UntypedStorage.resize_``, the cross-check of FSDPMemTracker in tests/fsdp/test_fsdp_gloo.py; and the MemTracker
``measure_step`` counts with against torch's own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support import needs_transformers, tiny
from torch.distributed import HashStore
from torch.distributed._tools.mem_tracker import MemTracker

from autockpt.measure.loss import default_loss
from autockpt.measure.step import step_peak_tracker
from autockpt.measure.storage_tracker import StorageTracker

CPU = torch.device("cpu")


def test_a_storage_resized_to_nothing_and_back_is_counted_as_freed_and_refilled() -> None:
    plain = torch.UntypedStorage.resize_
    tracker = StorageTracker(CPU, [])
    with tracker:
        buffer = torch.empty(1024, dtype=torch.float32)  # 4,096 B, as FSDP2's all-gather output
        buffer.untyped_storage().resize_(0)  # FSDP2 frees unsharded parameters this way
        freed = tracker.live_bytes
        buffer.untyped_storage().resize_(8192)
        refilled = tracker.live_bytes
    assert (freed, refilled) == (0, 8192)
    assert max(event.peak_bytes for event in tracker.events) == 8192
    assert torch.UntypedStorage.resize_ is plain  # put back on leaving


def test_dtensors_are_counted_by_their_local_tensors_as_memtracker_counts_them() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    dist.init_process_group("gloo", rank=0, world_size=1, store=HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.nn.Parameter(DTensor.from_local(torch.randn(64, 64), mesh, [Replicate()]))
        optimizer = torch.optim.AdamW([weight])

        def step() -> None:
            (weight * 2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        step()  # makes AdamW's states: the steps measured below all start with them
        reference = MemTracker()
        reference.track_external(weight, optimizer)
        with reference:
            step()
        states = [v for s in optimizer.state.values() for v in s.values()]
        second = StorageTracker(CPU, [weight, *states])
        with second:
            step()
        by_local = StorageTracker(CPU, [weight.to_local(), *(getattr(v, "_local_tensor", v) for v in states)])
        with by_local:
            step()  # the DTensors the step makes and changes are known by the storages of their local tensors
    finally:
        dist.destroy_process_group()
    peak = reference.get_tracker_snapshot("peak")[CPU]["Total"]
    assert max(e.peak_bytes for e in second.events) == max(e.peak_bytes for e in by_local.events) == peak


@pytest.mark.parametrize("name", ["cnn", pytest.param("gpt2", marks=needs_transformers)])
def test_the_step_peak_tracker_is_memtrackers_peak_snapshot_to_the_byte(name: str) -> None:
    """``measure_step``'s tracker (MemTracker without its per-module peak copies): the same peak snapshot, every
    category, as torch's MemTracker on the same step (a conv net with BatchNorm; a Hugging Face decoder stepped with
    AdamW, whose states an untracked step made first)."""
    case = tiny(name)
    optimizer = torch.optim.AdamW(case.model.parameters())
    loss_fn = case.loss_fn or default_loss
    if name == "gpt2":
        loss_fn(case.model(*case.args, **case.kwargs)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    snapshots = []
    for tracker in (MemTracker(), step_peak_tracker(), MemTracker(), step_peak_tracker()):
        tracker.track_external(case.model, *case.args, optimizer)
        with tracker:
            loss_fn(case.model(*case.args, **case.kwargs)).backward()
            if name == "gpt2":
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        snapshots.append((tracker.get_tracker_snapshot("peak")[CPU], tracker.get_tracker_snapshot("current")[CPU]))
    assert snapshots[0] == snapshots[1] and snapshots[2] == snapshots[3]
    assert snapshots[0][0]["Total"] > snapshots[0][1]["Total"]  # a peak above the step's end was kept
