"""autockpt's own checkpoint (``CheckpointKind.RECOMPUTE_FUNCTION``): same step as PyTorch, budgets kept, the
simulator's whole-region semantics, and the autograd behaviour users rely on."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import nn

import autockpt
from autockpt import zoo
from autockpt.profile import for_checkpoint
from autockpt.recompute import checkpointed_call
from autockpt.simulate import region_windows, simulate
from autockpt.solve.baselines import baseline_plan
from autockpt.types import CaptureKind, CheckpointKind, MemoryEvent, Phase, Profile, Region, StorageLife, UnitCost
from conftest import assert_same_step, budget_at, probe, twin, zoo_params

FUNCTION = autockpt.SolverOptions(checkpoint="recompute_function")

MODELS = zoo_params("mlp", "cnn", "transformer", "control_flow", "gpt2", "unet")


@pytest.mark.parametrize("name", MODELS)
def test_budget_is_kept_and_step_matches_pytorch(name: str) -> None:
    case = zoo.build(name)
    reference = twin(case)
    budget = budget_at(probe(case), 0.5)
    optimized = autockpt.optimize(
        case.model, budget_bytes=budget, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn,
        solver_options=FUNCTION,
    )
    plan = autockpt.get_plan(optimized)
    assert plan.checkpoint_kind is CheckpointKind.RECOMPUTE_FUNCTION and plan.regions
    assert_same_step(optimized, reference, case)  # outputs, gradients, BatchNorm statistics, dropout masks
    measured = autockpt.measure_step(optimized, case.args, case.kwargs, case.loss_fn).peak_bytes
    assert measured <= budget
    assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * measured, (measured, plan.predicted_peak_bytes)


@pytest.mark.parametrize("strategy", ["every_1", "sqrt_n", "for_transformers"])
def test_the_simulator_is_exact_for_block_aligned_and_cut_regions(strategy: str) -> None:
    case = zoo.build("transformer")
    planner = autockpt.Planner(case.model, example_inputs=case.args, loss_fn=case.loss_fn, solver_options=FUNCTION)
    the_plan = baseline_plan(planner, strategy)
    module = planner.apply(the_plan)
    assert_same_step(module, twin(case), case)
    measured = autockpt.measure_step(module, case.args, case.kwargs, case.loss_fn).peak_bytes
    assert measured == pytest.approx(the_plan.predicted_peak_bytes, rel=0.01)


def test_a_plan_file_keeps_its_checkpoint_kind(tmp_path) -> None:  # noqa: ANN001
    case = zoo.build("mlp")
    the_plan = autockpt.plan(
        case.model, budget_bytes=budget_at(probe(case), 0.5), example_inputs=case.args, solver_options=FUNCTION
    )
    the_plan.save(tmp_path / "plan.json")
    loaded = autockpt.load_plan(tmp_path / "plan.json")
    assert loaded.checkpoint_kind is CheckpointKind.RECOMPUTE_FUNCTION
    module = autockpt.apply_plan(case.model, loaded, example_inputs=case.args)
    assert_same_step(module, twin(case), case)


def test_an_unknown_checkpoint_kind_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="'auto' or one of .*recompute_function"):
        autockpt.SolverOptions(checkpoint="reentrant")


# ----------------------------------------------------------------------------------------------- "auto" choice


def test_auto_plans_for_both_kinds_and_keeps_the_cheaper_predicted_plan() -> None:
    """plan() with "auto": the smaller predicted overhead of the two kinds' plans at each budget, and the smaller of
    their floors; each kind planned alone on the same measured step gives the figures to compare with."""
    case = zoo.build("transformer")
    auto = autockpt.Planner(case.model, example_inputs=case.args, loss_fn=case.loss_fn)
    assert auto.checkpoint_kinds == tuple(CheckpointKind)
    alone = {}
    for kind in CheckpointKind:
        planner = autockpt.Planner(
            case.model, example_inputs=case.args, loss_fn=case.loss_fn, solver_options=autockpt.SolverOptions(checkpoint=kind)
        )
        planner.profile = for_checkpoint(auto.profile, kind, torch.device("cpu"))  # the same measured step
        alone[kind] = planner
    floors = {kind: _floor(planner) for kind, planner in alone.items()}
    assert _floor(auto) == min(floors.values())
    top = auto.profile.baseline_peak_bytes
    for fraction in (0.3, 0.5, 0.8):
        budget = int(max(floors.values()) + fraction * (top - max(floors.values())))
        plans = {kind: planner.plan(budget_bytes=budget) for kind, planner in alone.items()}
        cheaper = min(plans.values(), key=lambda p: p.predicted_overhead)
        chosen = auto.plan(budget_bytes=budget)
        assert chosen.predicted_overhead == pytest.approx(min(p.predicted_overhead for p in plans.values()))
        assert chosen.regions == cheaper.regions and chosen.checkpoint_kind is cheaper.checkpoint_kind


def _floor(planner: autockpt.Planner) -> int:
    with pytest.raises(autockpt.InfeasibleBudgetError) as error:
        planner.plan(budget_bytes=1)
    return error.value.min_feasible_bytes


def test_auto_optimize_times_both_kinds_plans_and_returns_one_that_trains_like_pytorch() -> None:
    case = zoo.build("gpt2")
    budget = budget_at(probe(case), 0.5)
    optimized = autockpt.optimize(
        case.model, budget_bytes=budget, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn
    )
    plan = autockpt.get_plan(optimized)
    assert plan.regions and plan.measured_peak_bytes <= budget
    assert any(note.startswith(f"checkpoint {plan.checkpoint_kind.value} chosen by measured step time") for note in plan.notes)
    assert_same_step(optimized, twin(case), case)


def test_auto_leaves_module_level_captures_on_torch_s_checkpoint() -> None:
    """A module's forward may read tensors it is not given; only torch's checkpoint gives those gradients through
    autograd."""
    options = autockpt.SolverOptions()
    assert options.checkpoint_kinds(CaptureKind.MODULE) == (CheckpointKind.TORCH_NON_REENTRANT,)
    assert options.checkpoint_kinds(CaptureKind.EXPORT) == tuple(CheckpointKind)
    assert autockpt.SolverOptions(checkpoint="recompute_function").checkpoint_kinds(CaptureKind.MODULE) == (
        CheckpointKind.RECOMPUTE_FUNCTION,
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


@pytest.mark.parametrize("kind", list(CheckpointKind))
def test_second_order_gradients_match_pytorch(kind: CheckpointKind) -> None:
    """A gradient penalty (differentiate the input gradient again) through every checkpointed region: the
    recomputation must stay connected to the region's real inputs when backward builds a graph."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    reference = twin(zoo.ZooCase(name="penalty", model=model, args=()))
    x = torch.randn(8, 16)
    planner = autockpt.Planner(model, example_inputs=(x,), solver_options=autockpt.SolverOptions(checkpoint=kind))
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
    monkeypatch.setattr("autockpt.recompute._warned_foreign", False)
    with caplog.at_level(logging.WARNING, logger="autockpt.recompute"):
        out = checkpointed_call(module.forward, (x,), {}, list(module.parameters()), [], closed=False)
        out.sum().backward()
    torch.testing.assert_close(scale.grad, want)
    assert "neither its arguments nor its parameters" in caplog.text


# ------------------------------------------------------------------------------------------------ simulator


def test_the_whole_region_is_recomputed_and_output_gradients_are_held() -> None:
    """Units 0-1 form the region; unit 0 makes A (saved by unit 1), unit 1 makes B, read by unit 2 outside. In the
    measured step B's gradient is gone after event 4 (unit 2's backward); the region's backward is events 5-6. Under
    autockpt's checkpoint unit 1 re-runs too (no early stop) and B's gradient (100 B) lives on through event 6."""
    units = tuple(UnitCost(index=i, forward_ms=1.0, flops=0, output_bytes=0, saved_bytes=0) for i in range(3))
    storages = (
        StorageLife(index=0, nbytes=1000, producer_unit=0, alloc_event=0, last_forward_use_event=1, free_event=6,
                    user_units=(1,), saver_units=(1,), saver_release_events=(6,)),
        StorageLife(index=1, nbytes=100, producer_unit=1, alloc_event=1, last_forward_use_event=2, free_event=2,
                    user_units=(2,), saver_units=(), saver_release_events=(), gradient_free_event=4),
        StorageLife(index=2, nbytes=10, producer_unit=2, alloc_event=2, last_forward_use_event=2, free_event=None,
                    user_units=(), saver_units=(), saver_release_events=()),
    )
    events = (
        MemoryEvent(index=0, phase=Phase.FORWARD, unit=0, start_bytes=0, peak_bytes=1000),
        MemoryEvent(index=1, phase=Phase.FORWARD, unit=1, start_bytes=1000, peak_bytes=1100, pack_peak_bytes=1000),
        MemoryEvent(index=2, phase=Phase.FORWARD, unit=2, start_bytes=1100, peak_bytes=1110),
        MemoryEvent(index=3, phase=Phase.BACKWARD, unit=-1, start_bytes=1010, peak_bytes=1010),
        MemoryEvent(index=4, phase=Phase.BACKWARD, unit=2, start_bytes=1010, peak_bytes=1110),
        MemoryEvent(index=5, phase=Phase.BACKWARD, unit=1, start_bytes=1010, peak_bytes=1010),
        MemoryEvent(index=6, phase=Phase.BACKWARD, unit=1, start_bytes=1010, peak_bytes=1010),
        MemoryEvent(index=7, phase=Phase.BACKWARD, unit=-1, start_bytes=10, peak_bytes=10),
    )
    measured = Profile(units=units, storages=storages, events=events, parameter_bytes=0, buffer_bytes=0,
                       input_bytes=0, gradient_bytes=0, baseline_peak_bytes=1110, forward_ms=3.0, step_ms=6.0)
    region = Region(first_unit=0, last_unit=1)
    torch_semantics = simulate(measured, (region,))
    own = dataclasses.replace(measured, checkpoint_kind=CheckpointKind.RECOMPUTE_FUNCTION)
    (torch_window,), (own_window,) = region_windows(measured, (region,)), region_windows(own, (region,))
    assert torch_window.last_recomputed_unit == 0  # unit 1 saves only A, packed before its kernel: early stop
    assert own_window.last_recomputed_unit == 1
    own_semantics = simulate(own, (region,))
    assert (torch_semantics.recompute_ms, own_semantics.recompute_ms) == (1.0, 2.0)
    # the re-run reaches B (100 B) on top of A (1000 B); torch's stops at the pack of A
    assert own_semantics.burst_bytes[0] - torch_semantics.burst_bytes[0] == 200  # B, and B's gradient held
    # B's gradient: +100 B from the region's first backward event to its last (events 5 and 6), nowhere else; at
    # event 5 the re-run's copy of B comes on top
    difference = [b - a for a, b in zip(torch_semantics.event_bytes, own_semantics.event_bytes)]
    assert difference[5:7] == [200, 100] and not any(difference[:5]) and not difference[7]
