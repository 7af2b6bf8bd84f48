"""End to end on the zoo: the optimized model keeps the budget when measured and trains exactly like the original."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from support import (
    assert_same_memory,
    assert_same_step,
    budget_at,
    checkpoint_for,
    needs_transformers,
    planner_for,
    retraced,
    tiny,
    twin,
    zoo_params,
)

import autockpt
from autockpt.measure.capture import value_guards
from autockpt.measure.fake import FakeTrace
from autockpt.present import zoo

MODELS = zoo_params("mlp", "cnn", "transformer", "control_flow", "gpt2", "vit", "unet")
EXPECTED_CAPTURE = {
    "mlp": "fx", "cnn": "fx", "transformer": "fx", "control_flow": "module", "gpt2": "export", "vit": "export", "unet": "export",
    "vae": "export",
}
Planned = tuple[zoo.ZooCase, autockpt.Planner]


@pytest.fixture(scope="module")
def planned() -> Callable[[str], Planned]:
    """Per zoo model: its case and its Planner (``planner_for``: the model captured and profiled once for every
    budget of this file)."""
    made: dict[str, Planned] = {}

    def planned_for(name: str) -> Planned:
        if name not in made:
            case = tiny(name)
            # the diffusers models' programs at a 5 % gap (1 % by default) and one refinement round (5; the UNet's
            # test 28 -> 18 s on an idle 2-core machine with two rounds, its planning 3.3 -> 2.1 s with one, the
            # VAE's 2.3 -> 1.5 s): what this file checks (budget kept, step equal, prediction close) holds for any plan
            diffusers = autockpt.SolverOptions(relative_gap=0.05, refinement_rounds=1)
            solver = diffusers if name in ("unet", "vae") else None
            planner = planner_for(case, solver)
            made[name] = case, planner
        return made[name]

    return planned_for


# every model at half the way from static bytes to its unmodified peak; the cheapest also near its peak (the same
# end-to-end fact at another budget, issue 46's suite time). Near the floor: test_min_feasible.py (a Hugging Face
# ResNet at its stated minimum), test_autocast.py (GPT-NeoX at 0.2 of the way from its floor) and
# test_loss_chunks.py (Llama at its floor); the transformer's dropout recomputed here at 0.5
OTHER_FRACTIONS = {"mlp": (0.7,)}
CASES = [
    pytest.param(*model.values, fraction, marks=model.marks, id=f"{model.id}-{fraction}")
    for model in MODELS for fraction in sorted((0.5, *OTHER_FRACTIONS.get(model.id, ())))
]


@pytest.mark.parametrize(("name", "fraction"), CASES)
def test_budget_is_kept_and_step_matches_pytorch(name: str, fraction: float, planned: Callable[[str], Planned]) -> None:
    _check_budget_kept(name, fraction, planned)


@pytest.mark.parametrize("name", zoo_params("vae"))
def test_a_model_whose_backward_leaves_an_output_without_gradient(name: str, planned: Callable[[str], Planned]) -> None:
    """Issue 46: the VAE's latent distribution computes a log-variance its mode never reads; backward hands the
    chunk's gradient hook None (it crashed profiling). Planned for autockpt's own checkpoint (``checkpoint_for``),
    whose trace records gradient lifetimes with such hooks: planned for torch's, the test passed without the fix."""
    _check_budget_kept(name, 0.5, planned)


@pytest.mark.parametrize("name", zoo_params("unet"))
def test_the_fake_trace_of_the_unet_is_its_measured_timeline(name: str, planned: Callable[[str], Planned]) -> None:
    """FakeTrace (issue 36) on the diffusion UNet (float32 GroupNorm, upsampling, a 0-d timestep input): event for
    event the measured trace of this file's planner, traced from the planner's own captured graph. The other models'
    fake traces are ``tests/measure/test_fake_trace.py``'s; the UNet's is here, so that it is captured once (issue
    46)."""
    _, planner = planned(name)
    fake = retraced(planner, FakeTrace())
    assert planner.provenance.trace == "measured" and fake.times_measured is False
    assert_same_memory(fake, planner.trace)


def _check_budget_kept(name: str, fraction: float, planned: Callable[[str], Planned]) -> None:
    case, planner = planned(name)
    reference = twin(case)  # the model as earlier budgets' steps left it (BatchNorm statistics)
    budget = budget_at(planner, fraction)

    optimized = planner.optimize(budget_bytes=budget)
    plan = autockpt.get_plan(optimized)
    assert_same_step(optimized, reference, case)  # first: the measured step below advances BatchNorm statistics
    measured = autockpt.measure_step(optimized, case.args, case.kwargs, case.loss_fn).peak_bytes

    assert plan.capture.value == EXPECTED_CAPTURE[name]
    assert plan.regions, "a budget below the unmodified peak needs recomputation"
    assert measured <= budget
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= budget
    assert plan.min_feasible_bytes <= budget  # the stated minimum: a kept budget is never under it
    assert plan.planned_action is checkpoint_for(case)  # the kind ``planner_for`` plans this model with
    assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * measured, (measured, plan.predicted_peak_bytes)


@needs_transformers
@pytest.mark.parametrize("name", ["t5", "llama"])
def test_more_hugging_face_architectures_at_half_budget(name: str) -> None:
    """Encoder-decoder (T5) and a RoPE/grouped-query decoder (Llama) through the export path. The encoder (BERT) is
    planned from its fake trace and measured in ``test_trace_choice.py``, and its eager course is checked in
    ``tests/measure/test_eager_course.py``. One layer each (issue 46: T5 4.7 -> 3.3 s, Llama 2.2 -> 1.3 s): both
    plan regions at half budget, and the repeated blocks' program is GPT-2's above. T5 is given an attention mask
    without padding, as a tokenizer gives it: its eager course reads the mask's values, so this is also its eager-course
    check (issue 45; once a test of its own in ``test_eager_course.py``, issue 46): the captured program holds no more
    than the eager model, and a plan with regions on a graph that asserts those values keeps the budget."""
    case = zoo.build(name, "tiny", blocks=1)
    if name == "t5":
        case = dataclasses.replace(case, kwargs={**case.kwargs, "attention_mask": torch.ones_like(case.args[0])})
    reference = twin(case)
    # T5's programs at a 5 % gap, as the diffusers models' (``planned``): what is checked holds for any plan
    planner = planner_for(case, autockpt.SolverOptions(relative_gap=0.05) if name == "t5" else None)
    budget = budget_at(planner, 0.5)
    optimized = planner.optimize(budget_bytes=budget)
    assert_same_step(optimized, reference, case)
    measured = autockpt.measure_step(optimized, case.args, case.kwargs).peak_bytes
    plan = autockpt.get_plan(optimized)
    assert plan.capture.value == "export" and plan.regions
    assert measured <= budget
    assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * measured
    if name == "t5":  # the plan's self-check: both unmodified peaks measured, the captured within 0.5 % of the eager
        eager, captured = plan.provenance.eager_peak_bytes, plan.provenance.captured_peak_bytes
        assert eager is not None and captured is not None and captured <= eager * 1.005, (captured, eager)
        assert plan.baseline_peak_bytes <= eager * 1.005 and "eager model" in plan.summary()
        assert not any("more than the eager" in note for note in plan.notes)
        assert value_guards(optimized.__dict__["_autockpt_executable"]), "the mask's values are read on the eager course"


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_unmodified_prediction_is_close_to_the_original_eager_model(name: str, planned: Callable[[str], Planned]) -> None:
    # the captured graph frees intermediates as soon as they are dead (fx codegen), eager Python code keeps local
    # variables until the function returns: the two peaks may differ a little, in the graph's favour (on the
    # transformer 179,192 B whatever its layers: 1.3 % at its 6, which the tests keep; 2.5 % at 3)
    case = tiny(name)
    measured = autockpt.measure_step(case.model, case.args, case.kwargs, case.loss_fn).peak_bytes
    predicted = planned(name)[1].trace.baseline_peak_bytes
    assert -0.02 * measured <= predicted - measured <= 0.001 * measured


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_budget_is_kept_on_cuda() -> None:
    case = zoo.build("transformer", "small")
    model = case.model.cuda()
    args = tuple(a.cuda() for a in case.args)
    ids = args[0]
    loss_fn = lambda logits: torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    base = autockpt.plan(model, budget_bytes=10**15, example_inputs=args, loss_fn=loss_fn)
    budget = budget_at(base, 0.5)
    optimized = autockpt.optimize(model, budget_bytes=budget, example_inputs=args, loss_fn=loss_fn)
    measured = autockpt.measure_step(optimized, args, None, loss_fn).peak_bytes
    assert measured <= budget
