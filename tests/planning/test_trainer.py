"""Hugging Face ``Trainer`` at default arguments trains the optimized module under its plan (issue 23, item 8).

Trainer drops the dataset columns ``forward``'s signature does not name (the optimized module presents the model's)
and passes ``num_items_in_batch`` (a 0-d tensor the example inputs did not have): with ``strict`` on, any step that
could not run under the plan would raise. Losses equal the unmodified model's, with gradient accumulation, and a
checkpoint is saved through Trainer. The plan is made with the optimizer Trainer makes (its class and arguments, from
``Trainer.get_optimizer_cls_and_kwargs``) and the accumulation steps: every micro-step and every ``optimizer.step()``
inside Trainer is measured under the budget (MemTracker per call: it cannot follow several forwards in one context).
Trainer drops the model's output before backward: the optimized module, which checks the loop, says so once.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support import budget_at
from torch.distributed._tools.mem_tracker import MemTracker

import autockpt

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer needs it


def test_trainer_at_default_arguments_uses_the_plan_on_every_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(
        vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64,
    )
    model = transformers.GPTNeoXForCausalLM(config)
    reference = copy.deepcopy(model)
    rows = [{"input_ids": torch.randint(0, 128, (64,)), "note": "a column forward does not take"} for _ in range(8)]
    for row in rows:
        row["labels"] = row["input_ids"].clone()
    ids = torch.stack([row["input_ids"] for row in rows[:2]])

    def arguments(out: Path) -> transformers.TrainingArguments:
        return transformers.TrainingArguments(
            output_dir=str(out), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
            logging_steps=1, report_to="none", use_cpu=True, save_steps=2, seed=0, data_seed=0,
        )

    optimizer_class, optimizer_kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(arguments(tmp_path), model)
    # the loss as captured: a chunked loss returns no logits, and the output Trainer drops is then too small to mention
    options = autockpt.PlanOptions(optimizer=functools.partial(optimizer_class, **optimizer_kwargs),
                                   gradient_accumulation_steps=2, loss_chunk_tokens=0)
    planner = autockpt.Planner.from_model(model, example_inputs=(ids,), example_kwargs={"labels": ids}, options=options)
    budget = budget_at(planner, 0.5)  # from the trace: no plan at an unlimited budget (a full floor search)
    optimized = planner.optimize(budget_bytes=budget)
    optimized.strict = True  # a step that cannot run under the plan raises UnplannedStepError

    def train(module: torch.nn.Module, out: Path) -> tuple[list[float], list[int]]:
        trainer = transformers.Trainer(model=module, args=arguments(out), train_dataset=rows)
        peaks: list[int] = []
        trainer.training_step = measured(trainer.training_step, module, trainer, peaks)
        make_optimizer = trainer.create_optimizer

        def create_optimizer() -> torch.optim.Optimizer:
            optimizer = make_optimizer()
            optimizer.step = measured(optimizer.step, module, trainer, peaks)
            return optimizer

        trainer.create_optimizer = create_optimizer
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], peaks

    with caplog.at_level(logging.WARNING, logger="autockpt.runtime.output_watch"):
        losses, peaks = train(optimized, tmp_path / "optimized")
    # Trainer's compute_loss returns the loss: the outputs are gone before backward, which the module says once
    said = [r.getMessage() for r in caplog.records if r.name == "autockpt.runtime.output_watch"]
    assert len(said) == 1 and "output_held=False" in said[0], said
    reference_losses, reference_peaks = train(reference, tmp_path / "reference")
    assert losses == reference_losses
    assert len(losses) == 2 and len(peaks) == 6  # 4 micro-steps, 2 optimizer steps
    assert max(peaks) <= budget, f"inside Trainer: {peaks}, budget {budget}"
    assert max(reference_peaks) > budget  # the unmodified model in the same loop is over
    assert [v.description for v in optimized.shape_variants()] == [
        "input_ids=(2, 64), labels=(2, 64), num_items_in_batch=()"
    ]
    assert (tmp_path / "optimized" / "checkpoint-2").is_dir()


def measured(call: Callable[..., object], module: torch.nn.Module, trainer: transformers.Trainer,
             peaks: list[int]) -> Callable[..., object]:
    """``call`` with MemTracker's peak of each call appended to ``peaks`` (the module, the optimizer's states and the
    batch tracked from before the call)."""

    def run(*args: object, **kwargs: object) -> object:
        tracker = MemTracker()
        batch = [a for a in args if isinstance(a, dict)]
        tracker.track_external(module, *([trainer.optimizer] if trainer.optimizer is not None else []),
                               *[v for b in batch for v in b.values() if isinstance(v, torch.Tensor)])
        with tracker:
            result = call(*args, **kwargs)
        peaks.append(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
        return result

    return run
