"""How far can a region plan get at Hugging Face's memory? A lower bound for the sweep's Target 1.

Target 1 of the sweep asks for at most half of Hugging Face's step-time overhead at the peak Hugging Face's own
gradient checkpointing measures. This script asks what the cost model says is reachable there at all, on the same
models: for each model with an ``hf_peak`` row in the sweep's CSV (the budget and HF's measured overhead are read from
it, not typed in), it profiles the model once and solves that budget

* as autockpt does (torch's checkpoint and autockpt's own, each with its calibrated machinery), and
* with the checkpoint machinery priced at zero, for both checkpoint kinds: the least kernel time any plan of
  checkpointed regions must re-run to fit (the solver is within 1 % of the exact optimum on every small graph of
  ``bench_optimality``), and
* for ``every_1``, the plan Hugging Face's policy corresponds to (every repeated block checkpointed),

all as shares of the profiled unmodified step. ``bound_vs_every_1`` is the least re-run over what ``every_1``
re-runs: if Hugging Face's measured overhead were its re-run alone, no region plan could cost less than that share of
it. A target of 0.5 is then out of reach by recomputation wherever that share is above 0.5.

    python -m experiments.bench.bench_target1_bound                            # the models of sweep.csv
    python -m experiments.bench.bench_target1_bound --sweep experiments/results/sweep/sweep.csv --models gpt2

Writes ``target1_bound.csv``, ``target1_bound.md`` and the section ``bench_target1_bound`` of README.md into the folder
``--out`` (default ``experiments/results/target1_bound``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch

from autockpt.core.solve.base import SolveResult
from autockpt.core.solve.baselines import baseline_seed_plans
from autockpt.core.solve.candidates import candidate_regions
from autockpt.core.solve.default import solve_prepared
from autockpt.core.solve.prepare import prepare
from autockpt.core.structure import find_repeated_blocks
from autockpt.measure.costs import free_machinery
from autockpt.planning.planner import Planner, baseline_plan
from autockpt.present import zoo
from autockpt.types import Action
from experiments.common.results_readme import markdown_table, write_section

KINDS = (Action.RECOMPUTE_TORCH, Action.RECOMPUTE_OWN)


def measured_at_hf_peak(sweep: pd.DataFrame, model: str) -> dict[str, float]:
    """The sweep's hf_peak budget and the measured step-time ratios of HF and of autockpt's default there."""
    rows = sweep[(sweep.model == model) & (sweep.budget == "hf_peak") & (sweep.status == "measured")]
    ratio = rows.set_index("strategy").step_time_ratio
    return {
        "budget_bytes": int(rows.budget_bytes.iloc[0]),
        "hf_overhead": float(ratio["hf_gradient_checkpointing"] - 1),
        "autockpt_overhead": float(ratio["autockpt"] - 1),
    }


def solved(planner: Planner, kind: Action, budget: int, *, machinery_free: bool) -> SolveResult:
    """The cheapest plan under ``budget`` for ``kind``, from the planner's own trace, prices and candidates, solved as
    the planner solves them; ``machinery_free`` prices the checkpoint machinery at zero, so only re-run kernels
    count."""
    trace = planner.trace
    costs = free_machinery(planner.costs) if machinery_free else planner.costs
    problem = prepare(
        trace, costs, kind, *candidate_regions(planner.graph, trace),
        seed_plans=baseline_seed_plans(planner.graph, trace), structure=find_repeated_blocks(planner.graph, trace),
    )
    return solve_prepared(problem, budget)


def bound_row(model: str, size: str, measured: dict[str, float]) -> dict:
    torch.manual_seed(0)
    case = zoo.build(model, size)
    budget = measured["budget_bytes"]
    planner = Planner.from_model(case.model, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn)
    step_ms = planner.trace.step_ms
    every_1 = baseline_plan(planner, "every_1")  # scored for torch's checkpoint, like HF's non-reentrant one
    planned = {kind: solved(planner, kind, budget, machinery_free=False).timeline for kind in KINDS}
    machinery_free = {kind: solved(planner, kind, budget, machinery_free=True).timeline.recompute_ms for kind in KINDS}
    least = min(machinery_free.values())
    return {
        "model": model,
        "hf_peak_bytes": budget,
        "profiled_step_ms": step_ms,
        "every_1_rerun": every_1.recompute_ms / step_ms,
        "every_1_predicted_overhead": every_1.predicted_overhead,
        "hf_measured_overhead": measured["hf_overhead"],
        **{
            f"autockpt_{kind.value}_predicted_overhead": timeline.overhead_ms / step_ms
            for kind, timeline in planned.items()
        },
        "autockpt_measured_overhead": measured["autockpt_overhead"],
        "least_rerun_torch": machinery_free[Action.RECOMPUTE_TORCH] / step_ms,
        "least_rerun_function": machinery_free[Action.RECOMPUTE_OWN] / step_ms,
        "bound_vs_every_1": least / every_1.recompute_ms,
        "target_overhead": measured["hf_overhead"] / 2,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", default="experiments/results/sweep/sweep.csv", help="the sweep's tidy CSV")
    parser.add_argument("--models", default="", help="comma-separated (default: every model with an hf_peak row)")
    parser.add_argument("--size", default="small", choices=zoo.SIZES, help="the size the sweep ran")
    parser.add_argument("--out", default="experiments/results/target1_bound")
    args = parser.parse_args()
    sweep = pd.read_csv(args.sweep, dtype={"budget": str})
    models = [m for m in args.models.split(",") if m] or sorted(sweep[sweep.budget == "hf_peak"].model.unique())
    table = pd.DataFrame([bound_row(model, args.size, measured_at_hf_peak(sweep, model)) for model in models])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "target1_bound.csv", index=False)
    (out / "target1_bound.md").write_text(markdown_table(table) + "\n")
    write_section("bench_target1_bound", markdown_table(table), output=out)
    print(markdown_table(table))


if __name__ == "__main__":
    main()
