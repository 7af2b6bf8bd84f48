"""Model state through planning and training: train/eval flags as the user set them (an eval-mode model, frozen
BatchNorm layers in a training model), BatchNorm statistics advancing once per step through the export path."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from edge_models import ShapeBranchConvNet, frozen_batchnorm_case
from support import budget_at, check_optimized, mlp, optimize_at

import autockpt
from autockpt.present import zoo


def test_optimizing_an_eval_mode_model_keeps_its_mode() -> None:
    case = zoo.build("cnn", "tiny", blocks=3)  # 3 residual blocks, not 12: the mode does not depend on the depth
    case.model.eval()
    optimized = optimize_at(case, 0.5)
    assert not optimized.training and not case.model.training
    optimized.train()
    assert optimized.training and case.model.training and case.model.blocks[0].bn1.training


def test_batchnorm_statistics_update_once_through_the_export_path() -> None:
    torch.manual_seed(0)
    case = zoo.ZooCase(name="bn-export", model=ShapeBranchConvNet(), args=(torch.randn(8, 3, 16, 16),), loss_fn=lambda out: out)
    plan = check_optimized(case, 0.4)
    assert plan.capture == "export"
    assert int(case.model.blocks[0][1].num_batches_tracked) == 2  # the checked step and the measured step, once each


def test_frozen_batchnorm_in_a_training_model_stays_frozen() -> None:
    """The export graph bakes each BatchNorm's mode in: planning must capture the user's flags, not model.train()'s
    (it did: the frozen layers normalised with batch statistics and updated their running statistics)."""
    case = frozen_batchnorm_case()
    plan = check_optimized(case, 0.5)
    assert plan.capture == "export"
    assert [block[1].training for block in case.model.blocks] == [False] * 3 + [True] * 3
    assert int(case.model.blocks[0][1].num_batches_tracked) == 0
    assert int(case.model.blocks[3][1].num_batches_tracked) == 2  # the checked step and the measured step


def test_planning_leaves_example_inputs_that_require_grad_as_they_were() -> None:
    """An example input that requires grad (an ``inputs_embeds``, a pipeline stage's input) came back with the
    profiling steps' gradients accumulated in ``.grad``; also when planning fails part-way."""
    # support's 6-layer MLP: the refusal below searches the floor, which the zoo's 16 layers make seconds longer
    case = zoo.ZooCase(name="mlp", model=mlp(), args=(torch.randn(64, 128),))
    x = case.args[0].clone().requires_grad_(True)
    existing = torch.zeros_like(x)  # the MLP's input gradients are ~1e-9: added to 0.5 they would vanish
    x.grad = existing.clone()  # a gradient the user's own step left there stays, unchanged
    optimized = optimize_at(dataclasses.replace(case, args=(x,)), 0.5)  # profiled, planned, measured
    assert x.grad is not None and torch.equal(x.grad, existing)
    x.grad = None
    with pytest.raises(autockpt.InfeasibleBudgetError):
        autockpt.optimize(case.model, budget_bytes=1, example_inputs=(x,))
    assert x.grad is None
    autockpt.measure.loss.default_loss(optimized(x)).backward()  # the optimized module gives the input its gradient
    assert x.grad is not None


def test_a_planners_graph_is_the_captured_program_after_it_rewrote_plans() -> None:
    """Rewriting edits a graph's executable in place: each module a planner applies gets a copy, and the planner's
    own graph stays the captured program, which later plans, rewrites and traces of it read (the first rewrite once
    edited it: a fake trace of it afterwards had other units than the planner's trace)."""
    case = zoo.ZooCase(name="mlp", model=mlp(), args=(torch.randn(64, 128),))
    planner = autockpt.Planner.from_model(case.model, example_inputs=case.args)
    code = planner.graph.executable.code
    first = planner.apply(planner.plan(budget_bytes=budget_at(planner, 0.8)))
    second = planner.apply(planner.plan(budget_bytes=budget_at(planner, 0.9)))
    assert first.plan.regions and second.plan.regions
    assert planner.graph.executable.code == code
    executables = [module.__dict__["_autockpt_executable"] for module in (first, second)]
    assert len({id(e) for e in (*executables, planner.graph.executable)}) == 3  # one copy each
    torch.testing.assert_close(first(*case.args), case.model(*case.args))
