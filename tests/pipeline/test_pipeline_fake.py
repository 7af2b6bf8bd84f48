"""Issue 36 for pipelines: ``plan_pipeline(trace=, timing=, target=, device_memory_bytes=)`` plans a model no device
holds (built on the meta device, or predicted over the device memory) on fake tensors, with no real step.

The reference is the measured pipeline plan: on CPU the fake trace's memory is exact, so with the same unit times
(roofline on one target) the fake plan makes the same cuts, the same stage plans and the same predicted peaks.
"""

from __future__ import annotations

import pytest
import torch
from support import needs_transformers
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import autockpt
from autockpt.errors import InfeasibleBudgetError
from autockpt.measure import sources
from autockpt.measure.fake import FakeTrace
from autockpt.pipeline import PipelinePlanner, whole_step
from autockpt.pipeline.run import stage_module_for
from experiments.common.pipeline_worker import Decoder, build, lm_loss

_CONFIG = {"seed": 0, "model": {"vocab": 1024, "width": 32, "layers": 3, "tied": False}}
_TARGET = "h100-sxm-80gb"


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1024, (8, 16), generator=generator)
    return ids, torch.randint(0, 1024, (8, 16), generator=generator)


def _plan(model: nn.Module, **kwargs) -> autockpt.PipelinePlan:
    ids, target = _batch()
    return autockpt.plan_pipeline(
        model, 2, microbatches=4, example_inputs=(ids,), example_target=target, loss_fn=lm_loss, **kwargs,
    )


class RealSteps:
    """Counts the ways a pipeline plan can run a real step: the measured trace of the whole step or of a stage, the
    pipeline's extra timed traces, and a forward of the model with gradients on real tensors."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, model: nn.Module) -> None:
        self.count = 0
        measured_trace, timed_trace = sources.MeasuredTrace.trace, whole_step.trace_step

        def counted_trace(source: sources.MeasuredTrace, *args: object, **kwargs: object) -> object:
            self.count += 1
            return measured_trace(source, *args, **kwargs)

        def counted_timed_trace(*args: object, **kwargs: object) -> object:
            self.count += 1
            return timed_trace(*args, **kwargs)

        def forward_hook(module: nn.Module, inputs: tuple) -> None:
            real = [t for t in inputs if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)]
            if torch.is_grad_enabled() and real and real[0].device.type != "meta":
                self.count += 1

        monkeypatch.setattr(sources.MeasuredTrace, "trace", counted_trace)
        monkeypatch.setattr(whole_step, "trace_step", counted_timed_trace)
        self.handle = model.register_forward_pre_hook(forward_hook)


def _stage_peaks(pplan: autockpt.PipelinePlan) -> list[tuple[int, int, int]]:
    return [(s.predicted_peak_bytes, s.retained_bytes, s.schedule_buffer_bytes) for s in pplan.stages]


def test_a_fake_pipeline_plan_is_the_measured_one_at_the_same_unit_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Roofline times on one target for both: the same cuts, stage plans and predicted peaks, to the byte; the fake
    plan is trace="auto"'s under a device memory below the whole step's, which runs no real step. (Without the
    outputs returned, whose concatenation bounds the last stage, a budget near the floor makes a stage recompute.)
    Two cut candidates, not the default 16: each is stage plans to make, twice here, and two give both traces a
    choice of split to agree on."""
    ids, target = _batch()
    model = build(_CONFIG)
    steps = RealSteps(monkeypatch, model)
    # trace="auto" under a device memory below the whole step's: the fake trace, and no real step
    fakes = PipelinePlanner.from_model(model, 2, microbatches=4, example_inputs=(ids,), example_target=target,
                                       loss_fn=lm_loss, target=_TARGET, device_memory_bytes=100_000,
                                       return_outputs=False, max_cut_candidates=2)
    with pytest.raises(InfeasibleBudgetError) as refused:
        fakes.plan(budget_bytes=100_000)
    budget = int(refused.value.min_feasible_bytes * 1.02)
    fake = fakes.plan(budget_bytes=budget)
    steps.handle.remove()
    assert steps.count == 0
    assert any("above the device memory" in note for note in fake.notes)
    assert all(p.grad is None for p in model.parameters())
    measured = _plan(model, budget_bytes=budget, trace="measured", target=_TARGET, return_outputs=False,
                     max_cut_candidates=2)
    assert fake.cuts == measured.cuts
    assert _stage_peaks(fake) == _stage_peaks(measured)
    assert [p.regions for p in fake.stage_plans] == [p.regions for p in measured.stage_plans]
    assert any(p.regions for p in fake.stage_plans)
    assert fake.predicted_step_ms == pytest.approx(measured.predicted_step_ms)
    assert [(p.provenance.trace, p.provenance.timing) for p in fake.stage_plans] == [("fake", "roofline")] * 2
    assert [(p.provenance.trace, p.provenance.timing) for p in measured.stage_plans] == [("measured", "roofline")] * 2
    assert any(note.startswith("planned from a fake trace, roofline timing") for note in fake.notes)
    assert any(note.startswith("planned from a measured trace, roofline timing") for note in measured.notes)


@needs_transformers
def test_a_model_on_the_meta_device_is_split_and_planned_without_a_real_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (4, 32))

    def loss_fn(output: object, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output["logits"].flatten(0, 1), target.flatten())

    steps = RealSteps(monkeypatch, model)
    pplan = autockpt.plan_pipeline(
        model, 2, budget_gb=80, microbatches=2, example_inputs=(ids,), example_target=ids, loss_fn=loss_fn,
        # one candidate cut (the middle block boundary): every stage planner traced on fakes is seconds; the split
        # program's choice among candidates is checked against the exhaustive search in test_pipeline.py
        target=_TARGET, max_cut_candidates=1,
    )
    steps.handle.remove()
    assert steps.count == 0
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    assert all(p.grad is None for p in model.parameters())
    first, last = pplan.stages
    assert pplan.cuts[0] in pplan.candidate_cuts and (first.first_unit, first.last_unit + 1) == (0, last.first_unit)
    assert "lm_head" in last.module_paths and last.last_unit == pplan.fingerprint.num_units - 1
    assert [(p.provenance.trace, p.provenance.timing, p.provenance.device) for p in pplan.stage_plans] == [
        ("fake", "roofline", _TARGET)
    ] * 2
    assert any("fake trace" in note and "meta device" in note for note in pplan.notes)
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(s.parameter_bytes for s in pplan.stages) == parameters
    assert all(s.predicted_peak_bytes > s.parameter_bytes for s in pplan.stages)
    assert pplan.predicted_step_ms > 0 and all(s.predicted_microbatch_ms > 0 for s in pplan.stages)  # roofline


def test_a_measured_trace_of_a_meta_model_and_other_traces_are_refused() -> None:
    with torch.device("meta"):
        model = build(_CONFIG)
    with pytest.raises(ValueError, match="meta device"):
        _plan(model, budget_bytes=10**9, trace="measured")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    with pytest.raises(ValueError, match="trace='real': choose one of auto, fake, measured"):  # PlanOptions' check
        _plan(model, budget_bytes=10**9, trace="real")
    with pytest.raises(ValueError, match="a pipeline plan takes one of auto, fake, measured"):  # a TraceSource
        _plan(model, budget_bytes=10**9, trace=FakeTrace())


def test_a_last_stage_planned_with_its_loss_on_fakes_applies_to_the_real_model() -> None:
    """A meta model's last stage planned with its loss (vocabulary 8192, 256 tokens a microbatch): its target was
    traced on fakes, so its plan records no range of the target's values; the stage module is still made on the
    real model (a fingerprint compares no ranges) and its loss runs backward to what the rank received."""
    with torch.device("meta"):
        model = Decoder(vocab=8192, width=32, layers=4)
    generator = torch.Generator().manual_seed(1)
    ids, target = (torch.randint(0, 8192, (8, 128), generator=generator) for _ in range(2))
    pplan = autockpt.plan_pipeline(model, 2, budget_gb=80, microbatches=4, example_inputs=(ids,), example_target=target,
                                   loss_fn=lm_loss, max_cut_candidates=1, target=_TARGET)
    assert [s.with_loss for s in pplan.stages] == [False, True]
    torch.manual_seed(0)
    last = stage_module_for(Decoder(vocab=8192, width=32, layers=4), pplan, 1, loss_fn=lm_loss)
    received = torch.randn(2, 128, 32, requires_grad=True)
    loss = last.loss((received,), target[:2])
    loss.backward()
    assert loss.shape == () and received.grad is not None and received.grad.shape == received.shape
