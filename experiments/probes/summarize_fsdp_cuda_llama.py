"""Write ``experiments/results/fsdp_cuda_llama/README.md`` from CUDA check 6 (``bash experiments/device/run.sh
fsdp_llama`` on an H100, ``probe_fsdp_cuda_llama``), and predict each measured plan's peak again with the planner as
it is now, on this machine (CPU fakes, no GPU).

    python -m experiments.probes.summarize_fsdp_cuda_llama

The GPU run used plans made before the planner counted a foreach optimizer step (``autockpt/fsdp/fake_world.py``):
the "predicted then" column is theirs; "predicted now" measures the same decisions on the fake process group as the
planner now does for a CUDA target (AdamW's default there: foreach). GB = 10^9 bytes.
"""

from __future__ import annotations

import argparse
import csv
import json
import re

import torch

import autockpt
from autockpt.fsdp.fake_world import fake_world, measure_sharded_step
from autockpt.measure.loop import NAMED_OPTIMIZERS
from experiments.common.results_readme import RESULTS_DIR
from experiments.probes.probe_fsdp_cuda_llama import FOR_LOOP, llama_config, loss_fn, meta_model

FOLDER = RESULTS_DIR / "fsdp_cuda_llama"
_LINE = re.compile(r"^(?P<name>[^:]+): predicted (?P<predicted>\d+) B, measured (?P<measured>\d+) B")


def measured_rows(name: str) -> list[dict[str, str]]:
    """The run's CSV where it wrote one, else its log's peak lines (the 128k-vocabulary run stopped before its CSV)."""
    table = FOLDER / f"{name}.csv"
    if table.exists():
        with open(table) as handle:
            return list(csv.DictReader(handle))
    index = json.loads((FOLDER / "plans" / name / "plans.json").read_text())
    rows = []
    for line in (FOLDER / f"{name}.log").read_text().splitlines():
        found = _LINE.match(line)
        if found:
            fplan = autockpt.load_fsdp_plan(FOLDER / "plans" / name / index["files"][found["name"]])
            rows.append({"plan": found["name"], "predicted_peak_bytes": found["predicted"],
                         "max_allocated_bytes": found["measured"], "budget_bytes": str(fplan.budget_bytes)})
    return rows


def predicted_now(vocab: int, rows: list[dict[str, str]]) -> dict[str, int]:
    """Each measured plan's decisions measured again on the fake process group as plan_fsdp now does for a GPU."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    args = argparse.Namespace(tiny=False, layers=4, vocab=vocab, seq=8192)
    config = llama_config(args)
    index = json.loads((FOLDER / "plans" / ("main" if vocab == 32000 else "vocab128k") / "plans.json").read_text())
    ids = torch.zeros((1, args.seq), dtype=torch.long, device="meta")
    out = {}
    with fake_world(1):
        for row in rows:
            plan_name = "full" if row["plan"] == FOR_LOOP else row["plan"]
            folder = FOLDER / "plans" / ("main" if vocab == 32000 else "vocab128k")
            fplan = autockpt.load_fsdp_plan(folder / index["files"][plan_name])
            memory = measure_sharded_step(
                meta_model(config), world_size=1, units=fplan.units, checkpointed=fplan.checkpointed,
                selective=fplan.selective, offloaded=fplan.offloaded, reshard_after_forward=True,
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                inputs=((ids,), {}, ids), step_loss=loss_fn, make_optimizer=NAMED_OPTIMIZERS["adamw"],
                device_type="cpu" if row["plan"] == FOR_LOOP else "cuda",
            )
            out[row["plan"]] = memory.peak_bytes
            print(f"{vocab}: {row['plan']}: predicted now {memory.peak_bytes} B", flush=True)
    return out


def gb(value: float | str | None) -> str:
    return "" if value in (None, "", "nan") else f"{float(value) / 1e9:.3f}"


def pct(measured: float, predicted: float) -> str:
    return f"{100 * (measured / predicted - 1):+.2f} %"


def peak_table(rows: list[dict[str, str]], now: dict[str, int]) -> list[str]:
    lines = [("| plan | budget GB | predicted then GB | predicted now GB | measured GB (max_memory_allocated) | "
              "measured vs then | measured vs now | kept the budget |"), "|---|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        measured, then, again = float(row["max_allocated_bytes"]), float(row["predicted_peak_bytes"]), now[row["plan"]]
        budget = row.get("budget_bytes")
        kept = "" if not budget or float(budget) >= 1e12 else ("yes" if measured <= float(budget) else "**no**")
        lines.append(f"| {row['plan']} | {gb(budget) if budget and float(budget) < 1e12 else 'none'} | {gb(then)} "
                     f"| {gb(again)} | {gb(measured)} | {pct(measured, then)} | {pct(measured, again)} | {kept} |")
    return lines


def time_table(rows: list[dict[str, str]]) -> list[str]:
    lines = [("| plan | decisions (full / selective / full+offload) | predicted step ms | measured step ms | "
              "predicted vs full | measured vs full (median of rounds; min-max) |"), "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        if row["plan"] == FOR_LOOP:
            continue
        lines.append(
            f"| {row['plan']} | {row['checkpointed']} / {row['selective']} / {row['full_offload']} "
            f"| {float(row['predicted_step_ms']):.1f} | {float(row['measured_step_ms']):.1f} "
            f"| {float(row['predicted_ratio_vs_full']):.3f} | {float(row['measured_ratio_vs_full']):.3f} "
            f"({float(row['round_ratio_min']):.3f}-{float(row['round_ratio_max']):.3f}) |")
    return lines


def main() -> None:
    main_rows, wide_rows = measured_rows("main"), measured_rows("vocab128k")
    now_main, now_wide = predicted_now(32000, main_rows), predicted_now(128256, wide_rows)
    meta = json.loads((FOLDER / "main.json").read_text())["meta"]
    pool = json.loads((FOLDER / "main.json").read_text())["details"]["autockpt + pool, under full"]["pool"]
    gpu = (FOLDER / "gpu.txt").read_text().strip()
    text = "\n".join([
        "# FSDP2 plans on one H100 at Llama-3-8B's block shape (CUDA check 6, 2026-11-26)",
        "",
        (f"`bash experiments/device/run.sh fsdp_llama` on the device tool: {gpu}, torch {meta['torch']}, NCCL, world 1. Plans "
        "made beforehand on a CPU (torch 2.13, fake process group, `target=\"h100-sxm-80gb\"`; the device's torch "
        "2.11 could not fake-trace the meta model, and a CPU model of uninitialised tensors took 114 s per plan "
        "there, against 4 s for the meta model here: `first_try_planning_on_device.log`). Model: transformers "
        "`LlamaForCausalLM`, 4 blocks of Llama-3-8B "
        "(hidden 4096, intermediate 14336, 32 heads, 8 KV heads), vocabulary 32000 (`main.*`) or 128256 "
        "(`vocab128k.log`), 1 x 8192 tokens, bf16 parameters and fp32 reduce (`MixedPrecisionPolicy`), AdamW with "
        "torch's default (foreach on CUDA). Each plan's peak: its model alone, two steps, "
        "`torch.cuda.max_memory_allocated` less what was allocated before it was built. Written by "
        "`python -m experiments.probes.summarize_fsdp_cuda_llama`, which also predicts each plan's decisions again with "
        "the planner as it is now (\"predicted now\")."),
        "",
        "## Peaks, vocabulary 32000",
        "",
        *peak_table(main_rows, now_main),
        "",
        "## Peaks, vocabulary 128256",
        "",
        ("The run stopped before its last row (full with the for-loop AdamW) and its CSV: CUDA out of memory with "
         "69.75 GiB allocated, about twice one model's peak, so the probe had not freed an earlier row's model "
         "(not investigated; each row's peak is taken less what was allocated before its model was built)."),
        "",
        *peak_table(wide_rows, now_wide),
        "",
        "## Step time against full checkpointing per block, vocabulary 32000",
        "",
        (f"Each plan's model and full's model on the GPU together, stepped in turn for {meta['config']['rounds']} "
         "rounds after two untimed rounds (`torch.cuda.synchronize` around each step). Predicted: the plans' roofline "
         "step model for H100 SXM, which leaves out the optimizer step and FSDP's copy-in/copy-out."),
        "",
        *time_table(main_rows),
        "",
        f"Host pool of the offloaded plan after two steps: `{pool}`.",
    ])
    (FOLDER / "README.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
