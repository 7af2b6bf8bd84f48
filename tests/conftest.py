"""Shared helpers: PyTorch itself is the reference answer for every optimized model."""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import autockpt
from autockpt import zoo
from autockpt.api import default_loss
from autockpt.capture import capture, plain_outputs
from autockpt.profile import profile
from autockpt.types import Profile

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
needs_diffusers = pytest.mark.skipif(importlib.util.find_spec("diffusers") is None, reason="needs diffusers")


# the zoo models the end-to-end tests run, with readable ids and the extras they need
_ZOO_PARAMS = {
    "mlp": pytest.param("mlp", id="mlp"),
    "cnn": pytest.param("cnn", id="cnn-batchnorm-inplace"),
    "transformer": pytest.param("transformer", id="transformer-dropout"),
    "control_flow": pytest.param("control_flow", id="data-dependent-control-flow"),
    "gpt2": pytest.param("gpt2", marks=needs_transformers, id="hf-gpt2"),
    "vit": pytest.param("vit", marks=needs_transformers, id="hf-vit"),
    "unet": pytest.param("unet", marks=needs_diffusers, id="diffusers-unet2d"),
}


def zoo_params(*names: str) -> list[Any]:
    """pytest parameters for these zoo models."""
    return [_ZOO_PARAMS[name] for name in names]


@pytest.fixture(autouse=True)
def _two_threads() -> None:
    torch.set_num_threads(2)


def budget_at(plan: autockpt.Plan, fraction: float) -> int:
    """A budget ``fraction`` of the way from static bytes to the unmodified peak."""
    return int(plan.static_bytes + fraction * (plan.baseline_peak_bytes - plan.static_bytes))


def probe(case: zoo.ZooCase) -> autockpt.Plan:
    return autockpt.plan(case.model, budget_bytes=10**15, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn)


def profile_of(case: zoo.ZooCase) -> Profile:
    """The case's model captured and profiled (no Planner, no solving)."""
    graph = capture(case.model, case.args, case.kwargs)
    return profile(graph, case.args, case.kwargs, case.loss_fn or default_loss)


def optimize_at(case: zoo.ZooCase, fraction: float) -> torch.nn.Module:
    """Optimize at ``fraction`` of the way from static to peak, or half-way above the floor if that is lower."""
    base = probe(case)
    budget = max(budget_at(base, fraction), (base.min_feasible_bytes + base.baseline_peak_bytes) // 2)
    return autockpt.optimize(
        case.model, budget_bytes=budget, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn
    )


def check_optimized(case: zoo.ZooCase, fraction: float = 0.5) -> autockpt.Plan:
    """Optimize (``optimize_at``), then: some region planned, the same step as the original model, the budget kept
    when measured, and the measured peak within 5 % of the prediction."""
    reference = twin(case)
    optimized = optimize_at(case, fraction)
    plan = autockpt.get_plan(optimized)
    assert plan.regions
    assert_same_step(optimized, reference, case)
    measured = autockpt.measure_step(optimized, case.args, case.kwargs, case.loss_fn).peak_bytes
    assert measured <= plan.budget_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * measured
    return plan


def run_step(module: torch.nn.Module, case: zoo.ZooCase, seed: int = 7) -> tuple[Any, dict[str, torch.Tensor]]:
    """One training step from zero grads with a fixed RNG seed; returns (outputs, grads by parameter name)."""
    for param in module.parameters():
        param.grad = None
    torch.manual_seed(seed)
    output = module(*case.args, **case.kwargs)
    (case.loss_fn or autockpt.default_loss)(output).backward()
    grads = {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}
    return output, grads


def assert_same_step(optimized: torch.nn.Module, reference: torch.nn.Module, case: zoo.ZooCase) -> None:
    """Outputs, gradients and buffers after one step match the original model (rtol 1e-4)."""
    expected_out, expected_grads = run_step(reference, case)
    actual_out, actual_grads = run_step(optimized, case)
    expected_leaves = pytree.tree_leaves(plain_outputs(expected_out)[0])
    actual_leaves = pytree.tree_leaves(actual_out)
    assert type(actual_out) is type(expected_out)
    assert len(actual_leaves) == len(expected_leaves)
    for want, got in zip(expected_leaves, actual_leaves):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert actual_grads.keys() == expected_grads.keys() and actual_grads
    for name, want in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], want, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")
    for (name, want), (_, got) in zip(reference.named_buffers(), optimized.named_buffers()):
        torch.testing.assert_close(got, want, msg=f"buffer {name}")


def twin(case: zoo.ZooCase) -> torch.nn.Module:
    """An independent copy of the case's model (same weights) to serve as the reference."""
    return copy.deepcopy(case.model)
