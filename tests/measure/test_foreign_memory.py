"""Device memory the step does not own (issue 23, item 7): read when solving and verifying, not only when profiling.

On CUDA every tensor the process holds counts against the device (``torch.cuda.memory_allocated``); on CPU the same
mechanism is driven through ``autockpt.measure.step.held_beside_step``, which names the tensors to count. A plan made
while X bytes of other tensors were alive and solved or verified while Y are alive predicts and keeps its budget.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import loss_of, mlp
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

import autockpt
from autockpt.measure.loop import with_foreign_bytes
from autockpt.measure.step import StepMeasurement, foreign_bytes, held_beside_step
from autockpt.measure.trace import step_tensors
from autockpt.planning.verify import in_planned_device
from autockpt.types import StepTrace


def half_way(trace: StepTrace) -> int:
    return int(trace.static_bytes + 0.5 * (trace.baseline_peak_bytes - trace.static_bytes))


def loop_peak(module: nn.Module, x: torch.Tensor, *others: torch.Tensor) -> int:
    """MemTracker's peak of one forward + backward with ``others`` alive beside it (as CUDA's counter sees them)."""
    for param in module.parameters():
        param.grad = None
    tracker = MemTracker()
    tracker.track_external(module, x, *others)
    with tracker:
        loss_of(module(x)).backward()
    for param in module.parameters():
        param.grad = None
    return tracker.get_tracker_snapshot("peak")[x.device]["Total"]


def test_foreign_bytes_counts_what_the_step_does_not_own() -> None:
    model, x = mlp(), torch.randn(64, 128)
    owned = step_tensors(model, (x,), {})
    other, cache = torch.zeros(10_000), torch.zeros(2_500)
    assert foreign_bytes(x.device, owned) == 0
    with held_beside_step(other):
        assert foreign_bytes(x.device, owned) == other.nbytes
        with held_beside_step(cache, other[:10], next(model.parameters())):  # a view of one, a tensor the step owns
            assert foreign_bytes(x.device, owned) == other.nbytes + cache.nbytes
        assert foreign_bytes(x.device, owned) == other.nbytes
    assert foreign_bytes(x.device, owned) == 0
    with pytest.raises(TypeError, match="takes tensors"), held_beside_step([other]):  # type: ignore[arg-type]
        pass


def test_measure_step_counts_the_bytes_beside_the_step() -> None:
    model, x = mlp(), torch.randn(64, 128)
    alone = autockpt.measure_step(model, (x,), loss_fn=loss_of)
    other = torch.zeros(50_000)
    with held_beside_step(other):
        beside = autockpt.measure_step(model, (x,), loss_fn=loss_of)
    assert alone.reserved_bytes is None and beside.reserved_bytes is None  # CUDA's allocator only
    assert (alone.foreign_bytes, beside.foreign_bytes) == (0, other.nbytes)
    assert beside.peak_bytes == alone.peak_bytes + other.nbytes


def test_moving_a_trace_to_other_foreign_bytes_moves_every_event_and_back() -> None:
    planner = autockpt.Planner.from_model(mlp(), example_inputs=(torch.randn(64, 128),), loss_fn=loss_of)
    trace = planner.trace
    moved = with_foreign_bytes(trace, 4096)
    assert moved.foreign_bytes == 4096 and moved.baseline_peak_bytes == trace.baseline_peak_bytes + 4096
    assert all(b.start_bytes - a.start_bytes == 4096 and b.peak_bytes - a.peak_bytes == 4096
               for a, b in zip(trace.events, moved.events))
    assert with_foreign_bytes(moved, 0) == trace
    assert with_foreign_bytes(trace, 0) is trace
    with pytest.raises(ValueError, match=">= 0"):
        with_foreign_bytes(trace, -1)


@pytest.mark.parametrize(("planned_with", "solved_with"), [(0, 200_000), (300_000, 0), (100_000, 250_000)])
def test_a_planner_plans_for_the_bytes_alive_when_it_solves(planned_with: int, solved_with: int) -> None:
    """Made while X bytes of other tensors are alive, solved while Y are: the plan is the one for Y (same regions as
    at the budget less Y with nothing beside it, every prediction Y higher), and it keeps the budget measured."""
    model, x = mlp(), torch.randn(256, 128)
    at_profile = torch.zeros(planned_with // 4)
    with held_beside_step(at_profile):
        planner = autockpt.Planner.from_model(model, example_inputs=(x,), loss_fn=loss_of, checkpoint="torch_non_reentrant")
    del at_profile
    assert planner.trace.foreign_bytes == planned_with
    reference = planner.plan(budget_bytes=half_way(with_foreign_bytes(planner.trace, 0)))
    assert reference.foreign_bytes == 0 and planner.trace.foreign_bytes == 0  # read again when solving

    at_solve = torch.zeros(solved_with // 4)
    with held_beside_step(at_solve):
        budget = reference.budget_bytes + solved_with
        the_plan = planner.plan(budget_bytes=budget)
        assert the_plan.foreign_bytes == solved_with
        assert the_plan.regions == reference.regions
        assert the_plan.predicted_peak_bytes == reference.predicted_peak_bytes + solved_with <= budget
        assert the_plan.baseline_peak_bytes == reference.baseline_peak_bytes + solved_with
        assert the_plan.min_feasible_bytes == reference.min_feasible_bytes + solved_with
        assert ("other device memory" in the_plan.summary()) == bool(solved_with)

        optimized = planner.optimize(budget_bytes=budget)  # verified with the same bytes beside it
        verified = autockpt.get_plan(optimized)
        assert verified.measured_peak_bytes is not None and verified.measured_peak_bytes <= budget
        assert verified.measured_reserved_bytes is None  # CPU
    # in the user's loop, with those tensors alive beside the step
    assert loop_peak(optimized, x, at_solve) <= budget


def test_optimize_keeps_the_budget_with_other_tensors_alive_on_the_device() -> None:
    """The budget is the device's: with 100 kB of other tensors alive the step itself must peak 100 kB lower, and
    the plan made without them goes over when they are alive."""
    model, x = mlp(), torch.randn(256, 128)
    budget = half_way(autockpt.Planner.from_model(model, example_inputs=(x,), loss_fn=loss_of).trace)  # nothing beside it
    other = torch.zeros(25_000)
    with held_beside_step(other):
        optimized = autockpt.optimize(model, budget_bytes=budget, example_inputs=(x,), loss_fn=loss_of,
                                      checkpoint="torch_non_reentrant")
    alone = autockpt.optimize(model, budget_bytes=budget, example_inputs=(x,), loss_fn=loss_of,
                              checkpoint="torch_non_reentrant")
    beside, by_itself = autockpt.get_plan(optimized), autockpt.get_plan(alone)
    assert by_itself.foreign_bytes == 0 and beside.foreign_bytes == other.nbytes
    assert beside.predicted_peak_bytes <= budget and loop_peak(optimized, x, other) <= budget
    assert beside.predicted_peak_bytes - other.nbytes <= budget - other.nbytes < by_itself.predicted_peak_bytes
    assert loop_peak(alone, x, other) > budget  # the plan made without them goes over with them alive


def test_verification_judges_the_step_with_the_device_as_planned() -> None:
    """A step measured with more bytes beside it than the plan counted is judged without them, and the plan's
    note says both readings; the reserved bytes are recorded beside the measured peak."""
    planner = autockpt.Planner.from_model(mlp(), example_inputs=(torch.randn(64, 128),), loss_fn=loss_of)
    the_plan = dataclasses.replace(planner.plan(budget_bytes=10**12), foreign_bytes=1_000)
    measurement = StepMeasurement(peak_bytes=50_000, loss=0.0, device="cuda:0", reserved_bytes=65_536,
                                  foreign_bytes=3_000)
    peak, recorded = in_planned_device(the_plan, measurement)
    assert peak == 48_000 and recorded.measured_peak_bytes == 48_000 and recorded.measured_reserved_bytes == 65_536
    assert "3.0 kB" in recorded.notes[-1] and "50000" in recorded.notes[-1]
    summary = recorded.summary()
    assert "48.0 kB" in summary and "65.5 kB" in summary and "reserved by the CUDA caching allocator" in summary
    same, unchanged = in_planned_device(the_plan, dataclasses.replace(measurement, foreign_bytes=1_000))
    assert same == 50_000 and unchanged.notes == the_plan.notes


def test_a_saved_plan_keeps_its_foreign_and_reserved_bytes(tmp_path: object) -> None:
    planner = autockpt.Planner.from_model(mlp(), example_inputs=(torch.randn(64, 128),), loss_fn=loss_of)
    the_plan = dataclasses.replace(planner.plan(budget_bytes=10**12), foreign_bytes=1_536, measured_peak_bytes=9_000,
                                   measured_reserved_bytes=20_480)
    path = tmp_path / "plan.json"  # type: ignore[operator]
    the_plan.save(path)
    loaded = autockpt.load_plan(path)
    assert (loaded.foreign_bytes, loaded.measured_reserved_bytes) == (1_536, 20_480)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prediction_is_within_two_percent_of_max_memory_allocated() -> None:
    """On CUDA: the predicted peak against ``torch.cuda.max_memory_allocated`` of the optimized step, within 2 %,
    planned with nothing else on the device and again after 64 MiB of other tensors were allocated (the planner
    reads them when it solves; it was profiled without them)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.GELU())],
                          nn.Linear(1024, 16)).to(device)
    x = torch.randn(2048, 1024, device=device)
    planner = autockpt.Planner.from_model(model, example_inputs=(x,), loss_fn=loss_of)
    for other_bytes in (0, 64 * 2**20):
        other = torch.empty(other_bytes, dtype=torch.uint8, device=device)
        budget = half_way(with_foreign_bytes(planner.trace, 0)) + planner.foreign_bytes_now()
        optimized = planner.optimize(budget_bytes=budget)
        the_plan = autockpt.get_plan(optimized)
        for param in model.parameters():
            param.grad = None
        measured = autockpt.measure_step(optimized, (x,), loss_fn=loss_of)
        assert measured.reserved_bytes is not None and measured.reserved_bytes >= measured.peak_bytes
        assert measured.foreign_bytes >= other_bytes
        error = (measured.peak_bytes - the_plan.predicted_peak_bytes) / measured.peak_bytes
        assert abs(error) <= 0.02, (other_bytes, the_plan.predicted_peak_bytes, measured.peak_bytes)
        assert measured.peak_bytes <= budget
        del other, optimized
