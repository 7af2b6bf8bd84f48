"""The loop users write (issue 46): the model's output held through backward (the default) or dropped before it
(Hugging Face's Trainer, torchtitan, ``model(**batch).loss.backward()``: ``PlanOptions.output_held=False``). Each
loop's plan is measured in that loop with torch's MemTracker; the optimized module says when the loop differs."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import autockpt
from experiments.common.pipeline_worker import Decoder

WATCH_LOGGER = "autockpt.runtime.output_watch"


@pytest.fixture(scope="module")
def decoder() -> tuple[torch.nn.Module, torch.Tensor]:
    """A decoder whose logits (4 x 128 x 2048 floats, 4 MiB) are a fifth of its unmodified peak."""
    torch.manual_seed(0)
    return Decoder(vocab=2048, width=64, layers=4), torch.randint(0, 2048, (4, 128))


def test_each_loop_is_predicted_and_kept_and_a_different_loop_is_reported(decoder, caplog, tmp_path) -> None:
    model, ids = decoder

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())

    baselines = {}
    for held in (True, False):
        planner = autockpt.Planner.from_model(
            model, example_inputs=(ids,), loss_fn=loss_fn, options=autockpt.PlanOptions(output_held=held)
        )
        probe = planner.plan(budget_bytes=10**15)
        baselines[held] = probe.baseline_peak_bytes
        budget = (probe.min_feasible_bytes + probe.baseline_peak_bytes) // 2
        module = planner.optimize(budget_bytes=budget)
        plan = autockpt.get_plan(module)
        assert plan.regions
        assert (plan.loop is None) if held else (plan.loop is not None and not plan.loop.output_held)
        assert ("dropped before backward" in plan.summary()) is not held
        measured = autockpt.measure_step(module, (ids,), None, loss_fn, output_held=held).peak_bytes  # MemTracker
        assert measured <= budget
        assert abs(measured - plan.predicted_peak_bytes) <= 0.005 * plan.predicted_peak_bytes, (held, measured)

        # the other loop, three steps: said once, with the bytes
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=WATCH_LOGGER):
            for _ in range(3):
                output = module(ids)
                loss = loss_fn(output)
                if held:
                    del output
                loss.backward()
                del loss
                output = None
        said = [r.getMessage() for r in caplog.records if r.name == WATCH_LOGGER]
        assert len(said) == 1, said
        logits = "4.19 MB (4.00 MiB)"
        assert logits in said[0] and (("output_held=False" in said[0]) if held else ("over the budget" in said[0]))

        # the planned loop: nothing said
        caplog.clear()
        fresh = planner.apply(plan)
        with caplog.at_level(logging.WARNING, logger=WATCH_LOGGER):
            output = fresh(ids)
            loss = loss_fn(output)
            if not held:
                del output
            loss.backward()
        assert not [r for r in caplog.records if r.name == WATCH_LOGGER]
        if not held:
            plan.save(tmp_path / "plan.json")
            assert autockpt.load_plan(tmp_path / "plan.json").loop == plan.loop
    # dropping the logits (not kept by backward) lowers the unmodified peak by about their size
    assert 0.9 * 4 * 2**20 <= baselines[True] - baselines[False] <= 1.1 * 4 * 2**20, baselines


def test_the_option_is_checked_and_refused_where_not_planned() -> None:
    with pytest.raises(TypeError, match="output_held must be True"):
        autockpt.PlanOptions(output_held="no")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="output_held"):
        autockpt.plan_pipeline(model, 2, budget_bytes=10**9, example_inputs=(torch.randn(8, 4),),
                               options=autockpt.PlanOptions(output_held=False))
