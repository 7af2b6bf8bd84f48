"""The loss in chunks as the planner weighs it (issue 48; ``planning/loss_chunks.py``): on a small decoder whose floor
is its loss (a tied head over a large vocabulary, padding labels), the planner's floor falls below 70 % of the floor
without it, the plan at that floor keeps its prediction to the byte when measured with the output held, and the loss
and gradients are the model's; plan files carry the chunk and ``apply_plan`` makes the same program; the option fixes
the chunk or turns it off; a loss outside the model is not chunked and the plan says why; evaluation without
gradients still returns the logits."""

from __future__ import annotations

import copy

import pytest
import torch
from support import needs_transformers
from torch import nn

import autockpt
from autockpt.core.solve.refine import floor_lower_bound_bytes
from autockpt.errors import InfeasibleBudgetError
from autockpt.measure.loss_tail import LossTail
from autockpt.planning.loss_chunks import LossPrograms, chunk_candidates, record_refused_floors

VOCAB = 8000


def _decoder() -> nn.Module:
    """A Llama with a vocabulary large against its width, one layer: the logits and the loss are what these tests
    are about (issue 46: the file 13.8 -> 10.8 s with one layer, not two)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config).train()


def _batch() -> tuple[tuple, dict]:
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :9] = -100  # padding
    return (ids,), {"labels": labels}


def _floor(planner: autockpt.Planner) -> int:
    with pytest.raises(InfeasibleBudgetError) as refused:
        planner.plan(budget_bytes=1)
    return refused.value.min_feasible_bytes


def _own_floor(planner: autockpt.Planner) -> int:
    """The captured program's own floor (the floor query above searches it only where it may be the lowest)."""
    with pytest.raises(InfeasibleBudgetError) as refused:
        planner.own_plan(budget_bytes=1)
    return refused.value.min_feasible_bytes


@pytest.fixture(scope="module")
def weighed():
    """A planner weighing the chunked programs, its floor, and the plan at that floor."""
    model = _decoder()
    args, kwargs = _batch()
    planner = autockpt.Planner.from_model(model, example_inputs=args, example_kwargs=kwargs)
    floor = _floor(planner)
    return model, planner, floor, planner.plan(budget_bytes=floor)


@needs_transformers
def test_the_floor_falls_below_70_percent_and_is_kept_to_the_byte(weighed) -> None:
    model, planner, floor, plan = weighed
    own_floor = _own_floor(planner)
    assert floor < 0.7 * own_floor
    for chunk_tokens, searched in planner.loss_programs.floors.items():  # the bound that refuses without a search
        program = planner if chunk_tokens == 0 else planner.loss_programs.planner(chunk_tokens)
        assert floor_lower_bound_bytes(program.trace) <= searched
    assert plan.loss_chunk_tokens in planner.loss_programs.chunk_tokens
    assert plan.baseline_peak_bytes == planner.trace.baseline_peak_bytes  # the model's unmodified step
    assert plan.floor_breakdown.logits_bytes < plan.baseline_breakdown.logits_bytes
    assert "loss                   the output projection and cross-entropy in chunks" in plan.summary()
    twin = copy.deepcopy(model)
    module = planner.apply(plan)
    args, kwargs = _batch()
    measured = autockpt.measure_step(module, args, kwargs)  # the output held through backward (the default)
    assert measured.peak_bytes == plan.predicted_peak_bytes <= floor
    for p in model.parameters():
        p.grad = None
    output = module(*args, **kwargs)
    assert output.logits is None  # never made in full
    output.loss.backward()
    expected = twin(*args, **kwargs).loss
    expected.backward()
    torch.testing.assert_close(output.loss, expected, rtol=1e-5, atol=1e-6)
    for (name, mine), theirs in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # evaluation (Trainer's prediction_step): the model runs as written, logits included
        assert module(*args, **kwargs).logits.shape == (2, 64, VOCAB)


@needs_transformers
def test_a_plan_file_carries_the_chunk_and_apply_plan_makes_the_same_program(weighed, tmp_path) -> None:
    model, _, _, plan = weighed
    plan.save(tmp_path / "plan.json")
    loaded = autockpt.load_plan(tmp_path / "plan.json")
    assert loaded.loss_chunk_tokens == plan.loss_chunk_tokens > 0
    args, kwargs = _batch()
    module = autockpt.apply_plan(model, loaded, example_inputs=args, example_kwargs=kwargs)
    assert autockpt.measure_step(module, args, kwargs).peak_bytes == plan.predicted_peak_bytes


@needs_transformers
def test_the_option_fixes_the_chunk_or_turns_it_off() -> None:
    model = _decoder()
    args, kwargs = _batch()
    # the plans recomputing nothing, scored, not solved: a plan at an unlimited budget would search the floor
    fixed = autockpt.Planner.from_model(model, example_inputs=args, example_kwargs=kwargs, loss_chunk_tokens=24)
    assert fixed.loss_programs is None and fixed.plan_for_regions((), strategy="none").loss_chunk_tokens == 24
    off = autockpt.Planner.from_model(model, example_inputs=args, example_kwargs=kwargs, loss_chunk_tokens=0)
    assert off.loss_programs is None and off.plan_for_regions((), strategy="none").loss_chunk_tokens == 0


def test_a_loss_outside_the_model_is_not_chunked_and_the_plan_says_why() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(500, 16), nn.Linear(16, 500))
    ids = torch.randint(0, 500, (4, 32))
    planner = autockpt.Planner.from_model(
        model, example_inputs=(ids,), loss_fn=lambda logits: nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()),
    )
    assert planner.loss_programs is None
    assert any(note.startswith("loss: not computed in chunks: no cross-entropy") for note in planner.notes)


def test_auto_weighs_no_chunk_where_the_logits_are_a_negligible_share_of_the_peak() -> None:
    """A classifier's few classes: chunking could free a few logit-sized tensors, under 1 % of the peak, so "auto"
    spends no trace on it; a number given is weighed whatever the share."""
    tail = LossTail(projection="head", weight="head.weight", has_bias=True, loss="loss", vocabulary=10, tokens=64,
                    softcap=None, upcast=False, reduction="mean", ignore_index=-100, divisor=None,
                    logits_returned=True, logits_bytes=64 * 10 * 4)
    assert chunk_candidates(tail, "auto", baseline_peak_bytes=10**9) == ()
    assert chunk_candidates(tail, "auto", baseline_peak_bytes=100_000) == (16, 2)
    assert chunk_candidates(tail, 8, baseline_peak_bytes=10**9) == (8,)


@needs_transformers
def test_the_pareto_front_reaches_the_floor_of_the_chunked_programs(weighed) -> None:
    """``plan(pareto_points=...)``: each point is the plan ``plan`` gives at its budget, so the front starts at the
    floor the loss's chunks reach, under the captured program's own floor."""
    _, planner, floor, _ = weighed
    own_floor = _own_floor(planner)
    (lowest,) = planner.pareto([floor])
    assert lowest.predicted_peak_bytes is not None and lowest.predicted_peak_bytes <= floor < own_floor
    assert lowest.predicted_overhead == planner.plan(budget_bytes=floor).predicted_overhead


@needs_transformers
def test_a_chunked_program_is_timed_on_the_captured_programs_measurements(weighed) -> None:
    """Two traces of one step differ by their noise (20 % on CPU), which once picked the slower program: every unit
    both programs run takes the captured program's time, and the step is timed against it in alternating rounds."""
    _, planner, _, _ = weighed
    own = {unit.name: cost.forward_ms for unit, cost in zip(planner.graph.units, planner.trace.units)}
    for program in planner.loss_programs.made.values():
        shared = [(unit.name, cost.forward_ms) for unit, cost in zip(program.graph.units, program.trace.units)
                  if unit.name in own]
        assert len(shared) >= len(own) - 12  # all but the old tail (projection, upcast, cross-entropy and checks)
        assert all(forward_ms == own[name] for name, forward_ms in shared)
        assert program.trace.step_ms > 0 and program.trace.forward_ms == pytest.approx(
            sum(cost.forward_ms for cost in program.trace.units))


@needs_transformers
def test_a_device_filled_since_the_trace_leaves_a_chunked_program_its_own_times(monkeypatch, caplog) -> None:
    """Timing the programs against each other runs both steps again: out of memory there (the device filled up since
    the trace), the chunked program keeps its own trace's times and planning goes on."""
    from autockpt.planning import build

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("scripted")

    monkeypatch.setattr(build, "alternating_step_seconds", out_of_memory)
    args, kwargs = _batch()
    planner = autockpt.Planner.from_model(_decoder(), example_inputs=args, example_kwargs=kwargs,
                                          timing="auto")  # measured times: the programs are timed against each other
    chunk = planner.loss_programs.chunk_tokens[0]
    with caplog.at_level("WARNING", logger="autockpt.planning.build"):
        program = planner.loss_programs.planner(chunk)
    assert "ran out of device memory" in caplog.text
    assert program.trace.step_ms > 0 and program.loss_chunk_tokens == chunk


def test_a_refused_programs_floor_is_searched_only_where_it_may_be_the_lowest() -> None:
    """A floor query refuses every program; each floor is then searched in the order of its bound (what the step
    holds at its end), and not where a floor already found is at or under that bound: the lowest floor is exact."""
    searched: list[int] = []

    def refusal(chunk_tokens: int, bound_bytes: int, floor_bytes: int) -> InfeasibleBudgetError:
        def search() -> int:
            searched.append(chunk_tokens)
            return floor_bytes
        return InfeasibleBudgetError("refused", budget_bytes=1, min_feasible_bytes=search, lower_bound_bytes=bound_bytes)

    programs = LossPrograms(chunk_tokens=(64, 16, 8), make=lambda chunk_tokens: None)
    refusals = {0: refusal(0, 130, 200), 64: refusal(64, 100, 120), 16: refusal(16, 90, 110),
                8: refusal(8, 100, 100)}
    chunk_tokens, lowest = record_refused_floors(programs, refusals)
    assert chunk_tokens == 8 and lowest is refusals[8] and lowest.min_feasible_bytes == 100
    # 16's bound is lowest; then the bounds tie at 100 and the smaller chunk goes first, reaching its bound: 64's
    # floor and 0's (bound 130) cannot be lower, and are not searched
    assert searched == [16, 8]
    assert programs.floors == {16: 110, 8: 100} and programs.floor_bounds == {64: 100, 0: 130}
    assert programs.floor_at_least(0) == 130 and programs.floor_at_least(8) == 100


@needs_transformers
def test_a_budget_under_every_programs_floor_names_the_host_pool_that_makes_it_feasible(weighed) -> None:
    """Each program is solved without the host pool's hint (a joint solve: most of a refusal's time on Gemma-2-2B);
    the refusal raised, the lowest floor's, gets it."""
    _, planner, floor, _ = weighed
    with pytest.raises(InfeasibleBudgetError) as refused:
        planner.plan(budget_bytes=floor - 1)
    assert refused.value.min_feasible_bytes == floor
    assert refused.value.host_pool_bytes_needed is not None and "A host pool makes it feasible" in str(refused.value)
