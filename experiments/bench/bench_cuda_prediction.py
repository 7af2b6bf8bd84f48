"""How close autockpt's predicted peak is to ``torch.cuda.max_memory_allocated`` on a GPU (issue 23, item 7).

    python -m experiments.bench.bench_cuda_prediction --out experiments/results/cuda_prediction

Per model (zoo models at size ``bench``, and an 8-layer GPT-2-medium-wide decoder at batch 8 x sequence 1024, where
the GPU is busy), the Planner profiles the step once, then plans at budgets ``--fractions`` of the way from static
memory to the unmodified peak; each plan is applied *without* measured verification (``Planner.apply``: verification
would tighten a plan that measures over and hide the error) and one step is measured: ``max_memory_allocated`` and
``max_memory_reserved`` (reset before the step; the previous model is collected before the next is built). Error =
(measured - predicted) / measured: positive means the prediction was low, the direction that breaks a budget.
``--label`` names the code measured (for a run of an older checkout: ``PYTHONPATH=/path/to/old:. python -P -m
experiments.bench.bench_cuda_prediction --label old``; ``-P`` keeps the current folder's autockpt from shadowing the
old one); rows of other labels already in the CSV are kept, so two checkouts land in one table. Writes
``cuda_prediction.csv``, ``cuda_prediction.md`` and the section ``bench_cuda_prediction`` of the README.md in ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch
from torch.utils import _pytree as pytree

import autockpt
from autockpt.present import zoo
from experiments.common.results_readme import write_section

MB = 10**6


@dataclass(frozen=True)
class Row:
    label: str
    model: str
    fraction: float
    budget_bytes: int
    regions: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    reserved_peak_bytes: int | None
    error: float  # (measured - predicted) / measured
    kept: bool


def gpt2_medium_wide() -> zoo.ZooCase:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=8, n_embd=1024, n_head=16, n_positions=1024, vocab_size=50257, bos_token_id=0,
                        eos_token_id=0, use_cache=False)
    ids = torch.randint(0, 50257, (8, 1024))
    return zoo.ZooCase(name="gpt2_medium_8l", model=GPT2LMHeadModel(config), args=(ids,), kwargs={"labels": ids})


def on_device(case: zoo.ZooCase, device: torch.device) -> zoo.ZooCase:
    move = lambda value: value.to(device) if isinstance(value, torch.Tensor) else value
    return zoo.ZooCase(name=case.name, model=case.model.to(device), args=pytree.tree_map(move, case.args),
                       kwargs=pytree.tree_map(move, case.kwargs), loss_fn=case.loss_fn)


def measure_model(case: zoo.ZooCase, fractions: list[float], label: str) -> list[Row]:
    planner = autockpt.Planner.from_model(case.model, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn)
    trace = planner.trace
    rows = []
    for fraction in fractions:
        budget = int(trace.static_bytes + fraction * (trace.baseline_peak_bytes - trace.static_bytes))
        try:
            the_plan = planner.plan(budget_bytes=budget)
        except autockpt.InfeasibleBudgetError as error:
            the_plan = planner.plan(budget_bytes=error.min_feasible_bytes)  # the floor's plan, said by its budget
            budget = error.min_feasible_bytes
        module = planner.apply(the_plan)
        case.model.zero_grad(set_to_none=True)
        measured = autockpt.measure_step(module, case.args, case.kwargs, case.loss_fn)
        case.model.zero_grad(set_to_none=True)
        error = (measured.peak_bytes - the_plan.predicted_peak_bytes) / measured.peak_bytes
        rows.append(Row(label, case.name, fraction, budget, len(the_plan.regions), the_plan.predicted_peak_bytes,
                        measured.peak_bytes, measured.reserved_bytes, round(error, 5), measured.peak_bytes <= budget))
        print(rows[-1], flush=True)
        del module
    return rows


def markdown(table: pd.DataFrame, command: str) -> str:
    lines = [
        (f"Made by `{command}` on {torch.cuda.get_device_name()}, torch {torch.__version__}. Peaks in MB (10^6 "
         "bytes): `max_memory_allocated` and `max_memory_reserved` of one step of the plan applied without "
         "verification; error = (measured - predicted) / measured (positive: predicted low). Fraction 0.0 stands for "
         "the floor."),
        "",
        "| code | model | fraction | regions | budget | predicted | measured | reserved | error | kept |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table.itertuples():
        reserved = "" if pd.isna(r.reserved_peak_bytes) else f"{r.reserved_peak_bytes / MB:.1f}"
        lines.append(f"| {r.label} | {r.model} | {r.fraction:.2f} | {r.regions} | {r.budget_bytes / MB:.1f} | "
                     f"{r.predicted_peak_bytes / MB:.1f} | {r.measured_peak_bytes / MB:.1f} | {reserved} | "
                     f"{100 * r.error:+.2f} % | {'yes' if r.kept else 'no'} |")
    worst = table.groupby("label").error.agg(["min", "max"])
    lines += ["", "Error range per code: " + "; ".join(
        f"{label}: {100 * row['min']:+.2f} % to {100 * row['max']:+.2f} %" for label, row in worst.iterrows())]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2_medium_8l,gpt2,llama,vit,cnn")
    parser.add_argument("--fractions", default="1.0,0.5,0.0")
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/cuda_prediction"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    device = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "cuda_prediction.csv"
    kept = pd.read_csv(path) if path.exists() else pd.DataFrame()
    if not kept.empty:
        kept = kept[kept.label != args.label]
    rows: list[Row] = []
    for name in args.models.split(","):
        case = gpt2_medium_wide() if name == "gpt2_medium_8l" else zoo.build(name, "bench")
        rows += measure_model(on_device(case, device), [float(f) for f in args.fractions.split(",")], args.label)
        del case
        gc.collect()
        torch.cuda.empty_cache()
        table = pd.concat([kept, pd.DataFrame([asdict(r) for r in rows])], ignore_index=True)
        table.to_csv(path, index=False)  # after every model: a run stopped part-way keeps what it measured
    command = "python -m experiments.bench.bench_cuda_prediction " + " ".join(sys.argv[1:])
    text = markdown(table, command)
    (args.out / "cuda_prediction.md").write_text(text)
    print(text)
    write_section("bench_cuda_prediction", text, output=args.out)


if __name__ == "__main__":
    main()
