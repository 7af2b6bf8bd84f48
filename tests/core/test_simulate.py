"""Simulator: hand-built timelines (early stop, held region outputs, whole-region recomputation and held output
gradients under autockpt's own checkpoint), the vectorised simulator against the reference one, and predicted peaks
against measured ones for random plans, a loss that saves activations and a region ending in a matmul."""

from __future__ import annotations

import random

import pytest
import torch
from edge_models import Chain
from support import FREE_MACHINERY, planner_for, tiny, torch_actions, torch_scorer
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import autockpt
from autockpt import PlanOptions
from autockpt.core.region_rules import region_windows
from autockpt.core.simulate import _predict, simulate
from autockpt.core.solve.base import region_actions
from autockpt.core.solve.candidates import candidate_regions
from autockpt.measure.capture import capture
from autockpt.measure.loss import default_loss
from autockpt.measure.sources import StepInputs
from autockpt.measure.trace import trace_step
from autockpt.present import zoo
from autockpt.types import (
    Action,
    ActionPrice,
    CostModel,
    MemoryEvent,
    Phase,
    Region,
    RegionAction,
    StepTrace,
    StorageLife,
    Timeline,
    UnitCost,
)

# ------------------------------------------------------------------------------------------ hand-built timelines


def _hand_built_profile() -> StepTrace:
    """Two units: unit 0 makes A (1000 B) that unit 1 saves; unit 1 makes the output B (10 B, kept by the caller).

    Static bytes are 100; the backward of unit 1 needs a 1000 B temporary.
    """
    units = (
        UnitCost(index=0, forward_ms=2.0, flops=0, output_bytes=1000, saved_bytes=0),
        UnitCost(index=1, forward_ms=3.0, flops=0, output_bytes=10, saved_bytes=1000),
    )
    storages = (
        StorageLife(index=0, nbytes=1000, producer_unit=0, alloc_event=0, last_forward_use_event=1, free_event=3,
                    user_units=(1,), saver_units=(1,), saver_release_events=(3,)),
        StorageLife(index=1, nbytes=10, producer_unit=1, alloc_event=1, last_forward_use_event=1, free_event=None,
                    user_units=(), saver_units=(), saver_release_events=()),
    )
    events = (
        MemoryEvent(index=0, phase=Phase.FORWARD, unit=0, start_bytes=100, peak_bytes=1100),
        # unit 1 packs A before its kernel makes B
        MemoryEvent(index=1, phase=Phase.FORWARD, unit=1, start_bytes=1100, peak_bytes=1110, pack_peak_bytes=1100),
        MemoryEvent(index=2, phase=Phase.BACKWARD, unit=-1, start_bytes=1110, peak_bytes=1110),
        MemoryEvent(index=3, phase=Phase.BACKWARD, unit=1, start_bytes=1110, peak_bytes=2110),
        MemoryEvent(index=4, phase=Phase.BACKWARD, unit=-1, start_bytes=110, peak_bytes=110),
    )
    return StepTrace(units=units, storages=storages, events=events, parameter_bytes=100, buffer_bytes=0, input_bytes=0,
                   gradient_bytes=0, baseline_peak_bytes=2110, forward_ms=5.0, step_ms=10.0)


def test_simulator_on_a_hand_built_timeline() -> None:
    profile_ = _hand_built_profile()
    assert torch_scorer(profile_).simulate(()).event_bytes == (1100, 1110, 1110, 2110, 110)
    region = Region(first_unit=0, last_unit=1)
    (window,) = region_windows(profile_, torch_actions((region,)))
    assert (window.first_backward_event, window.last_backward_event, window.last_saver_unit) == (3, 3, 1)
    # unit 1 saves only its input A, which autograd packs before the kernel: early stop skips unit 1 entirely
    assert window.last_recomputed_unit == 0
    timeline = torch_scorer(profile_).simulate((region,))
    # A is freed after its last forward use, so the start of backward holds only static + output B
    assert timeline.event_bytes[2] == 110
    # at unit 1's backward A is recomputed by re-running unit 0 only: still 2110 at the peak of that event
    assert timeline.event_bytes[3] == 2110
    assert timeline.burst_bytes == (110 + 1000,)
    assert timeline.recompute_ms == 2.0


def test_recomputation_holds_the_region_outputs_and_stops_at_the_last_pack() -> None:
    """Region = units 0-1. Unit 0 makes A (1000 B) that only unit 2, outside the region, reads; unit 1 makes S
    (500 B) and saves it, then makes T (200 B) for unit 2 after that pack (a dropout: mask, then masked output).

    When backward reaches unit 1, the region re-runs as one function: A is one of its return values, so it stays
    alive while unit 1 re-runs, and the re-run stops at unit 1's pack, before T exists.
    """
    units = (
        UnitCost(index=0, forward_ms=1.0, flops=0, output_bytes=1000, saved_bytes=0),
        UnitCost(index=1, forward_ms=1.0, flops=0, output_bytes=700, saved_bytes=500),
        UnitCost(index=2, forward_ms=1.0, flops=0, output_bytes=10, saved_bytes=0),
    )
    storages = (
        StorageLife(index=0, nbytes=1000, producer_unit=0, alloc_event=0, last_forward_use_event=2, free_event=2,
                    user_units=(2,), saver_units=(), saver_release_events=()),
        StorageLife(index=1, nbytes=500, producer_unit=1, alloc_event=1, last_forward_use_event=1, free_event=4,
                    user_units=(1,), saver_units=(1,), saver_release_events=(4,)),
        StorageLife(index=2, nbytes=200, producer_unit=1, alloc_event=1, last_forward_use_event=2, free_event=2,
                    user_units=(2,), saver_units=(), saver_release_events=()),
        StorageLife(index=3, nbytes=10, producer_unit=2, alloc_event=2, last_forward_use_event=2, free_event=None,
                    user_units=(), saver_units=(), saver_release_events=()),
    )
    events = (
        MemoryEvent(index=0, phase=Phase.FORWARD, unit=0, start_bytes=100, peak_bytes=1100),
        MemoryEvent(index=1, phase=Phase.FORWARD, unit=1, start_bytes=1100, peak_bytes=1800, pack_peak_bytes=1600),
        MemoryEvent(index=2, phase=Phase.FORWARD, unit=2, start_bytes=1800, peak_bytes=1810),
        MemoryEvent(index=3, phase=Phase.BACKWARD, unit=-1, start_bytes=610, peak_bytes=610),
        MemoryEvent(index=4, phase=Phase.BACKWARD, unit=1, start_bytes=610, peak_bytes=1110),
        MemoryEvent(index=5, phase=Phase.BACKWARD, unit=-1, start_bytes=110, peak_bytes=110),
    )
    profile_ = StepTrace(units=units, storages=storages, events=events, parameter_bytes=100, buffer_bytes=0,
                       input_bytes=0, gradient_bytes=0, baseline_peak_bytes=1810, forward_ms=3.0, step_ms=6.0)
    timeline = torch_scorer(profile_).simulate((Region(first_unit=0, last_unit=1),))
    # before the re-run: static 100 + output 10 (S is not kept by autograd any more); then A 1000 + S 500, no T
    assert timeline.burst_bytes == (110 + 1000 + 500,)


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
    measured = StepTrace(units=units, storages=storages, events=events, parameter_bytes=0, buffer_bytes=0,
                         input_bytes=0, gradient_bytes=0, baseline_peak_bytes=1110, forward_ms=3.0, step_ms=6.0,
                         gradient_lifetimes=True)
    region = Region(first_unit=0, last_unit=1)
    own_action = region_actions((region,), Action.RECOMPUTE_OWN)
    torch_semantics = simulate(measured, FREE_MACHINERY, torch_actions((region,)))
    (torch_window,), (own_window,) = region_windows(measured, torch_actions((region,))), region_windows(measured, own_action)
    assert torch_window.last_recomputed_unit == 0  # unit 1 saves only A, packed before its kernel: early stop
    assert own_window.last_recomputed_unit == 1
    own_semantics = simulate(measured, FREE_MACHINERY, own_action)
    assert (torch_semantics.recompute_ms, own_semantics.recompute_ms) == (1.0, 2.0)
    # the re-run reaches B (100 B) on top of A (1000 B); torch's stops at the pack of A
    assert own_semantics.burst_bytes[0] - torch_semantics.burst_bytes[0] == 200  # B, and B's gradient held
    # B's gradient: +100 B from the region's first backward event to its last (events 5 and 6), nowhere else; at
    # event 5 the re-run's copy of B comes on top
    difference = [b - a for a, b in zip(torch_semantics.event_bytes, own_semantics.event_bytes)]
    assert difference[5:7] == [200, 100] and not any(difference[:5]) and not difference[7]


# ------------------------------------------------------------------------------------------ vectorised vs reference


def _reference(trace: StepTrace, costs: CostModel, plan: tuple[RegionAction, ...]) -> Timeline:
    return _predict(trace, costs, plan, detailed=False).timeline


def _unsolved(name: str) -> zoo.ZooCase:
    """The zoo's tiny ``name`` for the tests here, which solve no program (candidate and hand-drawn regions): the
    transformer with two of its six layers, which only repeat what two show when nothing is solved (``tiny`` keeps
    six for budgets a solver answers)."""
    return zoo.build(name, "tiny", blocks=2) if name == "transformer" else tiny(name)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_the_vectorised_simulator_gives_the_reference_timeline(name: str) -> None:
    """``simulate`` (numpy, facts cached per region and action) and ``_predict`` (storage by storage) give equal
    timelines, every field (float sums bit for bit), on every candidate alone under each action and on random plans
    of mixed actions, in any region order."""
    planner = planner_for(_unsolved(name), checkpoint="auto")  # both kinds: the trace has gradient lifetimes
    # prices injected, not calibrated (issue 46: a calibration on a loaded machine measured 0.0 and failed the
    # precondition): nonzero and uneven per action, so that every float sum of the machinery is compared
    trace = planner.trace
    costs = CostModel(device="cpu", prices=tuple(
        ActionPrice(action=a, region_ms=0.31 + 0.07 * i, saved_tensor_ms=0.0173 + 0.0041 * i) for i, a in enumerate(Action)
    ))
    assert trace.gradient_lifetimes and costs.price(Action.RECOMPUTE_OWN).saved_tensor_ms > 0
    _, candidates = candidate_regions(planner.graph, trace)
    actions = (Action.RECOMPUTE_TORCH, Action.RECOMPUTE_OWN)
    plans: list[tuple[RegionAction, ...]] = [()]
    plans += [(RegionAction(region=c, action=a),) for c in candidates for a in actions]
    rng = random.Random(0)
    for _ in range(40):
        chosen: list[Region] = []
        density = rng.choice((0.05, 0.3, 1.0))
        for region in rng.sample(candidates, len(candidates)):
            if not any(region.overlaps(r) for r in chosen) and rng.random() < density:
                chosen.append(region)  # unsorted on purpose: burst and re-run lists follow the given order
        plans.append(tuple(RegionAction(region=r, action=rng.choice(actions)) for r in chosen))
    for plan in plans:
        timeline = simulate(trace, costs, plan)
        assert timeline == _reference(trace, costs, plan), plan
        assert all(type(b) is int for b in (*timeline.event_bytes, *timeline.burst_bytes, timeline.peak_bytes))
    # the same errors as the reference
    for bad in (
        (RegionAction(region=candidates[0], action=Action.RECOMPUTE_TORCH),) * 2,
        (RegionAction(region=Region(first_unit=0, last_unit=len(trace.units)), action=Action.RECOMPUTE_TORCH),),
    ):
        with pytest.raises(ValueError) as expected:
            _reference(trace, costs, bad)
        with pytest.raises(ValueError, match="overlap|past the last unit") as got:
            simulate(trace, costs, bad)
        assert str(got.value) == str(expected.value)


def test_the_vectorised_simulator_on_hand_built_traces() -> None:
    """The hand-built trace (no gradient lifetimes): equal timelines under torch's checkpoint with priced machinery;
    autockpt's own checkpoint is refused with the reference's error."""
    trace = _hand_built_profile()
    price = ActionPrice(action=Action.RECOMPUTE_TORCH, region_ms=0.1, saved_tensor_ms=0.03)
    costs = CostModel(device="cpu", prices=(price,))
    for regions in ((), (Region(first_unit=0, last_unit=1),), (Region(first_unit=1, last_unit=1),)):
        plan = torch_actions(regions)
        assert simulate(trace, costs, plan) == _reference(trace, costs, plan)
    own = region_actions((Region(first_unit=0, last_unit=0),), Action.RECOMPUTE_OWN)
    with pytest.raises(ValueError) as expected:
        _reference(trace, costs, own)
    with pytest.raises(ValueError, match="gradient lifetimes") as got:
        simulate(trace, costs, own)
    assert str(got.value) == str(expected.value)


# ------------------------------------------------------------------------------------------ predicted vs measured


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_simulated_peak_equals_measured_peak_for_random_plans(name: str) -> None:
    case = _unsolved(name)
    loss_fn = case.loss_fn or default_loss
    graph = capture(case.model, case.args, case.kwargs)
    measured = trace_step(graph, case.args, case.kwargs, loss_fn)
    _, candidates = candidate_regions(graph, measured)
    # plans of hand-drawn regions scored on this trace (no floor is searched: none is solved)
    step = StepInputs.check(case.model, case.args, case.kwargs, case.loss_fn)
    planner = autockpt.Planner(graph, measured, FREE_MACHINERY, PlanOptions(checkpoint=Action.RECOMPUTE_TORCH), step=step)
    rng = random.Random(0)
    for _ in range(6):
        chosen: list[Region] = []
        for region in rng.sample(candidates, len(candidates)):
            if all(region.last_unit < r.first_unit or region.first_unit > r.last_unit for r in chosen) and rng.random() < 0.5:
                chosen.append(region)
        plan = planner.plan_for_regions(chosen, strategy="given")
        predicted = torch_scorer(measured).simulate(plan.regions).peak_bytes
        module = planner.apply(plan)  # a copy of the captured graph rewritten, not a new capture per plan
        actual = autockpt.measure_step(module, case.args, case.kwargs, case.loss_fn).peak_bytes
        # exact for most plans; regions whose ops write in place are over-predicted by up to ~2 % (the safe side)
        assert -0.005 * actual <= predicted - actual <= 0.02 * actual, (chosen, predicted, actual)


def test_loss_function_that_saves_activations_is_accounted() -> None:
    """exp() in the loss saves the model's output; a region that ends the graph must not drop that hold."""
    torch.manual_seed(0)
    model, x = Chain(depth=6), torch.randn(512, 128)
    model.head = nn.Linear(128, 2048)  # a wide output, so the loss's saved copy of it dominates the peak
    loss_fn = lambda out: out.exp().mean()
    # one capture and trace: the hand-made regions need no solved plan to carry them
    planner = autockpt.Planner.from_model(model, example_inputs=(x,), loss_fn=loss_fn,
                                          checkpoint=Action.RECOMPUTE_TORCH)
    measured_profile = planner.trace
    last = len(measured_profile.units) - 1
    for first in (last - 2, last - 4):
        region = Region(first_unit=first, last_unit=last)
        predicted = torch_scorer(measured_profile).simulate((region,)).peak_bytes
        module = planner.apply(planner.plan_for_regions([region], strategy="given"))
        measured = autockpt.measure_step(module, (x,), None, loss_fn).peak_bytes
        assert abs(predicted - measured) <= 0.01 * measured, (region, predicted, measured)


def test_a_region_ending_in_a_matmul_does_not_rerun_it() -> None:
    """Early stop: the last Linear of a region saves only its inputs, so its matmul is not recomputed."""
    case = tiny("mlp")
    # one capture and trace, for the windows and the rewrite; torch's checkpoint, as ``region_windows`` below
    planner = planner_for(case, checkpoint=Action.RECOMPUTE_TORCH)
    measured = planner.trace
    linear_units = [u.index for u in measured.units if u.flops > 0]
    region = Region(first_unit=linear_units[2] + 1, last_unit=linear_units[4])  # GELU, Linear, GELU, Linear
    (window,) = region_windows(measured, torch_actions((region,)))
    assert window.last_saver_unit == linear_units[4] and window.last_recomputed_unit == linear_units[4] - 1
    module = planner.apply(planner.plan_for_regions([region], strategy="given"))  # scored, not solved: no floor search

    def step_flops(m: nn.Module) -> int:
        counter = FlopCounterMode(display=False)
        with counter:
            m(*case.args).sum().backward()
        return counter.get_total_flops()

    assert step_flops(module) - step_flops(case.model) == measured.units[linear_units[3]].flops
