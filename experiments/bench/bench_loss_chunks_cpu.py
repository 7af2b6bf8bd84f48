"""Benchmark (issue 48, item 8, on CPU): small decoders whose floor is their loss, planned with the loss in chunks.

Models (random init, 32k vocabulary, tied heads, labels = inputs with the first 64 tokens of a row at -100): a
Hugging Face Llama (hidden 128, 2 layers, 4 heads, 2 KV heads) and a Gemma 2 with final-logit soft-capping, batch
2 x 512. For each:

* the captured program's floor and the lowest floor of the programs the planner weighs (``loss_chunk_tokens="auto"``);
* ``optimize`` at that floor (or, where its measured step is over, at the budget its refusal states): the measured
  peak (MemTracker, the output held through backward) against the prediction and the budget, and the loss and
  gradients against the eager model;
* step times at equal measured peaks: a hand-written chunked loss (the hidden states through the model's body, then
  per chunk of tokens the head and the cross-entropy under ``torch.utils.checkpoint``, the torchtitan / TRL way) is
  measured, and autockpt is optimized at that measured peak; the eager model, the hand-written loss and autockpt's
  module timed in alternating rounds (median of per-round ratios to the eager step).

    python -m experiments.bench.bench_loss_chunks_cpu        # writes experiments/results/loss_chunks_cpu/
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import autockpt
from autockpt.measure.step import alternating_step_seconds, relative_step_times
from experiments.common.results_readme import RESULTS_DIR, markdown_table, write_section

OUT = RESULTS_DIR / "loss_chunks_cpu"
VOCAB, BATCH, SEQ, PADDING = 32000, 2, 512, 64


def decoder(kind: str) -> nn.Module:
    import transformers

    common = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": VOCAB, "tie_word_embeddings": True}
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).train()
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **common, head_dim=32, final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=32,
        sliding_window=SEQ)).train()


def batch() -> tuple[tuple, dict]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :PADDING] = -100
    return (ids,), {"labels": labels}


class HandChunked(nn.Module):
    """The model's body, then its head and a shifted cross-entropy per chunk of tokens under checkpoint: what users
    write by hand (torchtitan's chunked loss, TRL's). Returns the loss (mean over the labels that are not -100)."""

    def __init__(self, model: nn.Module, chunk_tokens: int) -> None:
        super().__init__()
        self.model, self.chunk_tokens = model, chunk_tokens
        self.softcap = getattr(model.config, "final_logit_softcapping", None)

    def _chunk_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.model.model(input_ids=input_ids).last_hidden_state.flatten(0, 1)
        shifted = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].flatten()
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], self.chunk_tokens):
            rows = slice(start, start + self.chunk_tokens)
            total = total + checkpoint(self._chunk_loss, hidden[rows], shifted[rows], use_reentrant=False)
        return total / (shifted != -100).sum()


def loss_of(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.loss


def gradient_difference(module: nn.Module, model: nn.Module, reference: nn.Module) -> tuple[float, float]:
    """(|loss - eager loss| / eager loss, max over parameters of max |grad - eager grad| / max |eager grad|)."""
    args, kwargs = batch()
    losses = []
    for runner, owner in ((module, model), (reference, reference)):
        for p in owner.parameters():
            p.grad = None
        loss = loss_of(runner(*args, **kwargs))
        loss.backward()
        losses.append(float(loss.detach()))
    worst = max(float((p.grad - q.grad).abs().max() / q.grad.abs().max())
                for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None)
    return abs(losses[0] - losses[1]) / abs(losses[1]), worst


def row(kind: str, rounds: int) -> dict[str, Any]:
    model = decoder(kind)
    reference = copy.deepcopy(model)
    args, kwargs = batch()
    planner = autockpt.Planner.from_model(model, example_inputs=args, example_kwargs=kwargs)
    try:
        planner.plan(budget_bytes=1)
    except autockpt.InfeasibleBudgetError as refused:
        floor = refused.min_feasible_bytes
    try:  # the captured program's own floor (the floor query above searches it only where it may be the lowest)
        planner.own_plan(budget_bytes=1)
    except autockpt.InfeasibleBudgetError as refused:
        own_floor = refused.min_feasible_bytes
    try:
        at_floor, stated = planner.optimize(budget_bytes=floor), floor
    except autockpt.InfeasibleBudgetError as refused:  # not kept when measured: optimize states the budget it keeps
        stated = refused.min_feasible_bytes
        at_floor = planner.optimize(budget_bytes=stated)
    plan = autockpt.get_plan(at_floor)
    loss_error, gradient_error = gradient_difference(at_floor, model, reference)
    hand = HandChunked(model, chunk_tokens=plan.loss_chunk_tokens or 256)
    hand_peak = autockpt.measure_step(hand, args, kwargs, loss_fn=loss_of).peak_bytes
    equal = planner.optimize(budget_bytes=hand_peak)
    equal_peak = autockpt.measure_step(equal, args, kwargs).peak_bytes
    # one call form for the three: (ids,), {"labels": ...}; HandChunked takes ids by position as input_ids
    seconds = alternating_step_seconds([reference, hand, equal], args, kwargs, loss_of, rounds=rounds)
    _, hand_ratio, equal_ratio = relative_step_times(seconds)
    return {
        "model": kind, "floor_as_captured_bytes": own_floor, "floor_bytes": floor, "floor_ratio": floor / own_floor,
        "stated_bytes": stated, "chunk_tokens": plan.loss_chunk_tokens, "predicted_bytes": plan.predicted_peak_bytes,
        "measured_bytes": plan.measured_peak_bytes, "kept": plan.measured_peak_bytes <= stated,
        "loss_rel_error": loss_error, "max_grad_rel_error": gradient_error,
        "hand_chunked_peak_bytes": hand_peak, "autockpt_at_hand_peak_bytes": equal_peak,
        "autockpt_at_hand_peak_chunk": autockpt.get_plan(equal).loss_chunk_tokens,
        "hand_step_over_eager": hand_ratio, "autockpt_step_over_eager": equal_ratio,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,gemma2")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=OUT)
    options = parser.parse_args()
    torch.set_num_threads(2)
    options.out.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame([row(kind, options.rounds) for kind in options.models.split(",")])
    table.to_csv(options.out / "loss_chunks_cpu.csv", index=False)
    command = "python -m experiments.bench.bench_loss_chunks_cpu" + (
        f" --rounds {options.rounds}" if options.rounds != 7 else "")
    text = (
        f"Written by `{command}` on {datetime.date.today()} ({platform.machine()}, torch {torch.__version__}, CPU, 2 "
        f"threads). Peaks: MemTracker, bytes, the output held through backward. Vocabulary {VOCAB}, batch {BATCH} x "
        f"{SEQ}, the first {PADDING} labels of each row -100. Step times: median of per-round ratios to the eager "
        "step, alternating rounds in one process; the hand-written chunked loss at autockpt's chunk, and autockpt "
        "optimized at the hand-written loss's measured peak.\n\n" + markdown_table(table)
    )
    write_section("bench_loss_chunks_cpu", text, output=options.out)
    print(text)


if __name__ == "__main__":
    main()
