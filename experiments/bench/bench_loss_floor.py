"""Benchmark (issue 48, item 8): the floor of large-vocabulary decoders before and after the loss is computed in
chunks, planned for GPUs this machine does not have (fake trace, roofline timing).

Shapes (built on the meta device in bf16 from their configs, tied embeddings, AdamW, 4096-token rows, labels = inputs):
Llama-3.2-1B (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, vocabulary 128256) for an RTX 4090;
Gemma-2-2B (hidden 2304, 26 layers, 8 heads, 4 KV heads, head_dim 256, intermediate 9216, vocabulary 256000,
final-logit soft-capping 30) for an A100 40 GB, since its AdamW step alone exceeds 24 GB. For each: one planner
(``loss_chunk_tokens="auto"``) weighs the captured program and its chunked ones; the captured program's floor is
"before", the lowest of all "after"; the breakdown of each floor, the predicted step time at each floor, the seconds
planning took (``Planner.from_model``, the floor query ``plan(budget_bytes=1)`` and the plan at that floor; the
captured program's own floor, "before", is searched after, untimed: the floor query skips it when it cannot be the
lowest), and the largest batch of 4096-token rows whose floor fits the device's memory, before and after (doubling,
then bisecting).

    python -m experiments.bench.bench_loss_floor                  # writes experiments/results/loss_floor/
    python -m experiments.bench.bench_loss_floor --shapes llama-3.2-1b --no-batch --out /tmp/lf   (a quick look)
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

import autockpt
from autockpt.core.devices import device_spec
from autockpt.units import format_bytes
from experiments.common.results_readme import RESULTS_DIR, write_section

OUT = RESULTS_DIR / "loss_floor"
SEQ = 4096
SHAPES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama-3.2-1b": ("LlamaConfig", {
        "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True, "max_position_embeddings": SEQ,
    }, "rtx-4090"),
    "gemma-2-2b": ("Gemma2Config", {
        "hidden_size": 2304, "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "intermediate_size": 9216, "vocab_size": 256000, "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 256, "sliding_window": SEQ,
        "tie_word_embeddings": True, "max_position_embeddings": SEQ,
    }, "a100-40gb"),
}


def planner_at(shape: str, batch: int) -> tuple[autockpt.Planner, float]:
    """The shape's planner at ``batch`` rows (meta model, fake trace, its target), and the seconds it took."""
    import transformers

    config_class, fields, target = SHAPES[shape]
    config = getattr(transformers, config_class)(**fields, use_cache=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    ids = torch.randint(0, fields["vocab_size"], (batch, SEQ), device="meta")
    started = time.perf_counter()
    planner = autockpt.Planner.from_model(
        model, example_kwargs={"input_ids": ids, "labels": ids}, trace="fake", target=target, optimizer="adamw",
    )
    return planner, time.perf_counter() - started


def floor_after(planner: autockpt.Planner) -> int:
    """The lowest floor of all programs: the floor query a user asks (``plan`` at a budget no plan reaches)."""
    try:
        planner.plan(budget_bytes=1)
    except autockpt.InfeasibleBudgetError as refused:
        assert planner.loss_programs is not None, "no chunkable loss tail found"
        return refused.min_feasible_bytes
    raise AssertionError("a plan under 1 byte")


def floor_before(planner: autockpt.Planner) -> int:
    """The captured program's own floor (the floor query searches it only where it may be the lowest)."""
    try:
        planner.own_plan(budget_bytes=1)
    except autockpt.InfeasibleBudgetError as refused:
        return refused.min_feasible_bytes
    raise AssertionError("a plan under 1 byte")


def floor_row(shape: str, batch: int) -> dict[str, Any]:
    planner, built_s = planner_at(shape, batch)
    started = time.perf_counter()
    lowest = floor_after(planner)
    floor_s = time.perf_counter() - started
    after = planner.plan(budget_bytes=lowest)
    planned_s = built_s + time.perf_counter() - started
    programs = planner.loss_programs
    assert programs is not None
    # known floors, then the bounds of the programs the query did not need to search ("program:>=bytes")
    known = [f"{k}:{v}" for k, v in sorted(programs.floors.items())]
    known += [f"{k}:>={v}" for k, v in sorted(programs.floor_bounds.items()) if k not in programs.floors]
    before = planner.own_plan(floor_before(planner))
    fresh_s = fresh_plan_seconds(shape, batch, lowest)
    row: dict[str, Any] = {
        "shape": shape, "target": SHAPES[shape][2], "batch": batch, "tokens": batch * SEQ,
        "unmodified_peak_bytes": planner.trace.baseline_peak_bytes,
        "floor_before_bytes": before.predicted_peak_bytes, "floor_after_bytes": after.predicted_peak_bytes,
        "floor_ratio": after.predicted_peak_bytes / before.predicted_peak_bytes, "chunk_tokens": after.loss_chunk_tokens,
        "floors_by_chunk": ";".join(known),
        "step_ms_before": before.baseline_step_ms * (1 + before.predicted_overhead),
        "step_ms_after": after.baseline_step_ms * (1 + after.predicted_overhead),
        "from_model_s": built_s, "floor_query_s": floor_s, "planning_s": planned_s, "fresh_plan_at_floor_s": fresh_s,
    }
    for label, plan in (("before", before), ("after", after)):
        breakdown = plan.breakdown
        row[f"peak_moment_{label}"] = breakdown.moment
        row.update({f"{name.replace(' ', '_')}_{label}_bytes": size for name, size in breakdown.rows()})
    return row


def fresh_plan_seconds(shape: str, batch: int, budget_bytes: int) -> float:
    """What ``autockpt.plan(model, budget_bytes=...)`` costs a user at the floor found, on a planner of its own:
    ``Planner.from_model`` then ``plan`` at that budget, with no floor query before it (nothing searched is shared)."""
    planner, built_s = planner_at(shape, batch)
    started = time.perf_counter()
    planner.plan(budget_bytes=budget_bytes)
    return built_s + time.perf_counter() - started


def largest_batch(shape: str, limit: int) -> dict[str, Any]:
    """The largest batch (rows of 4096 tokens) whose floor fits the target's memory, before and after chunking."""
    memory = device_spec(SHAPES[shape][2]).memory_bytes
    fits: dict[int, dict[str, int]] = {}

    def floors_at(batch: int) -> dict[str, int]:
        if batch not in fits:
            planner = planner_at(shape, batch)[0]
            fits[batch] = {"after": floor_after(planner), "before": floor_before(planner)}
            print(f"  {shape} batch {batch}: floors {fits[batch]} (memory {memory})", flush=True)
        return fits[batch]

    answers = {}
    for label in ("before", "after"):
        low, high = 0, None
        batch = 1
        while high is None and batch <= limit:  # doubling until one does not fit
            if floors_at(batch)[label] <= memory:
                low, batch = batch, batch * 2
            else:
                high = batch
        high = high if high is not None else limit + 1
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if floors_at(middle)[label] <= memory else (low, middle)
        answers[f"max_batch_{label}"] = low
    return {"shape": shape, "target": SHAPES[shape][2], "memory_bytes": memory, "limit": limit, **answers}


def _seconds(row: dict[str, Any], key: str) -> str:
    """A time column of ``row``; rows of CSVs written before it was measured say so."""
    value = row.get(key)
    return "not measured" if value is None or math.isnan(value) else f"{value:.1f}"


def _at_most(found: dict[str, Any], label: str) -> str:
    """The largest batch found; at the search's limit, said so (a larger one may fit)."""
    batch = int(found[f"max_batch_{label}"])
    return f"{batch} (the limit searched)" if batch == int(found.get("limit", 0)) else str(batch)


def markdown(rows: list[dict[str, Any]], batches: list[dict[str, Any]], command: str) -> str:
    lines = [
        (f"Written by `{command}` on {datetime.date.today()} ({platform.machine()}, torch {torch.__version__}, "
         f"{torch.get_num_threads()} threads). Fake trace on meta models, roofline times for the target; bytes are "
         "predictions (GB = 10^9 bytes). Before: the captured program's floor; after: the lowest floor of the programs "
         "the planner weighs (the loss in chunks of the tokens in 4 and in 32 chunks)."), "",
        ("| shape | target | batch x 4096 | unmodified | floor before | floor after | after / before | chunk (tokens) "
         "| predicted step at the floor, before / after | planning s (model, floor query, plan at the floor) "
         "| `plan` at the floor alone, s (a planner of its own) |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['target']} | {r['batch']} | {format_bytes(r['unmodified_peak_bytes'])} "
            f"| {format_bytes(r['floor_before_bytes'])} | {format_bytes(r['floor_after_bytes'])} | {r['floor_ratio']:.3f} "
            f"| {r['chunk_tokens']} | {r['step_ms_before']:.0f} / {r['step_ms_after']:.0f} ms "
            f"| {r['planning_s']:.1f} ({r['from_model_s']:.1f}, {r['floor_query_s']:.1f}, "
            f"{r['planning_s'] - r['from_model_s'] - r['floor_query_s']:.1f}) | {_seconds(r, 'fresh_plan_at_floor_s')} |"
        )
    lines += ["", "What each floor holds at its peak:", "",
              ("| shape | floor | where | parameters | gradients | optimizer states | activations | logits and loss "
               "| recomputed copies | temporaries |"), "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for label in ("before", "after"):
            cells = [format_bytes(r[f"{name}_{label}_bytes"]) for name in (
                "parameters", "gradients", "optimizer_states", "activations", "logits_and_loss", "recomputed_copies",
                "temporaries")]
            lines.append(f"| {r['shape']} | {label} | {r[f'peak_moment_{label}']} | " + " | ".join(cells) + " |")
    if batches:
        lines += ["", "Largest batch of 4096-token rows whose floor fits the target's memory:", "",
                  "| shape | target | memory | before | after |", "|---|---|---:|---:|---:|"]
        lines += [f"| {b['shape']} | {b['target']} | {format_bytes(b['memory_bytes'])} | {_at_most(b, 'before')} "
                  f"| {_at_most(b, 'after')} |" for b in batches]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--no-batch", action="store_true", help="skip the largest-batch search")
    parser.add_argument("--limit", type=int, default=32, help="the largest batch tried")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--rerender", action="store_true", help="the README from the folder's CSVs, nothing run")
    options = parser.parse_args()
    if options.rerender:
        rows = pd.read_csv(options.out / "floors.csv").to_dict("records")
        batch_csv = options.out / "largest_batch.csv"
        batches = [{"limit": options.limit, **b} for b in pd.read_csv(batch_csv).to_dict("records")] if (
            batch_csv.exists()) else []
        command = f"python -m experiments.bench.bench_loss_floor --limit {options.limit}"
        write_section("bench_loss_floor", markdown(rows, batches, command), output=options.out)
        return
    torch.set_num_threads(2)
    options.out.mkdir(parents=True, exist_ok=True)
    shapes = options.shapes.split(",")
    rows = []
    for shape in shapes:
        rows.append(floor_row(shape, options.batch))
        print(rows[-1], flush=True)
        pd.DataFrame(rows).to_csv(options.out / "floors.csv", index=False)
    batches = []
    if not options.no_batch:
        for shape in shapes:
            batches.append(largest_batch(shape, options.limit))
            print(batches[-1], flush=True)
            pd.DataFrame(batches).to_csv(options.out / "largest_batch.csv", index=False)
    command = "python -m experiments.bench.bench_loss_floor" + (
        "" if options.shapes == ",".join(SHAPES) else f" --shapes {options.shapes}") + (
        " --no-batch" if options.no_batch else "") + (f" --limit {options.limit}" if options.limit != 32 else "")
    text = markdown(rows, batches, command)
    write_section("bench_loss_floor", text, output=options.out)
    print(text)


if __name__ == "__main__":
    main()
