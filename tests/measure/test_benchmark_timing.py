"""The "benchmark" timing (issue 36, item 2): each op of a fake trace run alone on this machine, at its shapes, on
random inputs; repeated blocks once; a model on the meta device never materialised; ``timing_for``'s rules."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from support import assert_same_memory, budget_at, needs_transformers, tiny

import autockpt
from autockpt.core.devices import DEVICE_SPECS
from autockpt.core.structure import find_repeated_blocks
from autockpt.measure.devices_local import local_spec_name
from autockpt.measure.fake import FakeTrace
from autockpt.measure.timing import BenchmarkTiming, MeasuredTiming, RooflineTiming, timing_for
from autockpt.present import zoo
from autockpt.types import CaptureKind

# the planners are cached per process (``functools.cache``): the tests that read them run on one xdist worker, which
# makes them once
pytestmark = pytest.mark.xdist_group("tests/measure/test_benchmark_timing.py")

# a Hugging Face model's ops benchmarked alone (embedding lookups, masks, the loss's gather): the meta Llama's test
# below; its memory timeline on fakes: tests/measure/test_fake_trace.py (issue 46: GPT-2 here too was 2.3 s)
_ZOO = [
    pytest.param("mlp", id="mlp"),
    pytest.param("cnn", id="cnn-batchnorm-inplace"),
    pytest.param("transformer", id="transformer-dropout"),
]


@dataclasses.dataclass(frozen=True)
class Timed:
    measured: autockpt.Planner
    benchmarked: autockpt.Planner
    timing: BenchmarkTiming


@functools.cache
def timed(name: str) -> Timed:
    """A zoo model planned from a measured trace (its memory timeline; the tests' fixed times, so no timed steps),
    and from a fake trace timed by the benchmark (once per session)."""
    # the transformer with 2 of its 6 layers: the repeated blocks' second instance takes the first's times, and
    # every op is benchmarked at any depth (issue 46: its two planners traced 6 layers twice)
    case = zoo.build(name, "tiny", blocks=2) if name == "transformer" else tiny(name)
    call = {"example_inputs": case.args, "example_kwargs": case.kwargs, "loss_fn": case.loss_fn}
    measured = autockpt.Planner.from_model(case.model, **call, trace="measured")
    timing = BenchmarkTiming()
    benchmarked = autockpt.Planner.from_model(case.model, **call, trace_source=FakeTrace(), timing=timing)
    return Timed(measured, benchmarked, timing)


@pytest.mark.parametrize("name", _ZOO)
def test_every_unit_of_a_fake_trace_gets_a_benchmarked_time_and_keeps_its_memory(name: str) -> None:
    both = timed(name)
    trace = both.benchmarked.trace
    assert both.benchmarked.graph.kind in (CaptureKind.FX, CaptureKind.EXPORT)
    report = both.timing.report
    assert report is not None and report.benchmarks is not None
    assert report.benchmarks.failures == ()  # every op ran alone: none fell back to the roofline
    assert all(u.forward_ms > 0 for u in trace.units)  # views and getitems too: their dispatch takes time
    assert trace.forward_ms == pytest.approx(sum(u.forward_ms for u in trace.units))
    assert trace.step_ms > trace.forward_ms and trace.times_measured
    assert_same_memory(trace, both.measured.trace)  # the memory timeline is the fake trace's, untouched
    # how near the benchmark's step is to the measured one (0.85x-1.05x on these models) is a measured time, so it
    # is measured by experiments/bench/bench_roofline.py (its "bench ratio"), not asserted here


def test_repeated_blocks_take_their_first_instances_times() -> None:
    both = timed("transformer")
    graph, trace = both.benchmarked.graph, both.benchmarked.trace
    families = find_repeated_blocks(graph, trace).families
    assert families
    for family in families:
        first = family.instances[0]
        for offset in range(family.block_units):
            assert trace.units[first.first_unit + offset].forward_ms_timed_at is None
            for instance in family.instances[1:]:
                unit = trace.units[instance.first_unit + offset]
                assert unit.forward_ms_timed_at == first.first_unit + offset
                assert unit.forward_ms == trace.units[first.first_unit + offset].forward_ms
    benchmarks = both.timing.report.benchmarks
    assert benchmarks.benchmarked < len(trace.units)


def test_plans_from_benchmarked_times_name_the_timing_end_to_end() -> None:
    case = tiny("mlp")
    planner = autockpt.Planner.from_model(case.model, example_inputs=case.args, trace_source=FakeTrace(),
                                          timing="benchmark")
    plan = planner.plan(budget_bytes=budget_at(planner, 0.5))  # the trace's figures: no full floor search
    assert plan.regions and plan.predicted_peak_bytes <= plan.budget_bytes and plan.predicted_overhead > 0
    note = next(note for note in plan.notes if note.startswith("timing: "))
    assert note.startswith("timing: benchmark on cpu: each op run alone") and "0 of 33 ops timed by roofline" in note
    assert not any("not measured" in note for note in plan.notes)  # real times, not placeholders
    # "auto" on a fake trace without a target is the benchmark
    auto = autockpt.Planner.from_model(case.model, example_inputs=case.args, trace_source=FakeTrace(), timing="auto")
    assert any(note.startswith("timing: benchmark on cpu") for note in auto.notes) and auto.trace.times_measured


def test_a_model_on_the_meta_device_is_benchmarked_on_the_cpu_and_stays_on_meta() -> None:
    case = tiny("cnn")  # fx: its modules are copied and given random weights on the CPU
    model = case.model.to("meta")
    timing = BenchmarkTiming()
    x = case.args[0].to("meta")
    planner = autockpt.Planner.from_model(model, example_inputs=(x,), trace_source=FakeTrace(), timing=timing)
    assert timing.report.device == "cpu" and timing.report.benchmarks.failures == ()
    assert all(u.forward_ms > 0 for u in planner.trace.units)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    assert all(p.grad is None for p in model.parameters())


@needs_transformers
def test_a_hugging_face_model_on_the_meta_device_is_benchmarked_with_token_ids_in_range() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 32), device="meta")
    timing = BenchmarkTiming()
    planner = autockpt.Planner.from_model(
        model, example_inputs=(ids,), example_kwargs={"labels": ids}, trace_source=FakeTrace(), timing=timing
    )
    assert planner.graph.kind is CaptureKind.EXPORT
    assert timing.report.benchmarks.failures == ()  # embedding lookups, the loss's gather, masks: all ran
    assert all(u.forward_ms > 0 for u in planner.trace.units)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


class _Boxed:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class _BoxingNet(torch.nn.Module):
    """Returns an object neither fx nor export can return: captured at module level."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> _Boxed:
        return _Boxed(self.body(x))


def test_a_module_level_capture_falls_back_to_the_local_roofline_and_says_so() -> None:
    timing = BenchmarkTiming()
    planner = autockpt.Planner.from_model(
        _BoxingNet(), example_inputs=(torch.randn(16, 32),), loss_fn=lambda out: out.value.square().mean(),
        trace_source=FakeTrace(), timing=timing,
    )
    assert planner.graph.kind is CaptureKind.MODULE
    assert planner.trace.step_ms > 0 and planner.trace.times_measured
    note = next(note for note in planner.notes if note.startswith("timing: "))
    assert "benchmark not possible on a module-level capture" in note and "roofline on local-cpu" in note


class _IntegerRatio(torch.nn.Module):
    """An integer division: run alone on zeros (integer inputs are made zeros) it divides by zero."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ratio = torch.div(counts, counts, rounding_mode="floor")
        return self.linear(x) * ratio.sum()


def test_an_op_that_cannot_run_alone_gets_its_roofline_time_and_is_counted() -> None:
    timing = BenchmarkTiming()
    planner = autockpt.Planner.from_model(
        _IntegerRatio(), example_inputs=(torch.randn(8, 16), torch.tensor([2, 3])), trace_source=FakeTrace(),
        timing=timing,
    )
    failures = timing.report.benchmarks.failures
    assert [planner.graph.units[unit].op for unit, _ in failures] == ["div"]
    assert "ZeroDivisionError" in failures[0][1]
    assert all(u.forward_ms > 0 for u in planner.trace.units)  # the division's: its roofline on the local CPU
    note = next(note for note in planner.notes if note.startswith("timing: "))
    units = len(planner.graph.units)
    assert f"1 of {units} ops timed by roofline on local-cpu" in note and "ZeroDivisionError" in note


def test_timing_choice_follows_the_trace_and_the_target() -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert isinstance(timing_for("auto", None, cpu), MeasuredTiming)
    assert isinstance(timing_for("auto", None, cpu, trace_measured=False), BenchmarkTiming)
    assert timing_for("auto", None, meta, trace_measured=False).device == cpu  # a meta model runs here on the CPU
    assert isinstance(timing_for("auto", "h100", cpu, trace_measured=False), RooflineTiming)
    assert isinstance(timing_for("benchmark", None, cpu), BenchmarkTiming)  # on a measured trace, if asked
    local = dataclasses.replace(DEVICE_SPECS["l4"], name=local_spec_name(cpu))
    assert isinstance(timing_for("benchmark", local, cpu, trace_measured=False), BenchmarkTiming)
    with pytest.raises(ValueError, match="measured no times.*use timing='benchmark'.*or 'roofline'"):
        timing_for("measured", None, cpu, trace_measured=False)
    with pytest.raises(ValueError, match="timing='benchmark' times each op on this machine's cpu, not on target="):
        timing_for("benchmark", "h100", cpu, trace_measured=False)
    with pytest.raises(ValueError, match="choose one of auto, measured, roofline, benchmark"):
        timing_for("guessed", None, cpu)
    given = BenchmarkTiming(repeats=1)
    assert timing_for(given, None, cpu) is given
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        BenchmarkTiming(repeats=0)
