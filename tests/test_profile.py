"""Profile: what the timed steps measure, and the fixed cost of one checkpointed region."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autockpt
from autockpt import profile as profile_module
from autockpt.capture import capture


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)), torch.randn(8, 16)


def test_the_timed_step_leaves_out_inserting_and_removing_the_unit_markers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inserting the markers recompiles the GraphModule (longer than the forward on graphs of a few hundred units);
    it once landed inside the timed window, inflating the step time and the last unit's forward time. A fake clock
    charges 10 s per recompile and 1 us per reading, so any recompile in the window shows."""
    model, x = _mlp()
    graph = capture(model, (x,), {})
    gm = graph.executable
    clock = [0.0]

    def perf_counter() -> float:
        clock[0] += 1e-6
        return clock[0]

    recompile = gm.recompile

    def slow_recompile() -> object:
        clock[0] += 10.0
        return recompile()

    monkeypatch.setattr(profile_module.time, "perf_counter", perf_counter)
    monkeypatch.setattr(gm, "recompile", slow_recompile)
    unit_ms, step_ms = profile_module._timed_step(graph, (x,), {}, lambda out: out.sum(), num_units=len(graph.units))
    assert clock[0] >= 20.0  # the markers did go in and come out
    assert step_ms < 1.0 and max(unit_ms) < 1.0


def test_the_fixed_cost_of_a_region_is_measured_and_reaches_the_plan() -> None:
    model, x = _mlp()
    rng_before = torch.get_rng_state()
    overhead_ms = profile_module.measure_region_overhead_ms(torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), rng_before)  # planning must not move the user's RNG
    # a checkpointed region runs the checkpoint machinery in forward and backward: it costs more than the same ops
    # run plainly (about 0.15 ms on the 2-core CI machine)
    assert overhead_ms > 0.0

    planner = autockpt.Planner(model, example_inputs=(x,))
    assert planner.profile.region_overhead_ms > 0.0
    every_1 = autockpt.solve.baselines.baseline_plan(planner, "every_1")
    assert every_1.region_overhead_ms == planner.profile.region_overhead_ms
    expected_ms = every_1.recompute_ms + len(every_1.regions) * every_1.region_overhead_ms
    assert every_1.predicted_overhead == pytest.approx(expected_ms / every_1.baseline_step_ms)
    assert f"{len(every_1.regions)} regions x {every_1.region_overhead_ms:.2f} ms" in every_1.summary()
