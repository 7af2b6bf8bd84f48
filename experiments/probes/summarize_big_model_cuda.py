"""Write experiments/results/big_model_cuda/README.md from the CSVs the CUDA probes wrote there.

    python -m experiments.probes.summarize_big_model_cuda

Reads ``big_model_cuda.csv`` (``probe_big_model_cuda``), ``unfit_step_cuda.csv`` (``probe_unfit_step_cuda``),
``gpu.txt`` and ``versions.txt`` of the last run, and ``first_run/`` (the run before the optimizer fix).
GB = 10^9 bytes.
"""

from __future__ import annotations

import pandas as pd

from experiments.common.results_readme import RESULTS_DIR

FOLDER = RESULTS_DIR / "big_model_cuda"


def gb(value: object) -> str:
    return "" if pd.isna(value) else f"{float(value) / 1e9:.2f}"


def big_model_table(frame: pd.DataFrame) -> list[str]:
    lines = [
        ("| plan | budget GB | regions | predicted peak GB (CPU fake) | predicted (CUDA fake) | measured GB "
         "(max_memory_allocated) | reserved GB | measured vs predicted | kept |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in frame.to_dict("records"):
        measured = row.get("measured_peak_bytes")
        versus = "" if pd.isna(measured) else f"{row['measured_over_predicted_percent']:+.2f} %"
        outcome = row["outcome"] if row["outcome"] != "ran" else ""
        lines.append(
            f"| {row['plan']} | {gb(row['budget_bytes'])} | {row['regions']} | {gb(row['predicted_peak_cpu_fake_bytes'])} "
            f"| {gb(row.get('predicted_peak_cuda_fake_bytes'))} | {gb(measured) or outcome[:60]} "
            f"| {gb(row.get('measured_reserved_bytes'))} | {versus} | {'' if pd.isna(row.get('kept_budget')) else row['kept_budget']} |"
        )
    return lines


def unfit_table(frame: pd.DataFrame) -> list[str]:
    lines = [
        "| model | unmodified measured MB | device memory MB | trace | predicted MB | measured MB | kept | outcome |",
        "|---|---:|---:|---|---:|---:|---|---|",
    ]
    for row in frame.to_dict("records"):
        outcome = row.get("outcome")
        outcome = "" if pd.isna(outcome) else str(outcome)[:140]
        mb = lambda v: "" if pd.isna(v) else f"{float(v) / 1e6:.2f}"
        lines.append(
            f"| {row['model']} | {mb(row['unmodified_measured_bytes'])} | {mb(row['device_memory_bytes'])} "
            f"| {row.get('trace', '') if row.get('trace') == row.get('trace') else ''} | {mb(row.get('predicted_peak_bytes'))} "
            f"| {mb(row.get('measured_peak_bytes'))} | {row.get('kept_budget', '') if row.get('kept_budget') == row.get('kept_budget') else ''} | {outcome} |"
        )
    return lines


def main() -> None:
    big = pd.read_csv(FOLDER / "big_model_cuda.csv")
    unfit = pd.read_csv(FOLDER / "unfit_step_cuda.csv")
    first = pd.read_csv(FOLDER / "first_run" / "big_model_cuda.csv")
    benchmarked = pd.read_csv(FOLDER / "benchmark_timing" / "unfit_step_cuda.csv")
    gpu = (FOLDER / "gpu.txt").read_text().strip().splitlines()[-1]
    versions = (FOLDER / "versions.txt").read_text().strip()
    lines = [
        "# A big model planned without its GPU, then run on it (H100)",
        "",
        f"Device: {gpu}; torch and transformers {versions}. Commands (device tool): `bash experiments/device/run.sh big_model`;",
        "this page: `python -m experiments.probes.summarize_big_model_cuda`. GB = 10^9 bytes.",
        "",
        "## Llama-2-7B, bf16 weights, AdamW, batch 1 x 8192, planned on the meta device for `h100-sxm-80gb`",
        "",
        "`experiments/probes/probe_big_model_cuda.py`: the model is built on the meta device and planned as a laptop would plan",
        "it (`trace=\"auto\"`: fake CPU tensors; roofline times for the target), at the target's memory (80 GB, the",
        "default budget) and at 75 and 70 GB. Then the model is materialised on the H100 (random weights) and each plan",
        "applied with `autockpt.apply_plan` and measured (`autockpt.measure_step` with the loop's AdamW: its states,",
        f"and optimizer.step() included). Planning took {big['plan_wall_s'].iloc[0]:.1f} s on the device machine's CPU.",
        "",
        *big_model_table(big),
        "",
        "The unmodified step does not fit (the prediction says so: it runs out of memory on the H100). Every plan made",
        "from the CPU fake trace kept its budget on the H100; the CUDA step measured 2.8 to 5.6 % under the prediction",
        "(CUDA's attention kernels save less than the CPU's). The fake trace on CUDA tensors predicts within a few",
        "kB of the CPU one: the difference is the allocator's 512-byte rounding. `max_memory_reserved` is 8 to 10 % above",
        "the allocated peak (the caching allocator's blocks): at the 80 GB plan, 83.46 GB reserved, which the card",
        "(85.5 GB) holds. autockpt's budgets are allocated bytes, as `torch.cuda.max_memory_allocated` counts them;",
        "the table's `h100-sxm-80gb` memory is 80 GB (10^9 bytes), below the card's 81,559 MiB: that leaves the room.",
        "",
        "### Before the fix: the optimizer's implementation (first run, batch 1 x 4096)",
        "",
        "The first run planned the same model at 1 x 4096 with the optimizer's step measured as torch runs it on the CPU",
        "(the for-loop AdamW). The unmodified step was predicted within 0.3 %, but the 60 GB plan measured 67.7 GB, the",
        "unmodified step's peak: on CUDA torch runs AdamW's foreach implementation, whose temporaries are the size of",
        "all parameters, and that step was the peak. Plans for a CUDA device now run the optimizer's default",
        "implementation for that device (`DeviceSpec.device_type`); at 1 x 4096 the foreach step is then the floor, so",
        "the second run uses 1 x 8192, where activations matter.",
        "",
        *big_model_table(first),
        "",
        "## optimize() under a device memory below the unmodified peak (zoo models, \"small\")",
        "",
        "`experiments/probes/probe_unfit_step_cuda.py`: `autockpt.optimize(model, ..., device_memory_bytes=f x the unmodified",
        "step's measured peak)`, f = 0.7 and 0.8: the step is traced on fake CUDA tensors (no unmodified step runs),",
        "planned, and only the optimized step measured. The unmodified figure grows down the table: earlier rows leave",
        "memory allocated on the device, which every step counts.",
        "",
        *unfit_table(unfit),
        "",
        "Refusals are honest: GPT-2 at 0.7 measured 0.6 % over its plan's prediction and no tighter plan exists; ViT at",
        "0.7 is below the smallest peak any plan reaches. These rows ran before the benchmark timing existed (their",
        "unit times were placeholders, so the plans chose by memory alone).",
        "",
        "### With the benchmark timing (`bash experiments/device/run.sh unfit_step`: f = 0.8 and 0.75)",
        "",
        "The same, after `timing=\"auto\"` became the benchmark timing for a fake trace: each op run alone on the",
        "H100 at its shapes (repeated blocks once; well under a second per model), so the plans choose by time too.",
        "",
        *unfit_table(benchmarked),
        "",
        "Every accepted budget was kept; the ViT refusals are its floor again (0.75 and 0.8 of an unmodified peak that",
        "earlier rows' leftovers raised).",
        "",
    ]
    (FOLDER / "README.md").write_text("\n".join(lines))
    print(f"wrote {FOLDER / 'README.md'}")


if __name__ == "__main__":
    main()
