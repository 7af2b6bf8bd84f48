"""Hugging Face ``Trainer`` at default arguments trains the optimized module under its plan (issue 23, item 8).

Trainer drops the dataset columns ``forward``'s signature does not name (the optimized module presents the model's)
and passes ``num_items_in_batch`` (a 0-d tensor the example inputs did not have): with ``strict`` on, any step that
could not run under the plan would raise. Losses equal the unmodified model's, with gradient accumulation, and a
checkpoint is saved through Trainer.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import autockpt

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer needs it


def test_trainer_at_default_arguments_uses_the_plan_on_every_step(tmp_path: Path) -> None:
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
    planner = autockpt.Planner(model, example_inputs=(ids,), example_kwargs={"labels": ids})
    probe = planner.plan(budget_bytes=10**15)
    budget = int(probe.static_bytes + 0.5 * (probe.baseline_peak_bytes - probe.static_bytes))
    optimized = planner.optimize(budget_bytes=budget)
    optimized.strict = True  # a step that cannot run under the plan raises UnplannedStepError

    def train(module: torch.nn.Module, out: Path) -> list[float]:
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
            logging_steps=1, report_to="none", use_cpu=True, save_steps=2, seed=0, data_seed=0,
        )
        trainer = transformers.Trainer(model=module, args=args, train_dataset=rows)
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    losses = train(optimized, tmp_path / "optimized")
    assert losses == train(reference, tmp_path / "reference")
    assert len(losses) == 2
    assert [v.description for v in optimized.shape_variants()] == [
        "input_ids=(2, 64), labels=(2, 64), num_items_in_batch=()"
    ]
    assert (tmp_path / "optimized" / "checkpoint-2").is_dir()
