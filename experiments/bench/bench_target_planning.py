"""Planning for another device from this one: what skipping the measured trace's timed steps saves (issue 46).

    python -m experiments.bench.bench_target_planning --out experiments/results/roofline
    python -m experiments.bench.bench_target_planning --smoke     # one tiny model, two rounds; prints, writes nothing

``Planner.from_model(..., target="h100-sxm-80gb")`` on a CPU model runs the real step for its memory and times the
units by the H100's roofline. Since 2026-11-29 the measured trace skips its three timed steps (and the markers put in
for them) when the timing replaces every time (``measure.timing.uses_measured_times``). Per model, in alternating
rounds in one process, ``from_model`` with the steps skipped (the library as it is) and with them run (the old
behaviour: ``planning.build.uses_measured_times`` patched to say the times are used); the median of each and their
ratio. Writes ``target_planning.csv`` and the section ``bench_target_planning`` of the README.md in ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import autockpt
from autockpt.planning import build
from autockpt.present import zoo
from experiments.common.results_readme import write_csv, write_section

MODELS = (("gpt2", "small"), ("transformer", "small"), ("cnn", "small"))
SMOKE_MODELS = (("mlp", "tiny"),)
TARGET = "h100-sxm-80gb"


@dataclass(frozen=True)
class PlanningTime:
    model: str
    size: str
    target: str
    rounds: int
    skipped_median_s: float  # from_model with the timed steps skipped (the library as it is)
    run_median_s: float  # from_model with them run (the behaviour before 2026-11-29)
    ratio: float  # skipped / run


def _planning_seconds(case: zoo.ZooCase, times_used: Callable[..., bool] | None) -> float:
    """One ``from_model`` for ``TARGET``; ``times_used`` replaces ``build.uses_measured_times`` for it when given."""
    original = build.uses_measured_times
    if times_used is not None:
        build.uses_measured_times = times_used
    try:
        started = time.perf_counter()
        autockpt.Planner.from_model(case.model, example_inputs=case.args, example_kwargs=case.kwargs,
                                    loss_fn=case.loss_fn, target=TARGET, loss_chunk_tokens=0)
        return time.perf_counter() - started
    finally:
        build.uses_measured_times = original


def measure(name: str, size: str, rounds: int) -> PlanningTime:
    case = zoo.build(name, size)
    always_used: Callable[..., Any] = lambda timing, target: True  # the old behaviour
    _planning_seconds(case, None), _planning_seconds(case, always_used)  # warm-up: first capture, calibrations
    skipped, run = [], []
    for _ in range(rounds):
        skipped.append(_planning_seconds(case, None))
        run.append(_planning_seconds(case, always_used))
    skipped_s, run_s = statistics.median(skipped), statistics.median(run)
    return PlanningTime(model=name, size=size, target=TARGET, rounds=rounds, skipped_median_s=round(skipped_s, 3),
                        run_median_s=round(run_s, 3), ratio=round(skipped_s / run_s, 3))


def markdown(rows: list[PlanningTime], command: str) -> str:
    lines = [
        (f"`{command}` (CPU, one thread, torch {torch.__version__}). `Planner.from_model(target=\"{TARGET}\")`, "
         "alternating rounds in one process: the measured trace's timed steps skipped (as the library is) against "
         "run (as before 2026-11-29). Medians."),
        "",
        "| model | skipped (s) | run (s) | skipped / run |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {r.model} {r.size} | {r.skipped_median_s:.3f} | {r.run_median_s:.3f} | {r.ratio:.3f} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/results/roofline"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="one tiny model, two rounds; prints, writes nothing")
    args = parser.parse_args()
    torch.set_num_threads(1)  # small models: a second OpenMP thread adds waits, not speed (as in bench_roofline)
    models, rounds = (SMOKE_MODELS, 2) if args.smoke else (MODELS, args.rounds)
    rows = []
    for name, size in models:
        rows.append(measure(name, size, rounds))
        print(rows[-1], flush=True)
    command = ("python -m experiments.bench.bench_target_planning " + " ".join(sys.argv[1:])).strip()
    text = markdown(rows, command)
    if not args.smoke:
        args.out.mkdir(parents=True, exist_ok=True)
        write_csv(args.out / "target_planning.csv", rows)
        write_section("bench_target_planning", text, output=args.out)
    print(text)


if __name__ == "__main__":
    main()
