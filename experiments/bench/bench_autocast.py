"""Plans made under bf16 autocast: predicted peak against the measured one, and the budget kept (issue 23, item 4).

    python -m experiments.bench.bench_autocast --out experiments/results/autocast

Per model (a 4-layer GPT-NeoX-style decoder, Hugging Face config, random init; the zoo's GPT-2, ViT and BatchNorm
conv net at size "tiny"), inside ``torch.autocast("cpu", dtype=torch.bfloat16)``: a ``Planner`` on the example
inputs, then the plan (``Planner.plan``, nothing measured or tightened) at budgets 30, 50 and 70 % of the way from
the plan's floor (smallest feasible budget) to the unmodified peak, and the identity plan (budget 10**15, nothing
checkpointed). Each plan is rewritten and measured (MemTracker, CPU) three ways: a step in its own autocast context
(as a training loop that enters ``torch.autocast`` per step runs it; the column the error is taken against), the
second of two steps in one context, and a step in the planning context (what ``optimize``'s verification measures).
Kept: all three at most the budget.

``--tag before`` writes ``before.csv``/``before.md`` instead and leaves the README alone: run it with
``PYTHONPATH`` pointing at a checkout of the code to compare (the pre-fix commit), ``PYTHONPATH=/path/to/old:. python
-P -m experiments.bench.bench_autocast --tag before`` (``-P``: the current folder's autockpt does not shadow the old
one); a later plain run puts that table under its own in the ``bench_autocast`` section of the README.md in ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import autockpt
from autockpt.present import zoo
from experiments.common.results_readme import write_csv, write_section

FRACTIONS = (0.3, 0.5, 0.7)  # of the way from the floor to the unmodified peak; 1.0: the identity plan


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    model: str
    capture: str
    budget_fraction: float
    budget_bytes: int
    checkpoint: str
    regions: int
    predicted_peak_bytes: int
    measured_peak_bytes: int  # a step in its own autocast context
    second_step_peak_bytes: int  # the second of two steps in one context
    planning_context_peak_bytes: int  # a step in the planner's context (optimize's verification)
    error_pct: float  # predicted against measured_peak_bytes
    kept: bool
    seconds: float
    code: str  # the commit of the autockpt measured


def bf16() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def neox_case() -> zoo.ZooCase:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=256,
    )
    ids = torch.randint(0, 512, (2, 256))
    return zoo.ZooCase(name="gpt-neox", model=GPTNeoXForCausalLM(config), args=(ids,), kwargs={"labels": ids})


def cases() -> list[zoo.ZooCase]:
    return [neox_case(), *(zoo.build(name, "tiny") for name in ("gpt2", "vit", "cnn"))]


def measured(module: torch.nn.Module, case: zoo.ZooCase) -> tuple[int, int]:
    """Peak of a step in its own autocast context, and of the second of two steps in one context."""
    step = (module, case.args, case.kwargs, case.loss_fn)
    with bf16():
        alone = autockpt.measure_step(*step).peak_bytes
    with bf16():
        autockpt.measure_step(*step)
        second = autockpt.measure_step(*step).peak_bytes
    return alone, second


def code_commit() -> str:
    source = Path(autockpt.__file__).resolve().parent.parent
    found = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return found.stdout.strip() or "unknown"


def run(case: zoo.ZooCase, commit: str) -> list[Row]:
    with bf16():
        planner = autockpt.Planner.from_model(
            case.model, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn
        )
        probe = planner.plan(budget_bytes=10**15)
    floor, top = probe.min_feasible_bytes, probe.baseline_peak_bytes
    rows = []
    for fraction in (*FRACTIONS, 1.0):
        started = time.perf_counter()
        budget = int(floor + fraction * (top - floor)) if fraction < 1 else 10**15
        with bf16():
            plan = planner.plan(budget_bytes=budget) if fraction < 1 else probe
            module = planner.apply(plan)
            in_planning_context = planner.measured_peak_bytes(module)
        alone, second = measured(module, case)
        rows.append(
            Row(
                model=case.name, capture=plan.capture.value, budget_fraction=fraction, budget_bytes=budget,
                checkpoint=plan.planned_action.value if plan.regions else "-", regions=len(plan.regions),
                predicted_peak_bytes=plan.predicted_peak_bytes, measured_peak_bytes=alone,
                second_step_peak_bytes=second, planning_context_peak_bytes=in_planning_context,
                error_pct=round(100 * (plan.predicted_peak_bytes - alone) / alone, 3),
                kept=max(alone, second, in_planning_context) <= budget,
                seconds=round(time.perf_counter() - started, 1), code=commit,
            )
        )
        print(rows[-1], flush=True)
    return rows


def table(rows: list[Row]) -> list[str]:
    lines = [
        (
            "| model | budget fraction | budget (bytes) | checkpoint, regions | predicted peak | measured peak | "
            "error % | 2nd step in one context | in the planning context | kept |"
        ),
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        fraction = "identity" if r.budget_fraction >= 1 else f"{r.budget_fraction:.1f}"
        budget = "-" if r.budget_fraction >= 1 else str(r.budget_bytes)
        lines.append(
            f"| {r.model} ({r.capture}) | {fraction} | {budget} | {r.checkpoint}, {r.regions} | "
            f"{r.predicted_peak_bytes} | {r.measured_peak_bytes} | {r.error_pct:+.2f} | {r.second_step_peak_bytes} | "
            f"{r.planning_context_peak_bytes} | {'yes' if r.kept else 'no'} |"
        )
    return lines


def summary(rows: list[Row]) -> str:
    planned = [r for r in rows if r.budget_fraction < 1]
    worst = max(abs(r.error_pct) for r in rows)
    worst_any = max(
        abs(r.predicted_peak_bytes - m) / m * 100
        for r in rows for m in (r.measured_peak_bytes, r.second_step_peak_bytes, r.planning_context_peak_bytes)
    )
    kept = sum(r.kept for r in planned)
    return (
        f"largest |error| {worst:.2f} % over {len(rows)} plans ({worst_any:.2f} % against any of the three "
        f"measurements); budgets kept in all three measurements by {kept} of {len(planned)} plans"
    )


def read_rows(path: Path) -> list[Row]:
    types = {name: field.type for name, field in Row.__dataclass_fields__.items()}
    convert = {"int": int, "float": float, "str": str, "bool": lambda text: text == "True"}
    with open(path, newline="") as handle:
        return [Row(**{k: convert[types[k]](v) for k, v in record.items()}) for record in csv.DictReader(handle)]


def markdown(rows: list[Row], before: list[Row] | None) -> str:
    lines = [
        (
            "`python -m experiments.bench.bench_autocast --out experiments/results/autocast` (CPU, 2 cores, torch "
            f"{torch.__version__}, MemTracker; autockpt at {rows[0].code}): plans made inside "
            '`torch.autocast("cpu", dtype=torch.bfloat16)` by `Planner.plan` (not tightened by a measurement), at '
            "30/50/70 % of the way from the plan's floor to the unmodified peak, and the identity plan. Measured "
            "peak: a step in its own autocast context; also the second of two steps in one context and a step in "
            "the planning context (what `optimize` verifies). Error = (predicted - measured) / measured."
        ),
        "",
        f"This run: {summary(rows)}.",
        "",
        *table(rows),
    ]
    if before:
        lines += [
            "",
            (
                f"Before (the same script on autockpt at {before[0].code}, `--tag before`: the trace reused "
                "autocast's cached weight copies from earlier steps, and the simulator counted them as recomputed "
                f"and freed by checkpointing): {summary(before)}. The floors, hence the budgets, differ from the "
                "run above."
            ),
            "",
            *table(before),
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/results/autocast"))
    parser.add_argument("--models", nargs="*", help="model names to run; default: all")
    parser.add_argument("--tag", default="autocast", help="file names; 'before' leaves the README alone")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    commit = code_commit()
    rows = [row for case in cases() if not args.models or case.name in args.models for row in run(case, commit)]

    write_csv(args.out / f"{args.tag}.csv", rows)
    before_csv = args.out / "before.csv"
    before = read_rows(before_csv) if args.tag != "before" and before_csv.exists() else None
    text = markdown(rows, before)
    (args.out / f"{args.tag}.md").write_text(text + "\n")
    if args.tag != "before":
        write_section("bench_autocast", text, output=args.out)
    print(text)


if __name__ == "__main__":
    main()
