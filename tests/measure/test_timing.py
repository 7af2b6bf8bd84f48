"""Timings (issue 36, item 2): roofline times from FLOPs and bytes against a DeviceSpec, the local CPU calibrated,
and ``Planner.from_model(timing=, target=)`` planning from them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import loss_of, mlp

import autockpt
from autockpt.core.devices import DEVICE_SPECS
from autockpt.measure.devices_local import local_cpu_spec
from autockpt.measure.timing import MeasuredTiming, RooflineTiming, parameter_read_bytes, timing_for
from autockpt.planning.planner import Planner


@pytest.fixture(scope="module")
def example() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return mlp(), torch.randn(512, 128)


@pytest.fixture(scope="module")
def measured(example: tuple[torch.nn.Module, torch.Tensor]) -> Planner:
    model, x = example
    return Planner.from_model(model, example_inputs=(x,), loss_fn=loss_of, timing="measured")


def test_the_local_cpu_is_calibrated_once_with_its_sources() -> None:
    spec = local_cpu_spec()
    assert local_cpu_spec() is spec  # cached per process
    assert spec.name == "local-cpu" and not spec.copies_overlap_compute
    assert spec.memory_bytes > 10**9 and spec.hbm_gb_per_s > 0 and spec.op_overhead_us > 0
    assert set(spec.dtypes) == {"float32", "bfloat16"} and all(t > 0 for _, t in spec.peak_tflops)
    assert all("measured on this machine" in text for figure, text in spec.source if figure != "memory")


def test_timing_choice() -> None:
    cpu = torch.device("cpu")
    assert isinstance(timing_for("auto", None, cpu), MeasuredTiming)
    auto = timing_for("auto", "h100", cpu)
    assert isinstance(auto, RooflineTiming) and auto.spec is DEVICE_SPECS["h100-sxm-80gb"]
    assert timing_for("roofline", None, cpu).spec is local_cpu_spec()
    with pytest.raises(ValueError, match="timing='measured' times the step on the model's device"):
        timing_for("measured", "l4", cpu)
    with pytest.raises(ValueError, match="choose one of auto, measured, roofline"):
        timing_for("guessed", None, cpu)
    with pytest.raises(ValueError, match="unknown device 'h300'"):
        timing_for("auto", "h300", cpu)


def test_parameters_read_per_unit_come_from_the_graph(measured: Planner) -> None:
    read = parameter_read_bytes(measured.graph)
    linears = [m for m in measured.model.modules() if isinstance(m, torch.nn.Linear)]
    expected = sum(p.numel() * p.element_size() for m in linears for p in m.parameters())
    assert sum(read) == expected and len(read) == len(measured.graph.units)
    assert sum(r > 0 for r in read) == len(linears)


def test_roofline_times_are_positive_and_follow_the_flops(measured: Planner) -> None:
    timed = RooflineTiming("a100-80gb").timed(measured.trace, measured.graph, measured.request)
    assert all(u.forward_ms > 0 for u in timed.units) and timed.step_ms > timed.forward_ms > 0
    assert timed.events == measured.trace.events  # memory as measured
    by_flops = sorted(zip(measured.trace.units, timed.units), key=lambda pair: pair[0].flops)
    matmuls = [t.forward_ms for m, t in by_flops if m.flops > 0]
    assert matmuls == sorted(matmuls) and max(matmuls) > max(t.forward_ms for m, t in by_flops if m.flops == 0)
    # a faster device, a shorter step
    faster = RooflineTiming("h100-sxm-80gb").timed(measured.trace, measured.graph, measured.request)
    assert faster.step_ms < timed.step_ms


def test_from_model_plans_from_roofline_times_and_its_notes_name_the_timing(
    example: tuple[torch.nn.Module, torch.Tensor], measured: Planner
) -> None:
    model, x = example
    roofline = Planner.from_model(model, example_inputs=(x,), loss_fn=loss_of, timing="roofline")
    trace = measured.trace
    budget = trace.static_bytes + (trace.baseline_peak_bytes - trace.static_bytes) // 2
    the_plan = roofline.plan(budget_bytes=budget)
    assert the_plan.regions and the_plan.predicted_peak_bytes <= budget
    assert any(note.startswith("timing: roofline on local-cpu") for note in the_plan.notes)
    assert the_plan.baseline_step_ms == pytest.approx(roofline.trace.step_ms)
    assert roofline.target is None  # the model's own device
    assert "timing: measured on the model's device" in measured.plan(budget_bytes=budget).notes
    # the memory is the trace's, whatever the times: the same regions give the same predicted peak
    same = measured.plan_for_regions(the_plan.regions, strategy="given", action=the_plan.planned_action)
    again = roofline.plan_for_regions(the_plan.regions, strategy="given", action=the_plan.planned_action)
    assert same.predicted_peak_bytes == again.predicted_peak_bytes
    assert same.predicted_overhead != again.predicted_overhead


def test_a_timing_that_replaces_the_measured_times_runs_no_timed_steps(
    example: tuple[torch.nn.Module, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A measured trace planned with roofline times (asked for, or for a target) tracks the step's memory without
    its timed steps: their times would be replaced. "auto" on the model's own device keeps, so runs, them."""
    from autockpt.measure import trace as trace_module

    timed_runs: list[int] = []
    real_timed_steps = trace_module.timed_steps

    def counted(*args, **kwargs):
        timed_runs.append(kwargs["repeats"])
        return real_timed_steps(*args, **kwargs)

    monkeypatch.setattr(trace_module, "timed_steps", counted)
    model, x = example
    for timing, target in (("roofline", None), ("auto", "h100")):
        planner = Planner.from_model(model, example_inputs=(x,), loss_fn=loss_of, timing=timing, target=target)
        assert planner.provenance.trace == "measured" and planner.provenance.timing == "roofline"
        assert planner.trace.step_ms > 0 and planner.trace.times_measured  # the roofline's times, not zeros
    assert timed_runs == []
    auto = Planner.from_model(model, example_inputs=(x,), loss_fn=loss_of, timing="auto")
    assert timed_runs == [3] and auto.provenance.timing == "measured"


def test_a_target_times_the_step_there_and_its_memory_is_the_default_budget(
    example: tuple[torch.nn.Module, torch.Tensor], measured: Planner
) -> None:
    model, x = example
    spec = dataclasses.replace(DEVICE_SPECS["l4"], name="small-l4", memory_bytes=measured.trace.baseline_peak_bytes)
    planner = autockpt.Planner.from_model(model, example_inputs=(x,), loss_fn=loss_of, target=spec, host_pool_gb=0.01,
                                          timing="auto")
    assert planner.target is spec
    assert planner.costs.link is not None and planner.costs.link.host_to_device_gb_per_s == 25.0
    # the target's roofline times, not this machine's measured ones (no test compares against a measured time)
    on_target = RooflineTiming(spec).timed(measured.trace, measured.graph, measured.request)
    assert planner.trace.step_ms == pytest.approx(on_target.step_ms)
    the_plan = planner.plan()  # the target's memory
    assert the_plan.budget_bytes == spec.memory_bytes
    assert any("timing: roofline on small-l4" in note for note in the_plan.notes)
