"""Probe (issue 45, item 5): on CUDA, the eager model against autockpt's program, and autockpt's floor against
Hugging Face gradient checkpointing's measured peak.

    python -m experiments.probes.probe_eager_program_cuda --out DIR            (needs a CUDA device)
    python -m experiments.probes.probe_eager_program_cuda --out DIR --size small --device cpu   (a dry run)
    python -m experiments.probes.probe_eager_program_cuda --summarize DIR     (DIR/README.md from DIR's JSON)

Per model (a Hugging Face Llama with grouped-query attention and GPT-2-medium, fp32, forward + backward, labels =
inputs, no optimizer; GPT-2-medium at ``bench_offload``'s size, where an H100 found autockpt's smallest peak 11.22 GB
against HF checkpointing's 10.34 GB):

* the eager model's step and the unmodified captured program's (``optimize`` at a budget nothing needs): peak
  (``max_memory_allocated``), reserved, and the plan's own self-check figures;
* Hugging Face gradient checkpointing (``use_reentrant=False``) measured, and autockpt's floor (the smallest predicted
  peak of any plan, ``InfeasibleBudgetError.min_feasible_bytes``) planned, applied and measured; the floor plan's
  breakdown (what its peak holds and where in the step);
* for HF checkpointing and the floor plan, where the peak is: the peak of the forward, the bytes alive between forward
  and backward, the peak of the backward;
* step times over the eager step: median of per-round ratios, alternating rounds in one process.

Peaks of modules measured beside others are their own (``anchors.own_step_peak``: less what was allocated before the
step that it does not own). Each planner plans with only its model on the device.
"""

from __future__ import annotations

import argparse
import copy
import csv
import gc
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autockpt
from autockpt.measure.step import alternating_step_seconds, measure_step, relative_step_times
from experiments.common.anchors import own_step_peak
from experiments.common.results_readme import write_section

ROOMY = 10**15
# layers, width, heads, KV heads, sequence, batch, vocabulary
SIZES = {
    "cuda": {"llama": (8, 2048, 16, 4, 2048, 2, 32000), "gpt2-medium": (24, 1024, 16, 16, 1024, 8, 50257)},
    "small": {"llama": (2, 128, 8, 2, 256, 2, 2000), "gpt2-medium": (2, 128, 8, 8, 256, 2, 2000)},
}


def build(name: str, size: str, device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    import transformers

    layers, width, heads, kv_heads, seq, batch, vocab = SIZES[size][name]
    torch.manual_seed(0)
    if name == "gpt2-medium":
        model: nn.Module = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=layers, n_embd=width, n_head=heads, n_positions=seq, vocab_size=vocab, use_cache=False))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=width, intermediate_size=int(2.75 * width), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq, use_cache=False))
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return model.to(device).train(), ids


def loss_of(output: Any) -> torch.Tensor:
    return output.loss


def phases(module: nn.Module, ids: torch.Tensor) -> dict[str, int]:
    """Where the step's peak is: the forward's peak, what is alive after it, the backward's peak (CUDA; bytes
    allocated before the step are taken off)."""
    if ids.device.type != "cuda":
        return {}
    for param in module.parameters():
        param.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = loss_of(module(ids, labels=ids))
    torch.cuda.synchronize()
    forward_peak = torch.cuda.max_memory_allocated() - before
    after_forward = torch.cuda.memory_allocated() - before
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    backward_peak = torch.cuda.max_memory_allocated() - before
    for param in module.parameters():
        param.grad = None
    return {"forward_peak_bytes": forward_peak, "after_forward_bytes": after_forward,
            "backward_peak_bytes": backward_peak}


def measured(module: nn.Module, ids: torch.Tensor) -> tuple[int, int | None]:
    step = measure_step(module, (ids,), {"labels": ids})
    return own_step_peak(step), step.reserved_bytes


def probe(name: str, size: str, device: torch.device, rounds: int) -> dict[str, Any]:
    model, ids = build(name, size, device)
    kwargs = {"labels": ids}
    eager_peak, eager_reserved = measured(model, ids)
    planner = autockpt.Planner.from_model(model, example_inputs=(ids,), example_kwargs=kwargs)
    unmodified = planner.optimize(budget_bytes=ROOMY)
    unmodified_plan = autockpt.get_plan(unmodified)
    unmodified_peak, unmodified_reserved = measured(unmodified, ids)
    try:
        planner.plan(budget_bytes=1)
        raise AssertionError("a budget of one byte was accepted")
    except autockpt.InfeasibleBudgetError as error:
        floor_bytes = error.min_feasible_bytes
    floor = planner.optimize(budget_bytes=floor_bytes)
    floor_plan = autockpt.get_plan(floor)
    floor_peak, floor_reserved = measured(floor, ids)
    hf = copy.deepcopy(model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_peak, hf_reserved = measured(hf, ids)
    seconds = alternating_step_seconds([model, unmodified, hf, floor], (ids,), kwargs, loss_of, rounds=rounds)
    _, unmodified_ratio, hf_ratio, floor_ratio = relative_step_times(seconds)
    breakdown = floor_plan.floor_breakdown
    return {
        "model": name, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "config": dict(zip(("layers", "width", "heads", "kv_heads", "seq", "batch", "vocab"), SIZES[size][name])),
        "eager": {"peak_bytes": eager_peak, "reserved_bytes": eager_reserved},
        "unmodified": {
            "peak_bytes": unmodified_peak, "reserved_bytes": unmodified_reserved,
            "predicted_peak_bytes": unmodified_plan.predicted_peak_bytes,
            "plan_eager_peak_bytes": unmodified_plan.provenance.eager_peak_bytes,
            "plan_captured_peak_bytes": unmodified_plan.provenance.captured_peak_bytes,
            "step_over_eager": unmodified_ratio,
        },
        "hf_checkpointing": {"peak_bytes": hf_peak, "reserved_bytes": hf_reserved, "step_over_eager": hf_ratio,
                             **phases(hf, ids)},
        "floor": {
            "min_feasible_bytes": floor_bytes, "predicted_peak_bytes": floor_plan.predicted_peak_bytes,
            "peak_bytes": floor_peak, "reserved_bytes": floor_reserved, "step_over_eager": floor_ratio,
            "predicted_overhead": floor_plan.predicted_overhead,
            "recomputed_regions": sum(a.recomputes for a in floor_plan.policy.actions),
            "breakdown": {"moment": breakdown.moment, "phase": str(breakdown.phase), **dict(breakdown.rows())}
            if breakdown is not None else None,
            **phases(floor, ids),
        },
        "summary": floor_plan.summary(),
    }


def gb(value: float | None) -> str:
    return "" if value is None else f"{value / 1e9:.3f}"


def readme_table(rows: list[dict[str, Any]]) -> str:
    """The markdown of the probe's JSON: one line per model and program (GB = 10^9 bytes)."""
    lines = ["| model | program | peak GB (own) | predicted GB (own) | reserved GB | step over eager | where the peak is |",
             "|---|---|---:|---:|---:|---:|---|"]
    for row in rows:
        floor = row["floor"]
        # a prediction counts the device memory the step does not own ("other device memory"); the peaks are own
        other = (floor["breakdown"] or {}).get("other device memory", 0)
        programs = [
            ("eager model", row["eager"], None, ""),
            ("autockpt, nothing recomputed", row["unmodified"], row["unmodified"]["predicted_peak_bytes"] - other, ""),
            ("HF gradient checkpointing", row["hf_checkpointing"], None, ""),
            (f"autockpt at its floor ({floor['recomputed_regions']} regions)", floor,
             floor["predicted_peak_bytes"] - other, (floor["breakdown"] or {}).get("moment", "")),
        ]
        for name, part, predicted, where in programs:
            ratio = part.get("step_over_eager")
            lines.append(f"| {row['model']} | {name} | {gb(part['peak_bytes'])} | {gb(predicted)} "
                         f"| {gb(part['reserved_bytes'])} | {'' if ratio is None else f'{ratio:.3f}'} | {where} |")
    config = "; ".join(f"{row['model']}: " + ", ".join(f"{k} {v}" for k, v in row["config"].items()) for row in rows)
    phases = ["| model | program | forward peak GB | alive after forward GB | backward peak GB |", "|---|---|---:|---:|---:|"]
    for row in rows:
        for name, part in (("HF gradient checkpointing", row["hf_checkpointing"]), ("autockpt at its floor", row["floor"])):
            if "forward_peak_bytes" in part:
                phases.append(f"| {row['model']} | {name} | {gb(part['forward_peak_bytes'])} "
                              f"| {gb(part['after_forward_bytes'])} | {gb(part['backward_peak_bytes'])} |")
    return (f"Device: {rows[0]['device']}. Models (fp32, forward + backward, labels = inputs, no optimizer): {config}. "
            "Peaks are each step's own (`max_memory_allocated` less the bytes allocated before the step that it does "
            "not own); predictions likewise less the plan's \"other device memory\". Step times: median over "
            "alternating rounds of the ratio to the eager step in the same round.\n\n" + "\n".join(lines)
            + "\n\nWhere each peak is (bytes the step allocated beyond what it found):\n\n" + "\n".join(phases))


def summarize(folder: Path) -> None:
    rows = json.loads((folder / "eager_program_cuda.json").read_text())
    write_section("probe_eager_program_cuda", readme_table(rows), output=folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--summarize", type=Path, help="write FOLDER/README.md from FOLDER's JSON, and stop")
    parser.add_argument("--models", default="llama,gpt2-medium")
    parser.add_argument("--size", default="cuda", choices=sorted(SIZES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.summarize is not None:
        summarize(args.summarize)
        return
    if args.out is None:
        parser.error("--out (or --summarize) is needed")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models.split(","):
        row = probe(name, args.size, torch.device(args.device), args.rounds)
        print(json.dumps({k: v for k, v in row.items() if k != "summary"}, indent=1), flush=True)
        print(row["summary"], flush=True)
        rows.append(row)
        (args.out / "eager_program_cuda.json").write_text(json.dumps(rows, indent=1))
        gc.collect()  # the planner and the modules hold cycles: the next model would find them on the device
        if args.device == "cuda":
            torch.cuda.empty_cache()
    with open(args.out / "eager_program_cuda.csv", "w", newline="") as handle:
        flat = [{"model": r["model"], **{f"{part}.{k}": v for part in ("eager", "unmodified", "hf_checkpointing",
                                                                        "floor")
                                         for k, v in r[part].items() if k != "breakdown"}} for r in rows]
        writer = csv.DictWriter(handle, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
    summarize(args.out)


if __name__ == "__main__":
    main()
