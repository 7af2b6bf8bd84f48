"""``autockpt.measure.measure_compiled_step``: the allocator's count of one step, for code MemTracker cannot see into."""

from __future__ import annotations

import torch
from torch import nn

from autockpt.measure import measure_compiled_step, measure_step


def test_gradients_count_once() -> None:
    """A step of one large Linear on one row holds parameters, gradients and next to nothing else: the peak is about
    two parameter sizes (the first version read the static tensors after backward, gradients among them, and counted
    the gradients twice: three)."""
    torch.manual_seed(0)
    model, x = nn.Linear(1000, 1000), torch.randn(1, 1000)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    measured = measure_compiled_step(model, (x,), loss_fn=lambda y: y.sum())
    assert 2 * parameter_bytes <= measured.peak_bytes <= 2 * parameter_bytes + 64 * 1024, measured.peak_bytes
    assert all(p.grad is not None for p in model.parameters()), "gradients are left on the parameters"


def test_an_eager_step_reads_close_to_memtracker() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    x = torch.randn(64, 256)
    allocator = measure_compiled_step(model, (x,), loss_fn=lambda y: y.square().mean()).peak_bytes
    memtracker = measure_step(model, (x,), loss_fn=lambda y: y.square().mean()).peak_bytes
    assert abs(allocator - memtracker) <= 0.05 * memtracker, (allocator, memtracker)
