"""Baseline policies: blocks found from the graph, regions safe to checkpoint, PyTorch as the reference answer."""

from __future__ import annotations

import pytest
import torch
from support import assert_same_step, needs_transformers, tiny, twin
from torch import nn

import autockpt
from autockpt.core.solve.baselines import (
    BASELINE_STRATEGIES,
    BaselinePolicy,
    baseline_regions,
    find_blocks,
    parse_strategy,
)
from autockpt.core.solve.candidates import is_unsafe, mutation_hazards
from autockpt.planning.planner import baseline_plan
from autockpt.present import zoo
from autockpt.types import PlanStatus


def _planner(case: zoo.ZooCase) -> autockpt.Planner:
    return autockpt.Planner.from_model(case.model, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn)


@pytest.fixture(scope="module")
def transformer() -> tuple[zoo.ZooCase, autockpt.Planner]:
    # three of the tiny transformer's six layers: every_1, every_2 and every_4 still choose different blocks, and
    # the strategies here solve no program (``tiny`` keeps six for budgets a solver answers)
    case = zoo.build("transformer", "tiny", blocks=3)
    return case, _planner(case)


def test_parse_strategy() -> None:
    assert parse_strategy("every_3") == (BaselinePolicy.EVERY_N, 3)
    assert parse_strategy("sqrt_n") == (BaselinePolicy.SQRT_N, 0)
    with pytest.raises(ValueError, match="unknown baseline strategy 'every_layer'"):
        parse_strategy("every_layer")
    with pytest.raises(ValueError, match="N >= 1"):
        parse_strategy("every_0")


def test_blocks_are_the_repeated_layers(transformer: tuple[zoo.ZooCase, autockpt.Planner]) -> None:
    _, planner = transformer
    blocks = find_blocks(planner.graph)
    assert [b.name for b in blocks] == [f"blocks.{i}" for i in range(len(transformer[0].model.blocks))]
    units = planner.graph.units
    for block in blocks:  # every unit of the block's module lies inside its range, none of another block's
        inside = {u.index for u in units if u.module_path == block.name or u.module_path.startswith(block.name + ".")}
        assert min(inside) == block.first_unit and max(inside) == block.last_unit


def test_single_layer_children_grouped_by_period() -> None:
    model = nn.Sequential(*[layer for _ in range(5) for layer in (nn.Linear(16, 16), nn.GELU())], nn.Linear(16, 2))
    case = zoo.ZooCase(name="seq", model=model, args=(torch.randn(8, 16),))
    blocks = find_blocks(_planner(case).graph)
    assert [b.paths for b in blocks] == [(str(2 * i), str(2 * i + 1)) for i in range(5)]


def test_every_n_checkpoints_every_nth_block(transformer: tuple[zoo.ZooCase, autockpt.Planner]) -> None:
    _, planner = transformer
    blocks = find_blocks(planner.graph)
    for n in (1, 2, 4):
        chosen = baseline_regions(planner.graph, planner.trace, f"every_{n}")
        assert chosen.regions == tuple(b.region for b in blocks[::n])


@pytest.mark.parametrize("strategy", ["every_1", "every_2", "sqrt_n", "for_transformers", "memory_efficient"])
def test_baseline_step_matches_pytorch(transformer: tuple[zoo.ZooCase, autockpt.Planner], strategy: str) -> None:
    """Same outputs and gradients as the original model (dropout included), and the peak as simulated."""
    case, planner = transformer
    the_plan = baseline_plan(planner, strategy)
    assert the_plan.status is PlanStatus.GIVEN and the_plan.strategy == strategy and the_plan.regions
    module = planner.apply(the_plan)
    assert_same_step(module, twin(case), case)
    measured = autockpt.measure_step(module, case.args, case.kwargs, case.loss_fn).peak_bytes
    assert measured < planner.trace.baseline_peak_bytes
    # block-aligned or not (sqrt_n and for_transformers cut inside blocks), the simulator is exact to 1 %
    assert measured == pytest.approx(the_plan.predicted_peak_bytes, rel=0.01)


def test_none_and_speed_optimized_change_nothing(transformer: tuple[zoo.ZooCase, autockpt.Planner]) -> None:
    _, planner = transformer
    for strategy in ("none", "speed_optimized"):
        the_plan = baseline_plan(planner, strategy)
        assert the_plan.regions == () and the_plan.predicted_peak_bytes == planner.trace.baseline_peak_bytes


def test_in_place_hazards_are_split_and_the_step_still_matches() -> None:
    """The CNN writes in place (ReLU(inplace), out += x): every baseline region passes the hazard filter and runs."""
    case = tiny("cnn")
    planner = _planner(case)
    hazards = mutation_hazards(planner.trace)
    assert hazards, "the CNN should have in-place writes for this test to mean anything"
    split_somewhere = False
    for strategy in BASELINE_STRATEGIES:
        chosen = baseline_regions(planner.graph, planner.trace, strategy)
        assert not any(is_unsafe(r, hazards) for r in chosen.regions), strategy
        split_somewhere |= any("split" in note for note in chosen.notes)
    assert split_somewhere  # sqrt_n / memory_efficient cut through the in-place stem and blocks
    module = planner.apply(baseline_plan(planner, "sqrt_n"))
    assert_same_step(module, twin(case), case)  # BatchNorm statistics included


def test_module_level_capture() -> None:
    case = tiny("control_flow")
    planner = _planner(case)
    assert planner.graph.kind is autockpt.types.CaptureKind.MODULE
    unavailable = baseline_regions(planner.graph, planner.trace, "sqrt_n")
    assert not unavailable.available and "module-level" in unavailable.notes[0]
    with pytest.raises(ValueError, match="module-level"):
        baseline_plan(planner, "sqrt_n")
    spans = {(s.first_unit, s.last_unit) for s in planner.graph.module_spans}
    the_plan = baseline_plan(planner, "every_2")
    assert the_plan.regions and all((r.first_unit, r.last_unit) in spans for r in the_plan.regions)
    module = planner.apply(the_plan)
    assert_same_step(module, twin(case), case)
    measured = autockpt.measure_step(module, case.args, case.kwargs, case.loss_fn).peak_bytes
    assert measured == pytest.approx(the_plan.predicted_peak_bytes, rel=0.01)


@needs_transformers
@pytest.mark.slow
def test_hugging_face_blocks_and_every_1_matches_hf_checkpointing() -> None:
    """every_1 finds GPT-2's layers from the graph and saves as much memory as HF's own checkpointing."""
    import copy

    case = tiny("gpt2")
    planner = _planner(case)
    layers = len(case.model.transformer.h)
    assert [b.name for b in find_blocks(planner.graph)] == [f"transformer.h.{i}" for i in range(layers)]
    module = planner.apply(baseline_plan(planner, "every_1"))
    assert_same_step(module, twin(case), case)
    ours = autockpt.measure_step(module, case.args, case.kwargs, case.loss_fn).peak_bytes
    hf = copy.deepcopy(case.model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    theirs = autockpt.measure_step(hf, case.args, case.kwargs, case.loss_fn).peak_bytes
    assert ours == pytest.approx(theirs, rel=0.05)
