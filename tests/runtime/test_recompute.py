"""autockpt's own checkpoint (``Action.RECOMPUTE_OWN``): same step as PyTorch, budgets kept, the "auto"
choice between the checkpoint kinds, and the autograd behaviour users rely on. (The simulator's whole-region semantics
for it: test_simulate.py.)"""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
from support import FREE_MACHINERY, assert_same_step, budget_at, planner_for, tiny, twin, zoo_params
from torch import nn

import autockpt
from autockpt.core.simulate import _predict, simulate
from autockpt.core.solve.base import recompute_actions
from autockpt.planning.planner import baseline_plan
from autockpt.present import zoo
from autockpt.runtime.recompute import checkpointed_call
from autockpt.types import Action, CaptureKind, Region, RegionAction

FUNCTION = autockpt.SolverOptions(checkpoint="recompute_function")

# the module-level capture (control_flow), which test_models.py plans under torch's checkpoint; it plans the MLP, the
# BatchNorm CNN (fx), GPT-2 and the UNet (export) under autockpt's own, at the same budget with the same checks
# (``support.checkpoint_for``), so they are not planned here again (issue 46). Nor the fx transformer with dropout:
# its step under autockpt's own (dropout masks included) and a prediction within 1 % of the measured peak are
# test_the_simulator_is_exact_for_block_aligned_and_cut_regions's; a budget kept under autockpt's own on fx, and the
# transformer's at 0.3-0.7 under torch's, are test_models.py's test_budget_is_kept_and_step_matches_pytorch
MODELS = zoo_params("control_flow")


@pytest.mark.parametrize("name", MODELS)
def test_budget_is_kept_and_step_matches_pytorch(name: str) -> None:
    case = tiny(name)
    reference = twin(case)
    planner = planner_for(case, FUNCTION)  # one capture and profile for the probe and the plan
    budget = budget_at(planner, 0.5)
    optimized = planner.optimize(budget_bytes=budget)
    plan = autockpt.get_plan(optimized)
    assert plan.planned_action is Action.RECOMPUTE_OWN and plan.regions
    assert_same_step(optimized, reference, case)  # outputs, gradients, BatchNorm statistics, dropout masks
    measured = autockpt.measure_step(optimized, case.args, case.kwargs, case.loss_fn).peak_bytes
    assert measured <= budget
    assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * measured, (measured, plan.predicted_peak_bytes)


@pytest.fixture(scope="module")
def own_transformer() -> tuple[zoo.ZooCase, autockpt.Planner]:
    """The zoo's tiny transformer (dropout) traced once for every strategy below: applying a plan and stepping the
    module leave the planner's trace as it was (no optimizer step, no BatchNorm; a step starts from gradients None).
    Three of its six layers: the strategies solve no program (``tiny`` keeps six for budgets a solver answers)."""
    case = zoo.build("transformer", "tiny", blocks=3)
    return case, autockpt.Planner.from_model(case.model, example_inputs=case.args, loss_fn=case.loss_fn,
                                             checkpoint=Action.RECOMPUTE_OWN)


@pytest.mark.parametrize("strategy", ["every_1", "sqrt_n", "for_transformers"])
def test_the_simulator_is_exact_for_block_aligned_and_cut_regions(
    strategy: str, own_transformer: tuple[zoo.ZooCase, autockpt.Planner]
) -> None:
    case, planner = own_transformer
    the_plan = baseline_plan(planner, strategy)
    assert the_plan.regions and the_plan.planned_action is Action.RECOMPUTE_OWN
    module = planner.apply(the_plan)
    assert_same_step(module, twin(case), case)
    measured = autockpt.measure_step(module, case.args, case.kwargs, case.loss_fn).peak_bytes
    assert measured == pytest.approx(the_plan.predicted_peak_bytes, rel=0.01)


class _BasicBlock(nn.Module):
    """torchvision's ResNet basic block: in-place ReLU, ``out += identity``, a strided 1x1 downsample."""

    def __init__(self, channels_in: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.downsample = None
        if stride != 1 or channels_in != channels:
            self.downsample = nn.Sequential(nn.Conv2d(channels_in, channels, 1, stride, bias=False),
                                            nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        out += identity
        return self.relu(out)


@pytest.mark.parametrize(
    ("first", "last"),
    [
        # ends at the next stage's first conv: its output is saved by the BatchNorm after the region, whose gradient
        # the checkpoint holds from the event it went in (it was counted from the next event)
        ("layer1.1.conv1", "layer2.0.conv1"),
        # end at an in-place ReLU: the gradient held is the ReLU output's, not the last one made for its storage
        # (a whole stage; one block)
        ("layer2.0.conv1", "layer2.1.relu"),
        ("layer2.1.conv1", "layer2.1.relu"),
    ],
)
def test_autockpts_checkpoint_is_predicted_exactly_on_resnet_regions(first: str, last: str) -> None:
    """Issue 46, item 2: a ResNet-18 region holding a stage's first conv was predicted short under autockpt's own
    checkpoint (by that conv's output); one ending in an in-place ReLU by one of its layer's tensors."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Sequential(_BasicBlock(8, 8), _BasicBlock(8, 8)), nn.Sequential(_BasicBlock(8, 16, 2), _BasicBlock(16, 16)),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )
    renamed = {"3": "layer1", "4": "layer2"}
    x = torch.randn(2, 3, 16, 16)
    reference = copy.deepcopy(model)
    planner = autockpt.Planner.from_model(model, example_inputs=(x,), checkpoint=Action.RECOMPUTE_OWN)
    paths = [".".join([renamed.get(p, p) for p in unit.module_path.split(".")]) for unit in planner.graph.units]
    region = Region(first_unit=paths.index(first), last_unit=len(paths) - 1 - paths[::-1].index(last))
    plan = planner.plan_for_regions([region], strategy="given", action=Action.RECOMPUTE_OWN)
    # the vectorised simulator the solvers use says the same as the reference, storage by storage
    planned = (RegionAction(region=region, action=Action.RECOMPUTE_OWN),)
    assert simulate(planner.trace, FREE_MACHINERY, planned) == _predict(
        planner.trace, FREE_MACHINERY, planned, detailed=False).timeline
    module = planner.apply(plan)
    assert_same_step(module, reference, zoo.ZooCase(name="resnet", model=model, args=(x,)))
    measured = autockpt.measure_step(module, (x,)).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 128, (measured, plan.predicted_peak_bytes)


def test_a_plan_file_keeps_its_checkpoint_kind(tmp_path) -> None:
    case = tiny("mlp")
    planner = planner_for(case, FUNCTION)
    the_plan = planner.plan(budget_bytes=budget_at(planner, 0.5))
    the_plan.save(tmp_path / "plan.json")
    loaded = autockpt.load_plan(tmp_path / "plan.json")
    assert loaded.planned_action is Action.RECOMPUTE_OWN
    module = autockpt.apply_plan(case.model, loaded, example_inputs=case.args)
    assert_same_step(module, twin(case), case)


def test_an_unknown_checkpoint_kind_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="'auto' or one of .*recompute_function"):
        autockpt.SolverOptions(checkpoint="reentrant")


# ----------------------------------------------------------------------------------------------- "auto" choice


RECOMPUTE_KINDS = tuple(kind for kind in Action if kind.recomputes)  # what "auto" plans for


def test_auto_plans_for_both_kinds_and_keeps_the_cheaper_predicted_plan() -> None:
    """plan() with "auto": the smaller predicted overhead of the two kinds' plans at each budget, and the smaller of
    their floors; each kind planned alone on the same measured step gives the figures to compare with. The zoo's tiny
    transformer with 2 layers, not 6 (issue 46: its solves are quicker). Its kinds' floors differ by 2 KB in most
    runs and were equal in one full-suite run (2026-11-28; the floor found for one kind moved by 2 KB, cause not
    found), so that they differ is not asserted; that the auto floor is the lower one is."""
    case = zoo.build("transformer", "tiny", blocks=2)
    auto = autockpt.Planner.from_model(case.model, example_inputs=case.args, loss_fn=case.loss_fn, checkpoint="auto")
    assert auto.actions == RECOMPUTE_KINDS
    # each kind alone on the same captured and measured step, at the same prices (made from them, not traced again)
    alone = {kind: autockpt.Planner(auto.graph, auto.trace, auto.costs, dataclasses.replace(auto.options, checkpoint=kind),
                                    step=auto.request)
             for kind in RECOMPUTE_KINDS}
    floors = {kind: _floor(planner) for kind, planner in alone.items()}
    assert _floor(auto) == min(floors.values())
    top = auto.trace.baseline_peak_bytes
    # near the floors, where the kinds differ most (a roomy budget as well took another 2 s of the suite: issue 46)
    budget = int(max(floors.values()) + 0.3 * (top - max(floors.values())))
    plans = {kind: planner.plan(budget_bytes=budget) for kind, planner in alone.items()}
    cheaper = min(plans.values(), key=lambda p: p.predicted_overhead)
    chosen = auto.plan(budget_bytes=budget)
    assert chosen.predicted_overhead == pytest.approx(min(p.predicted_overhead for p in plans.values()))
    assert chosen.regions == cheaper.regions and chosen.planned_action is cheaper.planned_action


def _floor(planner: autockpt.Planner) -> int:
    with pytest.raises(autockpt.InfeasibleBudgetError) as error:
        planner.plan(budget_bytes=1)
    return error.value.min_feasible_bytes


def test_auto_optimize_times_both_kinds_plans_and_returns_one_that_trains_like_pytorch() -> None:
    """The MLP (fx), not GPT-2 (export; issue 46: 1 s against 2.7 s): "auto" plans both kinds on either capture
    (test_auto_leaves_module_level_captures_on_torch_s_checkpoint), and the note is written only when both kinds'
    plans kept the budget when measured and were timed against each other (``verify.faster``). Which kind is chosen
    follows the machine's load: not asserted."""
    case = tiny("mlp")
    planner = planner_for(case, checkpoint="auto")  # the default options
    assert planner.actions == RECOMPUTE_KINDS
    budget = budget_at(planner, 0.5)
    optimized = planner.optimize(budget_bytes=budget)
    plan = autockpt.get_plan(optimized)
    assert plan.capture.value == "fx" and plan.regions and plan.measured_peak_bytes <= budget
    assert any(note.startswith(f"checkpoint {plan.planned_action.value} chosen by measured step time") for note in plan.notes)
    assert_same_step(optimized, twin(case), case)


def test_auto_leaves_module_level_captures_on_torch_s_checkpoint() -> None:
    """A module's forward may read tensors it is not given; only torch's checkpoint gives those gradients through
    autograd."""
    options = autockpt.SolverOptions()
    assert recompute_actions(options.checkpoint, CaptureKind.MODULE) == (Action.RECOMPUTE_TORCH,)
    assert recompute_actions(options.checkpoint, CaptureKind.EXPORT) == RECOMPUTE_KINDS
    assert recompute_actions(autockpt.SolverOptions(checkpoint="recompute_function").checkpoint, CaptureKind.MODULE) == (
        Action.RECOMPUTE_OWN,
    )


# ------------------------------------------------------------------------------------------ autograd behaviour


def _two_layer_regions() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(8, 8), nn.Linear(8, 8), torch.randn(4, 8)


def _checkpointed(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    (y,) = checkpointed_call(lambda v: (torch.tanh(layer(v)),), (x,), {}, list(layer.parameters()), [], closed=True)
    return y


def test_parameter_gradients_reach_torch_autograd_grad_even_when_no_input_needs_one() -> None:
    first, second, x = _two_layer_regions()  # x needs no gradient: the first region's only trainable inputs are params
    reference = torch.tanh(second(torch.tanh(first(x)))).sum()
    expected = torch.autograd.grad(reference, [*first.parameters(), *second.parameters()])
    loss = _checkpointed(second, _checkpointed(first, x)).sum()
    got = torch.autograd.grad(loss, [*first.parameters(), *second.parameters()])
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want)
    assert all(p.grad is None for p in [*first.parameters(), *second.parameters()])  # grad() accumulates nothing


@pytest.mark.parametrize("kind", RECOMPUTE_KINDS)
def test_second_order_gradients_match_pytorch(kind: Action) -> None:
    """A gradient penalty (differentiate the input gradient again) through every checkpointed region: the
    recomputation must stay connected to the region's real inputs when backward builds a graph."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    reference = twin(zoo.ZooCase(name="penalty", model=model, args=()))
    x = torch.randn(8, 16)
    planner = autockpt.Planner.from_model(model, example_inputs=(x,), checkpoint=kind)
    module = planner.apply(baseline_plan(planner, "every_1"))
    assert autockpt.get_plan(module).regions

    def penalised_gradients(net: nn.Module) -> list[torch.Tensor]:
        inputs = x.clone().requires_grad_(True)
        (input_gradient,) = torch.autograd.grad(net(inputs).pow(2).sum(), inputs, create_graph=True)
        return list(torch.autograd.grad(input_gradient.pow(2).sum(), [inputs, *net.parameters()]))

    for have, want in zip(penalised_gradients(module), penalised_gradients(reference)):
        torch.testing.assert_close(have, want)


def test_outputs_that_need_no_gradient_stay_that_way() -> None:
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def run(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = layer(v)
        return hidden, hidden > 0, hidden.detach() * 2  # a float that autograd does not track

    hidden, mask, detached = checkpointed_call(run, (x,), {}, list(layer.parameters()), [], closed=True)
    assert hidden.requires_grad and not mask.requires_grad and not detached.requires_grad


def test_dropout_draws_the_same_mask_when_recomputed_and_the_rng_moves_on_as_without_checkpoint() -> None:
    layer = nn.Linear(16, 16)
    x = torch.randn(32, 16, requires_grad=True)

    def run(v: torch.Tensor) -> tuple[torch.Tensor]:
        return (nn.functional.dropout(layer(v), p=0.5, training=True),)

    torch.manual_seed(3)
    expected = run(x)[0]
    expected.sum().backward()
    want, after_reference = x.grad.clone(), torch.get_rng_state()
    x.grad = None
    torch.manual_seed(3)
    (got,) = checkpointed_call(run, (x,), {}, list(layer.parameters()), [], closed=True)
    got.sum().backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(x.grad, want)
    assert torch.equal(torch.get_rng_state(), after_reference)


def test_a_module_reading_a_tensor_it_was_not_given_still_gets_its_gradient(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    scale = torch.tensor(2.0, requires_grad=True)  # neither an argument nor a parameter of the module

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 8)

        def forward(self, v: torch.Tensor) -> torch.Tensor:
            return self.layer(v) * scale

    module, x = Scaled(), torch.randn(4, 8)
    module(x).sum().backward()
    want = scale.grad.clone()
    scale.grad = None
    monkeypatch.setattr("autockpt.runtime.recompute._warned_foreign", False)
    with caplog.at_level(logging.WARNING, logger="autockpt.runtime.recompute"):
        out = checkpointed_call(module.forward, (x,), {}, list(module.parameters()), [], closed=False)
        out.sum().backward()
    torch.testing.assert_close(scale.grad, want)
    assert "neither its arguments nor its parameters" in caplog.text
