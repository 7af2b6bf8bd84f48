"""Every batch shape no larger than the example's trains under the plan and keeps the budget (issue 23, item 1);
a larger one warns with the numbers, or raises in strict mode; the optimized module presents the model's signature."""

from __future__ import annotations

import dataclasses
import inspect
import logging

import pytest
import torch
from support import assert_same_step, budget_at, tiny, twin

import autockpt
from autockpt.present import zoo


@dataclasses.dataclass
class Optimized:
    case: zoo.ZooCase
    reference: torch.nn.Module
    module: autockpt.runtime.rewrite.OptimizedModule
    budget: int


def optimized(case: zoo.ZooCase, fraction: float) -> Optimized:
    reference = twin(case)
    planner = autockpt.Planner.from_model(case.model, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn)
    budget = budget_at(planner, fraction)
    module = planner.optimize(budget_bytes=budget)
    module.strict = True  # a step that would run unplanned raises instead of passing this test
    return Optimized(case, reference, module, budget)


def at(case: zoo.ZooCase, args: tuple, kwargs: dict) -> zoo.ZooCase:
    return dataclasses.replace(case, args=args, kwargs=kwargs)


@pytest.fixture(scope="module")
def decoder() -> Optimized:
    """A GPT-NeoX-style decoder (export capture: its graph is specialised to the sequence length) planned at 256."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256,
    )
    ids = torch.randint(0, 128, (2, 256))
    case = zoo.ZooCase(name="neox", model=GPTNeoXForCausalLM(config), args=(ids,), kwargs={"labels": ids})
    return optimized(case, 0.5)


def test_decoder_sequences_keep_the_plan_and_the_budget(decoder: Optimized) -> None:
    ids = decoder.case.args[0]
    # dynamic padding: a new length, then the planned one again (optimize measured it first); the new length's step
    # twice (issue 46: a second new length was one more capture of the same fact)
    for length in (192, 256, 192):
        short = ids[:, :length].contiguous()
        case = at(decoder.case, (short,), {"labels": short})
        peak = autockpt.measure_step(decoder.module, case.args, case.kwargs).peak_bytes
        assert peak <= decoder.budget, f"sequence {length}: measured {peak} bytes, budget {decoder.budget}"
        assert_same_step(decoder.module, decoder.reference, case)
    shapes = [variant.description for variant in decoder.module.shape_variants()]
    assert shapes == ["(2, 192), labels=(2, 192)"]  # captured once
    # the model's signature, as Trainer reads it (it drops the columns forward does not name; Trainer's own loop, with
    # a scalar argument the example did not have, is tests/planning/test_trainer.py's)
    assert "input_ids" in inspect.signature(decoder.module.forward).parameters
    assert all(variant.seconds > 0 for variant in decoder.module.shape_variants())


def test_a_larger_step_warns_with_the_numbers_or_raises_when_strict(
    decoder: Optimized, caplog: pytest.LogCaptureFixture
) -> None:
    longer = torch.randint(0, 128, (2, 300))
    with pytest.raises(autockpt.errors.UnplannedStepError, match=r"\(2, 300\), larger than the planned \(2, 256\)"):
        decoder.module(longer, labels=longer)
    decoder.module.strict = False
    try:
        with caplog.at_level(logging.WARNING, logger="autockpt.runtime.rewrite"):
            output = decoder.module(longer, labels=longer)
            decoder.module(longer, labels=longer)
    finally:
        decoder.module.strict = True
    torch.testing.assert_close(output.loss, decoder.reference(longer, labels=longer).loss)
    warnings = [r.getMessage() for r in caplog.records if "without the plan" in r.getMessage()]
    assert len(warnings) == 1 and "(2, 300)" in warnings[0]  # once, with the shapes
    with pytest.raises(autockpt.errors.UnplannedStepError, match="float32"):
        decoder.module(longer.float())  # another dtype is not a smaller step


def test_shapes_can_be_prepared_before_training(decoder: Optimized) -> None:
    short = decoder.case.args[0][:, :64].contiguous()
    decoder.module.prepare_shapes([((short,), {"labels": short})])
    assert "(2, 64), labels=(2, 64)" in [v.description for v in decoder.module.shape_variants()]
    longer = torch.randint(0, 128, (2, 512))
    with pytest.raises(autockpt.errors.UnplannedStepError, match="larger than the planned"):
        decoder.module.prepare_shapes([((longer,), {"labels": longer})])


def test_conv_net_image_sizes_keep_the_plan_and_the_budget() -> None:
    """BatchNorm conv net (fx capture): two image sizes; running statistics advance as the plain model's."""
    run = optimized(tiny("cnn"), 0.4)
    images = run.case.args[0]
    for size in (12, 16):  # another size, then the planned one again (optimize measured it first)
        case = at(run.case, (images[..., :size, :size].contiguous(),), {})
        peak = autockpt.measure_step(run.module, case.args, case.kwargs, case.loss_fn).peak_bytes
        autockpt.measure_step(run.reference, case.args, case.kwargs, case.loss_fn)  # its statistics advance too
        assert peak <= run.budget, f"image {size}: measured {peak} bytes, budget {run.budget}"
        assert_same_step(run.module, run.reference, case)
    assert [v.description for v in run.module.shape_variants()] == ["(8, 3, 12, 12)"]
