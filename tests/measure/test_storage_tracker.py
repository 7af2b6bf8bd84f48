"""autockpt's StorageTracker on what FSDP2 does to storages: DTensors (wrapper subclasses) and
``UntypedStorage.resize_``, the cross-check of FSDPMemTracker in tests/fsdp/test_fsdp_gloo.py."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import HashStore
from torch.distributed._tools.mem_tracker import MemTracker

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
