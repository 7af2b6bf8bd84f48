"""``autockpt.measure.step.measure_compiled_step``: the allocator's count of one step, for code MemTracker cannot see into."""

from __future__ import annotations

import torch
from torch import nn

from autockpt.measure.step import measure_compiled_step, measure_step


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


def test_the_optimizer_step_counts_as_measure_step_counts_it() -> None:
    """With an optimizer: two steps on a copy (states made, then alive), the weights put back; the peak is above the
    step without it by about the states and close to MemTracker's reading of the same loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    x, loss_fn = torch.randn(64, 256), (lambda y: y.square().mean())
    weights = [p.detach().clone() for p in model.parameters()]
    without = measure_compiled_step(model, (x,), loss_fn=loss_fn).peak_bytes
    with_adamw = measure_compiled_step(model, (x,), loss_fn=loss_fn, optimizer=torch.optim.AdamW).peak_bytes
    memtracker = measure_step(model, (x,), loss_fn=loss_fn, optimizer=torch.optim.AdamW).peak_bytes
    states = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    assert with_adamw >= without + states
    assert abs(with_adamw - memtracker) <= 0.05 * memtracker, (with_adamw, memtracker)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights)), "the weights are put back"
