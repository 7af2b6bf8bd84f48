"""Is the smallest feasible budget autockpt states one that works when measured?

    python -m experiments.bench.bench_min_feasible --out experiments/results/min_feasible

Per model (every zoo model at tiny size, and a Hugging Face ``ResNetForImageClassification``: BatchNorm, residual
convs): ``autockpt.optimize(model, budget_bytes=1)`` raises ``InfeasibleBudgetError`` stating the smallest feasible
budget; ``optimize`` at exactly that budget must then return a module whose measured step peak (MemTracker on CPU)
is at most that budget. Rows: the stated minimum, the predicted floor it came from, the measured peak at the minimum,
and whether optimize kept it or raised. Nothing is typed in by hand: ``min_feasible.csv``, ``min_feasible.md`` and the
section ``bench_min_feasible`` of the README.md in ``--out``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import autockpt
from autockpt.present import zoo
from experiments.common.results_readme import write_csv, write_section


@dataclass(frozen=True)
class Row:
    model: str
    stated_min_bytes: int
    measured_peak_bytes: int | None
    kept: bool
    error: str
    seconds: float


def resnet_case() -> zoo.ZooCase:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
    images = torch.randn(4, 3, 32, 32)
    return zoo.ZooCase(
        name="hf-resnet", model=ResNetForImageClassification(config), args=(images,),
        kwargs={"labels": torch.randint(0, 10, (4,))},
    )


def cases() -> list[zoo.ZooCase]:
    return [zoo.build(name) for name in zoo.BUILDERS] + [resnet_case()]


def stated_minimum_bytes(model: torch.nn.Module, **optimize_kwargs: Any) -> int:
    """The smallest feasible budget ``optimize`` states when refusing a 1-byte one."""
    try:
        autockpt.optimize(model, budget_bytes=1, **optimize_kwargs)
    except autockpt.InfeasibleBudgetError as error:
        return error.min_feasible_bytes
    raise AssertionError("a 1-byte budget was accepted")


def optimized_at_stated_minimum(model: torch.nn.Module, **optimize_kwargs: Any) -> tuple[int, Any, str]:
    """The stated minimum, and ``optimize`` at it: the optimized module, or None and the refusal's first line."""
    stated = stated_minimum_bytes(model, **optimize_kwargs)
    try:
        return stated, autockpt.optimize(model, budget_bytes=stated, **optimize_kwargs), ""
    except autockpt.InfeasibleBudgetError as error:
        return stated, None, str(error).splitlines()[0][:160]


def run(case: zoo.ZooCase) -> Row:
    started = time.perf_counter()
    kwargs = {"example_inputs": case.args, "example_kwargs": case.kwargs, "loss_fn": case.loss_fn}
    stated, module, refusal = optimized_at_stated_minimum(case.model, **kwargs)
    if module is None:
        return Row(case.name, stated, None, False, refusal, time.perf_counter() - started)
    measured = autockpt.get_plan(module).measured_peak_bytes
    kept = measured is not None and measured <= stated
    return Row(case.name, stated, measured, kept, "", time.perf_counter() - started)


def markdown(rows: list[Row]) -> str:
    kept = sum(r.kept for r in rows)
    lines = [
        (f"`python -m experiments.bench.bench_min_feasible --out experiments/results/min_feasible` (CPU, MemTracker): "
         f"optimize at the stated smallest feasible budget kept it on {kept} of {len(rows)} models."),
        "",
        "| model | stated minimum (bytes) | measured peak at it | kept | seconds | error |",
        "|---|---:|---:|---|---:|---|",
    ]
    for r in rows:
        measured = "" if r.measured_peak_bytes is None else str(r.measured_peak_bytes)
        lines.append(f"| {r.model} | {r.stated_min_bytes} | {measured} | {'yes' if r.kept else 'no'} | "
                     f"{r.seconds:.1f} | {r.error} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/results/min_feasible"))
    parser.add_argument("--models", nargs="*", help="zoo names (and hf-resnet) to run; default: all")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in cases():
        if args.models and case.name not in args.models:
            continue
        row = run(case)
        print(row, flush=True)
        rows.append(row)
    write_csv(args.out / "min_feasible.csv", rows)
    text = markdown(rows)
    (args.out / "min_feasible.md").write_text(text + "\n")
    write_section("bench_min_feasible", text, output=args.out)
    print(text)


if __name__ == "__main__":
    main()
