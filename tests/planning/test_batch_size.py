"""max_batch_size: the answer fits when measured, and the next batch up does not (the unmodified model's search,
exact to the batch: ``test_trace_choice.py``, which searches on fake traces and measures the answer)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autockpt
from autockpt.planning.batch_size import ExampleBatch, TrialOutcome, max_batch_size, max_batch_sizes


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(64, 64), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(64, 4))


def _inputs(batch: int) -> ExampleBatch:
    torch.manual_seed(batch)
    return ExampleBatch(args=(torch.randn(batch, 64),))


def _peak(model: nn.Module, batch: int) -> int:
    return autockpt.measure_step(model, _inputs(batch).args).peak_bytes


def test_checkpointing_fits_a_larger_batch() -> None:
    model = _model()
    budget = _peak(model, 40)
    results = max_batch_sizes(lambda: model, _inputs, budget_bytes=budget, strategies=("none", "autockpt", "every_1"), start=32, precision=8)
    assert results["autockpt"].batch_size > results["none"].batch_size
    assert results["every_1"].batch_size > results["none"].batch_size
    best = results["autockpt"]
    assert best.plan is not None and best.plan.regions and best.measured_peak_bytes <= budget
    module = autockpt.Planner.from_model(model, example_inputs=_inputs(best.batch_size).args).apply(best.plan)
    assert autockpt.measure_step(module, _inputs(best.batch_size).args).peak_bytes <= budget


def test_nothing_fits() -> None:
    model = _model()
    result = max_batch_size(lambda: model, _inputs, budget_bytes=1000, strategy="none", start=4)
    assert result.batch_size == 0 and result.plan is None
    assert result.trials[0].outcome is TrialOutcome.INFEASIBLE


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown baseline strategy"):
        max_batch_size(_model, _inputs, budget_gb=1.0, strategy="every_layer")
    with pytest.raises(ValueError, match="exactly one of budget_gb"):
        max_batch_size(_model, _inputs)
    with pytest.raises(ValueError, match="start must be a positive integer"):
        max_batch_size(_model, _inputs, budget_gb=1.0, start=0)
    with pytest.raises(TypeError, match="must return an autockpt.planning.batch_size.ExampleBatch"):
        max_batch_size(_model, lambda n: {"x": torch.randn(n, 64)}, budget_gb=1.0, strategy="none")
