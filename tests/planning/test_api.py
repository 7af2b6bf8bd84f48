"""Public API contract: errors, identity plans, state preservation, eval/no_grad behaviour, state_dict sharing."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch
from support import budget_at, mlp, planner_for, run_step, tiny, twin
from torch import nn

import autockpt
from autockpt.present import zoo


def small_cnn() -> zoo.ZooCase:
    """The zoo's CNN with 3 residual blocks, not 12: what these tests check does not depend on the model's size, and
    every plan of the CNN searches both recompute kinds' floors (issue 46)."""
    return zoo.build("cnn", "tiny", blocks=3)


@pytest.fixture(scope="module")
def cnn_planner() -> autockpt.Planner:
    """The CNN's planner, for its static bytes and unmodified peak (``budget_at``: its trace's, without a plan at an
    unlimited budget, which searches the full floor)."""
    case = small_cnn()
    return autockpt.Planner.from_model(case.model, example_inputs=case.args, loss_fn=case.loss_fn)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "exactly one of budget_gb"),
        ({"budget_gb": 1.0, "budget_bytes": 10**9}, "exactly one of budget_gb"),
        ({"budget_gb": 0}, "positive"),
        ({"budget_gb": -2.0}, "positive"),
        ({"budget_gb": math.nan}, "positive finite"),
        ({"budget_gb": math.inf}, "positive finite"),
        ({"budget_bytes": 0}, "positive"),
        ({"budget_gb": True}, "positive number"),
        ({"budget_gb": "8GB"}, "positive number"),
        ({"budget_gb": 1e-12}, "less than one byte"),
        ({"budget_bytes": 2.7}, "whole number of bytes"),
    ],
)
def test_bad_budgets_are_value_errors(kwargs: dict, match: str) -> None:
    case = tiny("mlp")
    with pytest.raises(ValueError, match=match):
        autockpt.plan(case.model, example_inputs=case.args, **kwargs)


def test_infeasible_budget_reports_the_smallest_feasible() -> None:
    """On the 6-layer MLP (issue 46: the conv net's floor programs took 1 s a solve, and the probe and ``optimize``
    each search both recompute kinds' floors)."""
    model, x = mlp(), torch.randn(64, 128)
    probed = autockpt.plan(model, budget_bytes=10**15, example_inputs=(x,))
    too_small = probed.static_bytes + 1
    with pytest.raises(autockpt.InfeasibleBudgetError) as caught:
        autockpt.optimize(model, budget_bytes=too_small, example_inputs=(x,))
    error = caught.value
    assert isinstance(error, ValueError)
    assert error.min_feasible_bytes == probed.min_feasible_bytes > too_small
    assert str(error.min_feasible_bytes) in str(error)


def test_budget_at_or_above_unmodified_peak_gives_identity_plan(cnn_planner: autockpt.Planner) -> None:
    case = small_cnn()
    plan = autockpt.plan(case.model, budget_bytes=cnn_planner.trace.baseline_peak_bytes, example_inputs=case.args,
                         loss_fn=case.loss_fn)
    assert plan.status is autockpt.types.PlanStatus.IDENTITY
    assert plan.regions == () and plan.recomputed_units == ()
    assert plan.predicted_peak_bytes == plan.baseline_peak_bytes
    assert plan.predicted_overhead == 0.0


def test_budget_gb_means_ten_to_the_ninth_bytes() -> None:
    plan = autockpt.plan(mlp(depth=2), budget_gb=1.5, example_inputs=(torch.randn(8, 128),))
    assert plan.budget_bytes == 1_500_000_000


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda m, x: autockpt.plan("model", budget_gb=1, example_inputs=(x,)), TypeError, "torch.nn.Module"),
        (lambda m, x: autockpt.plan(m, budget_gb=1, example_inputs={"x": x}), TypeError, "tuple of positional"),
        (lambda m, x: autockpt.plan(m, budget_gb=1), ValueError, "example_inputs"),
        (lambda m, x: autockpt.plan(m, budget_gb=1, example_inputs=(x,), example_kwargs=[1]), TypeError, "dict"),
        (lambda m, x: autockpt.plan(m, budget_gb=1, example_inputs=(x,), loss_fn=3), TypeError, "callable"),
        (lambda m, x: autockpt.get_plan(m), TypeError, "autockpt.optimize"),
        (lambda m, x: autockpt.plan(m, budget_gb=1, example_inputs=(x.numpy(),)), TypeError, r"torch\.from_numpy"),
        (lambda m, x: autockpt.plan(m, budget_gb=1, example_kwargs={"x": x.numpy()}), TypeError, r"example_kwargs\['x'\]"),
    ],
)
def test_bad_arguments_say_what_was_expected(call, error, match) -> None:
    case = tiny("mlp")
    with pytest.raises(error, match=match):
        call(case.model, case.args[0])


@pytest.mark.parametrize(
    "loss_fn, match",
    [
        (lambda out: out, r"tensor of shape \(256, 10\)"),  # not reduced
        (lambda out: out.sum().item(), r"\(float\)"),
        (lambda out: out.sum().detach(), "requires_grad=False"),
    ],
    ids=["not-reduced", "python-float", "detached"],
)
def test_a_loss_function_that_returns_no_scalar_loss_is_named(loss_fn, match: str) -> None:
    """It failed inside profiling with a ProfileError that blamed the captured graph."""
    case = tiny("mlp")
    with pytest.raises(autockpt.errors.LossFunctionError, match=match) as caught:
        autockpt.plan(case.model, budget_gb=1, example_inputs=case.args, loss_fn=loss_fn)
    assert "loss_fn returned" in str(caught.value) and ".mean()" in str(caught.value)


def test_model_without_trainable_parameters_is_rejected() -> None:
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        autockpt.plan(model, budget_gb=1, example_inputs=(torch.randn(2, 4),))


def test_planning_leaves_weights_buffers_grads_and_rng_untouched(cnn_planner: autockpt.Planner) -> None:
    case = small_cnn()
    model = case.model
    model.eval()  # planning switches to train mode internally and must switch back
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    autockpt.optimize(model, budget_bytes=budget_at(cnn_planner, 0.5), example_inputs=case.args, loss_fn=case.loss_fn)
    assert torch.equal(torch.get_rng_state(), rng)
    assert not model.training and all(not m.training for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_optimized_module_shares_parameters_and_state_dict_keys(cnn_planner: autockpt.Planner) -> None:
    case = small_cnn()
    optimized = autockpt.optimize(case.model, budget_bytes=budget_at(cnn_planner, 0.5), example_inputs=case.args,
                                  loss_fn=case.loss_fn)
    assert list(optimized.state_dict()) == list(case.model.state_dict())
    assert all(a is b for a, b in zip(optimized.parameters(), case.model.parameters()))
    optimizer = torch.optim.SGD(optimized.parameters(), lr=0.1)
    run_step(optimized, case)
    optimizer.step()  # updates the shared parameters of the original model too
    reference = twin(case)
    reference.load_state_dict(optimized.state_dict())


def test_eval_mode_and_no_grad_run_the_original(caplog: pytest.LogCaptureFixture) -> None:
    case = tiny("transformer")
    reference = twin(case)
    planner = planner_for(case)
    optimized = planner.optimize(budget_bytes=budget_at(planner, 0.5))
    optimized.eval()
    assert not case.model.training
    with caplog.at_level(logging.WARNING, logger="autockpt"):
        torch.testing.assert_close(optimized(*case.args), reference.eval()(*case.args))  # gradients on: warned
    assert "in eval mode with gradients enabled" in caplog.text
    optimized.train()
    reference.train()
    with torch.no_grad():
        torch.manual_seed(3)
        expected = reference(*case.args)
        torch.manual_seed(3)
        torch.testing.assert_close(optimized(*case.args), expected)


@pytest.mark.parametrize("name", ["mlp", "control_flow"])  # fx capture; module-level capture (shape-generic)
def test_smaller_batches_keep_the_plan_and_larger_ones_warn(name: str, caplog: pytest.LogCaptureFixture) -> None:
    case = tiny(name)
    planner = planner_for(case)
    optimized = planner.optimize(budget_bytes=budget_at(planner, 0.5))
    x = case.args[0]
    with caplog.at_level(logging.WARNING, logger="autockpt"):
        out = optimized(x[:10])
    assert out.shape[0] == 10 and "without the plan" not in caplog.text
    assert len(optimized.shape_variants()) == (1 if name == "mlp" else 0)  # module-level: the same module runs it
    larger = torch.cat([x, x])
    with caplog.at_level(logging.WARNING, logger="autockpt"):
        torch.testing.assert_close(optimized(larger), case.model(larger))
    assert f"larger than the planned {tuple(x.shape)}" in caplog.text and "without the plan" in caplog.text


def test_plan_summary_and_dataframe_agree_with_regions(cnn_planner: autockpt.Planner) -> None:
    case = small_cnn()
    plan = autockpt.plan(case.model, budget_bytes=budget_at(cnn_planner, 0.5), example_inputs=case.args,
                         loss_fn=case.loss_fn)
    frame = plan.to_dataframe()
    assert list(frame.columns[:6]) == ["name", "op", "module_path", "saved_bytes", "output_bytes", "forward_ms"]
    assert len(frame) == len(plan.nodes)
    recomputed = frame.index[frame["decision"] == "recompute"].tolist()
    assert recomputed == [u for r in plan.regions for u in range(r.first_unit, r.last_unit + 1)]
    text = plan.summary()
    assert re.search(r"budget +[\d.]+ (kB|MB|GB) \([\d.]+ (KiB|MiB|GiB)\)", text)  # decimal and binary units, named
    assert f"{len(plan.regions)} checkpointed regions" in text
    assert plan.capture in ("fx", "export", "module")
