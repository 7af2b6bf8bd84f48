"""The smallest feasible budget autockpt states is kept when measured (issue 23, item 2): a Hugging Face ResNet
(BatchNorm, residual convs) measured 8 bytes over its predicted floor, so ``optimize`` at the stated minimum raised.
``experiments/bench_min_feasible.py`` runs every zoo model the same way (too slow for the suite)."""

from __future__ import annotations

import pytest
import torch

import autockpt

transformers = pytest.importorskip("transformers")


def test_optimize_at_the_stated_minimum_keeps_it() -> None:
    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
    model = transformers.ResNetForImageClassification(config)
    kwargs = {"example_inputs": (torch.randn(4, 3, 32, 32),), "example_kwargs": {"labels": torch.randint(0, 10, (4,))}}
    with pytest.raises(autockpt.InfeasibleBudgetError) as caught:
        autockpt.optimize(model, budget_bytes=1, **kwargs)
    stated = caught.value.min_feasible_bytes
    module = autockpt.optimize(model, budget_bytes=stated, **kwargs)
    measured = autockpt.get_plan(module).measured_peak_bytes
    assert measured is not None and measured <= stated
