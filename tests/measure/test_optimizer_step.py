"""The budget covers the step as the loop runs it (issue 23, items 3 and 8): ``optimizer.step()`` with its states and
temporaries, and micro-steps that start with gradients alive (gradient accumulation).

Every check runs the user's real loop on the optimized module with the user's optimizer and measures it with
MemTracker around forward, backward and ``optimizer.step()``: the first step (states made) and a later one.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from support import budget_at, loss_of, mlp
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

import autockpt
from autockpt.measure.loop import measure_optimizer_step, optimizer_factory

OPTIMIZERS = {
    "sgd_momentum": functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9),
    "adam": functools.partial(torch.optim.Adam, lr=1e-3),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-3),
}


def loop_peaks(module: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, *, micro_steps: int = 1,
               steps: int = 2) -> list[int]:
    """MemTracker's peak of every micro-step (forward + backward, + optimizer.step() at a window's last), as a loop
    with ``zero_grad(set_to_none=True)`` after each optimizer step runs them."""
    peaks = []
    for _ in range(steps):
        for micro in range(micro_steps):
            tracker = MemTracker()
            tracker.track_external(module, optimizer, x)
            with tracker:
                loss_of(module(x)).backward()
                if micro == micro_steps - 1:
                    optimizer.step()
            peaks.append(tracker.get_tracker_snapshot("peak")[x.device]["Total"])
        optimizer.zero_grad(set_to_none=True)
    return peaks


def half_way_budget(model: nn.Module, x: torch.Tensor, **loop: object) -> int:
    # the traced step's figures (``budget_at``): a plan would search the floor as well
    return budget_at(autockpt.Planner.from_model(model, example_inputs=(x,), loss_fn=loss_of, **loop), 0.5)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_optimizer_step_is_inside_the_budget(name: str) -> None:
    model, x = mlp(), torch.randn(256, 128)
    twin = copy.deepcopy(model)
    optimizer = OPTIMIZERS[name](model.parameters())
    budget = half_way_budget(model, x, optimizer=optimizer)
    weights = [p.detach().clone() for p in model.parameters()]

    optimized = autockpt.optimize(model, budget_bytes=budget, example_inputs=(x,), loss_fn=loss_of, optimizer=optimizer)
    plan = autockpt.get_plan(optimized)
    assert not optimizer.state, "planning must not step the user's optimizer"
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights)), "planning moved the weights"
    assert plan.loop is not None and plan.loop.optimizer is not None and plan.loop.optimizer.state_bytes > 0
    assert plan.regions and plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= budget

    peaks = loop_peaks(optimized, optimizer, x)
    assert max(peaks) <= budget, f"first and later steps measured {peaks}, budget {budget}"
    twin_optimizer = OPTIMIZERS[name](twin.parameters())
    loop_peaks(twin, twin_optimizer, x)
    for mine, reference in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(mine, reference, rtol=0, atol=0)


def test_a_plan_without_the_optimizer_goes_over_in_the_loop() -> None:
    """Why the optimizer must be planned with: at the same budget, the forward/backward-only plan is over."""
    model, x = mlp(), torch.randn(256, 128)
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    budget = half_way_budget(model, x, optimizer=optimizer)
    bare = autockpt.optimize(model, budget_bytes=budget, example_inputs=(x,), loss_fn=loss_of)
    assert max(loop_peaks(bare, optimizer, x)) > budget


def test_gradient_accumulation_micro_steps_keep_the_budget() -> None:
    model, x = mlp(), torch.randn(256, 128)
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    loop = {"optimizer": optimizer, "gradient_accumulation_steps": 2}
    budget = half_way_budget(model, x, **loop)
    optimized = autockpt.optimize(model, budget_bytes=budget, example_inputs=(x,), loss_fn=loss_of, **loop)
    peaks = loop_peaks(optimized, optimizer, x, micro_steps=2)
    assert max(peaks) <= budget, f"micro-steps measured {peaks}, budget {budget}"
    assert peaks[1] > peaks[0], "the second micro-step starts with gradients: it should hold more"
    # planned for one micro-step, the second goes over
    bare_loop = autockpt.optimize(model, budget_bytes=budget, example_inputs=(x,), loss_fn=loss_of, optimizer=optimizer)
    assert max(loop_peaks(bare_loop, optimizer, x, micro_steps=2)) > budget


def test_predicted_loop_peak_equals_the_measured_one() -> None:
    """The unmodified model in the loop: estimate's training peak and the planner's unmodified peak equal
    measure_step's (MemTracker, first and later step) to the byte on CPU."""
    model, x = mlp(), torch.randn(256, 128)
    estimate = autockpt.estimate(model, example_inputs=(x,), loss_fn=loss_of, optimizer="adamw")
    measured = autockpt.measure_step(model, (x,), loss_fn=loss_of, optimizer=torch.optim.AdamW).peak_bytes
    assert estimate.training_peak_bytes == measured
    model.zero_grad(set_to_none=True)
    plan = autockpt.plan(model, budget_bytes=10**15, example_inputs=(x,), loss_fn=loss_of, optimizer=torch.optim.AdamW,
                         gradient_accumulation_steps=2)
    assert all(p.grad is None for p in model.parameters()), "planning left gradients behind"
    accumulating = autockpt.measure_step(model, (x,), loss_fn=loss_of, optimizer=torch.optim.AdamW,
                                         gradient_accumulation_steps=2).peak_bytes
    assert plan.baseline_peak_bytes == accumulating


def test_measuring_the_optimizer_leaves_everything_as_it_was() -> None:
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    loss_of(model(torch.randn(4, 128))).backward()
    optimizer.step()  # the user's optimizer has states; planning copies them
    grads = [p.grad.clone() for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    states = copy.deepcopy(optimizer.state_dict())
    cost = measure_optimizer_step(optimizer_factory(model, optimizer), model, torch.device("cpu"))
    moments = 2 * sum(p.numel() * 4 for p in model.parameters())  # exp_avg, exp_avg_sq; plus a 0-d step each
    assert moments < cost.state_bytes <= moments + 8 * len(list(model.parameters()))
    assert cost.first_step_extra_bytes >= cost.state_bytes  # its states existed already: the copy has them
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    for mine, saved in zip(optimizer.state.values(), states["state"].values()):
        assert torch.equal(mine["exp_avg"], saved["exp_avg"]) and int(mine["step"]) == int(saved["step"])


def test_bad_loop_arguments_say_what_to_do() -> None:
    model, x = mlp(), torch.randn(8, 128)
    other = torch.optim.SGD(mlp().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="parameters that are not Sequential's"):
        autockpt.plan(model, budget_bytes=10**9, example_inputs=(x,), optimizer=other)
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be an integer >= 1"):
        autockpt.plan(model, budget_bytes=10**9, example_inputs=(x,), gradient_accumulation_steps=0)
    with pytest.raises(TypeError, match="returned list, not a torch.optim.Optimizer"):
        autockpt.plan(model, budget_bytes=10**9, example_inputs=(x,), optimizer=lambda params: list(params))
    with pytest.raises(ValueError, match="optimizer='lion': the names are adam, adamw, sgd, none"):
        autockpt.plan(model, budget_bytes=10**9, example_inputs=(x,), optimizer="lion")


def test_a_saved_plan_keeps_its_loop(tmp_path: object) -> None:
    model, x = mlp(), torch.randn(64, 128)
    plan = autockpt.plan(model, budget_bytes=10**15, example_inputs=(x,), loss_fn=loss_of, optimizer=torch.optim.AdamW,
                         gradient_accumulation_steps=4)
    plan.save(tmp_path / "plan.json")  # type: ignore[operator]
    loaded = autockpt.load_plan(tmp_path / "plan.json")  # type: ignore[operator]
    assert loaded.loop == plan.loop and loaded.loop is not None and loaded.loop.gradient_accumulation_steps == 4
    assert "optimizer.step() of AdamW" in loaded.summary() and "over 4 micro-steps" in loaded.summary()


CUDA_OPTIMIZERS = {
    "adamw_foreach": functools.partial(torch.optim.AdamW, lr=1e-3, foreach=True),
    "adamw_fused": functools.partial(torch.optim.AdamW, lr=1e-3, fused=True),
    "sgd_momentum_foreach": functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9, foreach=True),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(CUDA_OPTIMIZERS))
def test_the_cuda_optimizer_step_is_inside_the_budget(name: str) -> None:
    """On CUDA the step's implementations differ (foreach keeps a temporary per parameter group, fused none): the
    budget holds for forward + backward + ``optimizer.step()``, by ``max_memory_allocated``, on the first step (states
    made) and a later one."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(1024, 1024), nn.GELU())],
                          nn.Linear(1024, 16)).to(device)
    x = torch.randn(2048, 1024, device=device)
    optimizer = CUDA_OPTIMIZERS[name](model.parameters())
    # half way from the floor to the unmodified peak: the step's own temporaries (foreach's) put the floor of so small a
    # model high, and half way from static memory would be below it
    with pytest.raises(autockpt.InfeasibleBudgetError) as floor:
        autockpt.plan(model, budget_bytes=1, example_inputs=(x,), loss_fn=loss_of, optimizer=optimizer)
    unmodified = autockpt.plan(model, budget_bytes=10**15, example_inputs=(x,), loss_fn=loss_of, optimizer=optimizer)
    budget = (floor.value.min_feasible_bytes + unmodified.baseline_peak_bytes) // 2
    optimized = autockpt.optimize(model, budget_bytes=budget, example_inputs=(x,), loss_fn=loss_of, optimizer=optimizer)
    peaks = []
    for _ in range(2):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss_of(optimized(x)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device))
    # everything the process holds on the device counts in max_memory_allocated: only this test's tensors are there
    assert max(peaks) <= budget, f"first and later steps measured {peaks}, budget {budget}"
