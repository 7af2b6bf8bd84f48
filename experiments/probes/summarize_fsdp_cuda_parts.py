"""Write ``experiments/results/fsdp_cuda_parts/README.md`` from CUDA check 7 (``bash experiments/device/run.sh
fsdp_parts`` on the device tool: FSDP2 plans with checkpointed parts) and from the saved-tensor listing of one decoder
layer on CPU fakes and on the GPU (``probe_saved_tensors``, in ``experiments/results/saved_tensors/``).

    python -m experiments.probes.summarize_fsdp_cuda_parts

GB = 10^9 bytes.
"""

from __future__ import annotations

import csv
import json
import math

from experiments.common.results_readme import RESULTS_DIR
from experiments.probes.probe_fsdp_cuda_llama import FOR_LOOP
from experiments.probes.summarize_fsdp_cuda_llama import gb, pct

FOLDER = RESULTS_DIR / "fsdp_cuda_parts"
SAVED = RESULTS_DIR / "saved_tensors"


def peak_table(rows: list[dict[str, str]]) -> list[str]:
    lines = [("| plan | full / selective / parts | budget GB | predicted GB | measured GB (max_memory_allocated) | "
              "reserved GB | measured vs predicted | kept the budget |"), "|---|---|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        measured, predicted, budget = (float(row[k]) for k in ("max_allocated_bytes", "predicted_peak_bytes",
                                                               "budget_bytes"))
        kept = "" if budget >= 1e12 else ("yes" if measured <= budget else "**no**")
        lines.append(f"| {row['plan']} | {row['checkpointed']} / {row['selective']} / {row['parts']} "
                     f"| {gb(budget) if budget < 1e12 else 'none'} | {gb(predicted)} | {gb(measured)} "
                     f"| {gb(row['max_reserved_bytes'])} | {pct(measured, predicted)} | {kept} |")
    return lines


def time_table(rows: list[dict[str, str]]) -> list[str]:
    lines = [("| plan | measured peak GB | predicted step ms | measured step ms | predicted vs full | "
              "measured vs full (median of rounds; min-max) |"), "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        if row["plan"] == FOR_LOOP:
            continue
        predicted = float(row["predicted_step_ms"])
        shown = ("not predicted", "-") if math.isnan(predicted) else (f"{predicted:.1f}",
                                                                       f"{float(row['predicted_ratio_vs_full']):.3f}")
        lines.append(f"| {row['plan']} | {gb(row['max_allocated_bytes'])} | {shown[0]} "
                     f"| {float(row['measured_step_ms']):.1f} | {shown[1]} "
                     f"| {float(row['measured_ratio_vs_full']):.3f} ({float(row['round_ratio_min']):.3f}-"
                     f"{float(row['round_ratio_max']):.3f}) |")
    return lines


def saved_table() -> tuple[list[str], dict[str, dict]]:
    runs = {mode: json.loads((SAVED / f"saved_{mode}.json").read_text()) for mode in ("fake", "cuda")}
    sizes = {mode: {r["tensor"]: (r["count"], r["bytes"]) for r in run["rows"]} for mode, run in runs.items()}
    lines = ["| saved tensor (shape, dtype) | CPU fakes: count, bytes | CUDA: count, bytes |", "|---|---:|---:|"]
    for name in sorted(set(sizes["fake"]) | set(sizes["cuda"]),
                       key=lambda n: -max(sizes["fake"].get(n, (0, 0))[1], sizes["cuda"].get(n, (0, 0))[1])):
        fake, cuda = sizes["fake"].get(name), sizes["cuda"].get(name)
        if fake != cuda:
            lines.append(f"| {name} | {f'{fake[0]}, {fake[1]:,}' if fake else '-'} "
                         f"| {f'{cuda[0]}, {cuda[1]:,}' if cuda else '-'} |")
    lines.append(f"| all saved tensors | {runs['fake']['total_bytes']:,} | {runs['cuda']['total_bytes']:,} |")
    return lines, runs


def main() -> None:
    with open(FOLDER / "fsdp_cuda_llama.csv") as handle:
        rows = list(csv.DictReader(handle))
    meta = json.loads((FOLDER / "fsdp_cuda_llama.json").read_text())["meta"]
    gpu = (FOLDER / "gpu.txt").read_text().strip()
    saved, runs = saved_table()
    text = "\n".join([
        "# FSDP2 plans with checkpointed parts, at Llama-3-8B's block shape on one GPU (CUDA check 7, 2026-11-26)",
        "",
        (f"`bash experiments/device/run.sh fsdp_parts` on the device tool: {gpu}, torch {meta['torch']}, NCCL, world 1. Plans "
         "made beforehand on a CPU (torch 2.13, transformers 5.24, fake process group, `target=\"h100-sxm-80gb\"`: "
         "roofline times for an H100 SXM, measured on an H200): `plans/`. Model: transformers `LlamaForCausalLM`, 4 "
         "blocks of Llama-3-8B (hidden 4096, intermediate 14336, 32 heads, 8 KV heads), vocabulary 32000, "
         f"{meta['config']['batch']} x {meta['config']['seq']} tokens (two rows: activations, not the foreach "
         "optimizer step, make the peak), bf16 parameters and fp32 reduce, AdamW with torch's default (foreach on "
         "CUDA). Parts: a block's `mlp` or `self_attn` checkpointed alone; the `mlp per block` and `self_attn per "
         "block` rows are every block so, their peaks measured on the fake process group as the planner measures, "
         "their step times not predicted. Each peak: the plan's model alone, two steps, "
         "`torch.cuda.max_memory_allocated` less what was allocated before it was built. Written by "
         "`python -m experiments.probes.summarize_fsdp_cuda_parts`."),
        "",
        "## Peaks",
        "",
        *peak_table(rows),
        "",
        "## Step time against full checkpointing per block",
        "",
        (f"Each plan's model and full's model on the GPU together, stepped in turn for {meta['config']['rounds']} "
         "rounds after two untimed rounds (`torch.cuda.synchronize` around each step). Predicted: the plans' "
         "roofline step model for H100 SXM (the device was an H200: ratios, not milliseconds, compare)."),
        "",
        *time_table(rows),
        "",
        "## What the CPU fakes over-count: one decoder layer's saved tensors",
        "",
        (f"`python -m experiments.probes.probe_saved_tensors fake|cuda`: one `LlamaForCausalLM` layer of the shape above, "
         f"bf16, 1 x {runs['fake']['seq']} tokens, SDPA attention; CPU fakes with torch {runs['fake']['torch']} and "
         f"transformers {runs['fake']['transformers']} here, CUDA with torch {runs['cuda']['torch']} and "
         f"transformers {runs['cuda']['transformers']} on the GPU. Rows that differ:"),
        "",
        *saved,
    ])
    (FOLDER / "README.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
