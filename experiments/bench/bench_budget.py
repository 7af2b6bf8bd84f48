"""Benchmark: does the optimized step keep the budget, how close is the prediction, what does it cost?

For each zoo model and budget (a fraction of the way from static bytes to the unmodified peak) one CSV row:
model, capture, budget, predicted peak, measured peak, unmodified peak, prediction error, step-time ratio
optimized/unmodified (alternating runs in one process, median of per-pair ratios), capture/profile/solve seconds.

    python -m experiments.bench.bench_budget                # CPU zoo, size "small"
    python -m experiments.bench.bench_budget --models gpt2 --size bench --fractions 0.5 \
        --out experiments/results/budget/bench_budget_gpt2.csv

Writes the CSV ``--out`` and, in the README.md beside it, the section named after the CSV (its stem).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import pandas as pd
import torch

import autockpt
from autockpt.present import zoo
from experiments.common.results_readme import write_section
from experiments.common.timing import step_time_ratio

DEFAULT_MODELS = ("mlp", "cnn", "transformer", "control_flow", "gpt2", "vit", "unet")


def bench_model(name: str, size: str, fractions: list[float], repeats: int) -> list[dict]:
    case = zoo.build(name, size)
    original = case.model
    unmodified = autockpt.measure_step(original, case.args, case.kwargs, case.loss_fn).peak_bytes
    probe = autockpt.plan(original, budget_bytes=10**15, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn)
    rows = []
    for fraction in fractions:
        budget = int(probe.static_bytes + fraction * (probe.baseline_peak_bytes - probe.static_bytes))
        row = {"model": name, "size": size, "fraction": fraction, "budget_bytes": budget, "unmodified_peak_bytes": unmodified}
        started = time.perf_counter()
        try:
            optimized = autockpt.optimize(
                original, budget_bytes=budget, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn
            )
        except autockpt.InfeasibleBudgetError as error:
            rows.append({**row, "feasible": False, "min_feasible_bytes": error.min_feasible_bytes})
            continue
        optimize_s = time.perf_counter() - started
        plan = autockpt.get_plan(optimized)
        measured = autockpt.measure_step(optimized, case.args, case.kwargs, case.loss_fn).peak_bytes
        ratio = step_time_ratio(optimized, original, case, repeats)
        rows.append(
            {
                **row,
                "feasible": True,
                "capture": plan.capture.value,
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "measured_peak_bytes": measured,
                "within_budget": measured <= budget,
                "prediction_error": (measured - plan.predicted_peak_bytes) / measured,
                "min_feasible_bytes": plan.min_feasible_bytes,
                "regions": len(plan.regions),
                "predicted_overhead": plan.predicted_overhead,
                "step_time_ratio": ratio,
                "capture_s": plan.capture_time_s,
                "profile_s": plan.profile_time_s,
                "solve_s": plan.solve_time_s,
                "optimize_s": optimize_s,
            }
        )
        print(f"{name} {fraction:.0%}: measured {measured} / budget {budget}, ratio {ratio:.3f}", file=sys.stderr)
    return rows


def markdown_table(table: pd.DataFrame) -> str:
    def cell(column: str, value: object) -> str:
        if isinstance(value, float):
            if math.isnan(value):
                return ""
            # bytes stay whole numbers (a refused row's blanks make pandas store the column as floats)
            return f"{value:.0f}" if column.endswith("_bytes") else f"{value:.3f}"
        return str(value)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += [
        "| " + " | ".join(cell(c, v) for c, v in zip(table.columns, row)) + " |"
        for row in table.itertuples(index=False)
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--size", default="small", choices=zoo.SIZES)
    parser.add_argument("--fractions", default="0.3,0.5,0.7")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="experiments/results/budget/bench_budget_small.csv")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    fractions = [float(f) for f in args.fractions.split(",")]
    rows = []
    for name in args.models.split(","):
        rows += bench_model(name, args.size, fractions, args.repeats)
    table = pd.DataFrame(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    columns = [
        "model", "capture", "fraction", "budget_bytes", "predicted_peak_bytes", "measured_peak_bytes",
        "unmodified_peak_bytes", "prediction_error", "step_time_ratio", "capture_s", "profile_s", "solve_s",
    ]
    print(markdown_table(table[[c for c in columns if c in table]]))
    write_section(Path(args.out).stem, markdown_table(table[[c for c in columns if c in table]]), output=args.out)
    print(f"\nmachine: {torch.get_num_threads()} threads, torch {torch.__version__}; wrote {args.out}")


if __name__ == "__main__":
    main()
