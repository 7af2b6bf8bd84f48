"""Plans made under ``torch.autocast`` keep their budget and predict their peak (issue 23, item 4).

Autocast caches the low-precision copy of each parameter it casts until the context exits, so checkpointing does
not free those copies and a recomputation takes them from the cache instead of making them again; a copy reused
from an earlier step of the same context held every weight's gradient until the end of backward. The trace records
the copies as owned by no unit, every planned step starts with the cache empty, and the simulator knows that
autockpt's own checkpoint makes those parameters' float32 gradients only at the end of the region's backward.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import autockpt
from autockpt.core.simulate import _predict, simulate
from autockpt.core.solve.candidates import candidate_regions
from autockpt.types import OUTSIDE_GRAPH_UNIT, Action, Region, RegionAction

transformers = pytest.importorskip("transformers")


def bf16() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _decoder() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(
        vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=256,
    )
    return transformers.GPTNeoXForCausalLM(config), torch.randint(0, 128, (2, 128))


@pytest.fixture(scope="module")
def bf16_decoder() -> tuple[nn.Module, torch.Tensor, autockpt.Planner, int, int]:
    """The decoder, its ids and its planner under bf16 autocast, with the floor and the unmodified peak: the two
    tests below plan the same model alike (planning leaves its weights as they were, and every step measured starts
    from gradients None)."""
    model, ids = _decoder()
    with bf16():
        # the loss as captured: gradients are compared bit for bit below, which chunks of a bf16 projection are
        # not (within one bf16 rounding: tests/measure/test_chunked_tail.py)
        planner = autockpt.Planner.from_model(model, example_inputs=(ids,), example_kwargs={"labels": ids},
                                              loss_chunk_tokens=0)
        probe = planner.plan(budget_bytes=10**15)
    return model, ids, planner, probe.min_feasible_bytes, probe.baseline_peak_bytes


def test_gpt_neox_plans_under_bf16_autocast_keep_the_budget_and_predict_the_peak(
    bf16_decoder: tuple[nn.Module, torch.Tensor, autockpt.Planner, int, int],
) -> None:
    model, ids, planner, floor, top = bf16_decoder
    reference = copy.deepcopy(model)
    # a fifth of the way from the floor to the unmodified peak (two fifths: the next test's, whose prediction is
    # exact; a third budget, three fifths, was dropped as proving the same, issue 46)
    budget = int(floor + 0.2 * (top - floor))
    with bf16():
        module = planner.optimize(budget_bytes=budget)
    plan = autockpt.get_plan(module)
    measured = plan.measured_peak_bytes
    assert plan.regions, "nothing checkpointed"
    assert measured is not None and measured <= budget, f"measured {measured} > budget {budget}"
    assert abs(plan.predicted_peak_bytes - measured) <= 0.02 * measured, (plan.predicted_peak_bytes, measured)
    # a step in its own context, and two steps in one context (the second reuses nothing of the first)
    with bf16():
        alone = autockpt.measure_step(module, (ids,), {"labels": ids}).peak_bytes
    with bf16():
        first = autockpt.measure_step(module, (ids,), {"labels": ids}).peak_bytes
        second = autockpt.measure_step(module, (ids,), {"labels": ids}).peak_bytes
    assert alone == first == second
    assert abs(plan.predicted_peak_bytes - alone) <= 0.02 * alone

    for params in (module.parameters(), reference.parameters()):
        for param in params:
            param.grad = None
    with bf16():
        loss = module(ids, labels=ids).loss
        loss.backward()
        expected = reference(ids, labels=ids).loss
        expected.backward()
    assert torch.equal(loss, expected)
    for (name, got), (_, want) in zip(module.named_parameters(), reference.named_parameters()):
        assert torch.equal(got.grad, want.grad), f"gradient of {name}"


def _memtracker_peak_bytes(module: nn.Module, ids: torch.Tensor, *, keep_output: bool) -> int:
    """torch's MemTracker around one step of ``module`` (gradients None at the start, the inputs tracked as external),
    the output kept through backward (``out = module(...); out.loss.backward()``) or dropped before it
    (``module(...).loss.backward()``)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    for param in module.parameters():
        param.grad = None
    tracker = MemTracker()
    tracker.track_external(module, ids)
    with tracker:
        output = module(ids, labels=ids)
        loss = output.loss
        if not keep_output:
            del output
        loss.backward()
    for param in module.parameters():
        param.grad = None
    return tracker.get_tracker_snapshot("peak")[ids.device]["Total"]


def test_memtracker_measures_an_optimized_bf16_step_as_the_prediction_and_measure_step(
    bf16_decoder: tuple[nn.Module, torch.Tensor, autockpt.Planner, int, int],
) -> None:
    """Issue 37 item 1: MemTracker around the optimized step, run as ``measure_step`` runs it (the output kept until
    backward is done), gives the predicted peak and ``measure_step``'s to the byte, in a context of its own and on
    the second step of one context. MemTracker's lower figure in the issue is a step that drops the output before
    backward (``model(ids, labels=ids).loss.backward()``): it peaks lower by at most the output's bf16 logits, which
    backward does not keep (the loss reads a float32 copy of them); here by all of their bytes."""
    model, ids, planner, floor, top = bf16_decoder
    with bf16():
        budget = int(floor + 0.4 * (top - floor))
        plan = planner.plan(budget_bytes=budget)
        module = planner.apply(plan)
    assert plan.regions
    predicted = plan.predicted_peak_bytes
    with bf16():
        measured = autockpt.measure_step(module, (ids,), {"labels": ids}).peak_bytes
    with bf16():
        alone = _memtracker_peak_bytes(module, ids, keep_output=True)
    with bf16():
        first = _memtracker_peak_bytes(module, ids, keep_output=True)
        second = _memtracker_peak_bytes(module, ids, keep_output=True)
    assert predicted == measured == alone == first == second <= budget
    with bf16():
        dropped = _memtracker_peak_bytes(module, ids, keep_output=False)
    logits_bytes = ids.numel() * model.config.vocab_size * torch.bfloat16.itemsize
    assert 0 < measured - dropped <= logits_bytes


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(128, 128), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(128, 10)), torch.randn(256, 128)


def _float_sum(output: torch.Tensor) -> torch.Tensor:
    return output.float().sum()


def test_each_action_recomputes_regions_without_making_the_weight_copies_again() -> None:
    """The last layers' regions recompute at the start of backward, where the peak is. Before, their cached weight
    copies were counted again as recomputed copies (predicted 65.5 kB high here, both actions), and autockpt's own
    checkpoint made the float32 gradients later than the trace recorded (three regions: 99.3 kB low)."""
    model, x = _mlp()
    with bf16():
        planner = autockpt.Planner.from_model(model, example_inputs=(x,), loss_fn=_float_sum, checkpoint="auto")
        casts = [s for s in planner.trace.storages if s.producer_unit == OUTSIDE_GRAPH_UNIT and s.free_event is None
                 and s.alloc_event > 0]
        # one low-precision copy per weight and bias, owned by no unit and saved by none
        assert len(casts) == len(list(model.parameters()))
        assert all(not s.saver_units and not s.user_units for s in casts)
        for action in (Action.RECOMPUTE_TORCH, Action.RECOMPUTE_OWN):
            for spans in ([(8, 11)], [(0, 3), (4, 7), (8, 11)]):
                plan = planner.plan_for_regions(
                    [Region(first_unit=a, last_unit=b) for a, b in spans], strategy="test", action=action
                )
                measured = planner.measured_peak_bytes(planner.apply(plan))
                assert plan.predicted_peak_bytes == measured, f"{action.value} {spans}"


def test_the_vectorised_simulator_gives_the_reference_timeline_under_autocast() -> None:
    """The autocast rules (weight copies not remade, late float32 gradients) are the same in both simulators."""
    model, ids = _decoder()
    with bf16():
        # the loss as captured: gradients are compared bit for bit below, which chunks of a bf16 projection are
        # not (within one bf16 rounding: tests/measure/test_chunked_tail.py)
        planner = autockpt.Planner.from_model(model, example_inputs=(ids,), example_kwargs={"labels": ids},
                                              loss_chunk_tokens=0, checkpoint="auto")  # both kinds' rules
    trace, costs = planner.trace, planner.costs
    assert any(s.producer_unit == OUTSIDE_GRAPH_UNIT and s.gradient_free_event is not None for s in trace.storages)
    _, candidates = candidate_regions(planner.graph, trace)
    actions = (Action.RECOMPUTE_TORCH, Action.RECOMPUTE_OWN)
    rng = random.Random(0)
    plans = [(RegionAction(region=c, action=a),) for c in candidates for a in actions]
    for _ in range(30):
        chosen: list[Region] = []
        for region in rng.sample(candidates, len(candidates)):
            if not any(region.overlaps(r) for r in chosen) and rng.random() < 0.3:
                chosen.append(region)
        plans.append(tuple(RegionAction(region=r, action=rng.choice(actions)) for r in chosen))
    for plan in plans:
        assert simulate(trace, costs, plan) == _predict(trace, costs, plan, detailed=False).timeline, plan
