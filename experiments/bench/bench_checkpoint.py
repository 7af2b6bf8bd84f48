"""Checkpoint kinds: the same plan run through torch's non-reentrant checkpoint and through autockpt's own
(``Action.RECOMPUTE_TORCH`` and ``Action.RECOMPUTE_OWN``).

For each model: a plan made for torch's checkpoint (at Hugging Face's measured peak where the model has HF gradient
checkpointing, else at 0.5 of the way from static memory to the unmodified peak) is applied twice, once with each
checkpoint; both are timed against ``none`` in alternating rounds in one process (median of the per-round ratios),
their peaks measured with MemTracker. Then each kind's own memory floor (its planner's smallest feasible budget).

    python -m experiments.bench.bench_checkpoint                 # gpt2, vit, unet, cnn at size "small"
    python -m experiments.bench.bench_checkpoint --models gpt2 --repeats 21

Writes ``checkpoint_kinds.csv``, ``checkpoint_kinds.md`` and the section ``bench_checkpoint`` of README.md into
``--out`` (default ``experiments/results/checkpoint_kinds``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch

import autockpt
from autockpt.planning.batch_size import ExampleBatch
from autockpt.planning.planner import Planner, baseline_plan
from autockpt.present import zoo
from autockpt.types import Action
from experiments.common import anchors
from experiments.common.results_readme import markdown_table, write_section
from experiments.common.timing import round_robin_ratios


def planner_for(case: zoo.ZooCase, action: Action) -> Planner:
    """A planner that plans (and traces the step) for ``action`` only."""
    return Planner.from_model(case.model, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn,
                   checkpoint=action)


def floor_bytes(planner: Planner) -> int:
    """The smallest feasible budget of ``planner`` (made for one action)."""
    try:
        planner.plan(budget_bytes=1)
    except autockpt.InfeasibleBudgetError as error:
        return error.min_feasible_bytes
    raise AssertionError("a 1-byte budget was accepted")


def bench_model(name: str, size: str, repeats: int) -> dict:
    torch.manual_seed(0)
    case = zoo.build(name, size)
    batch = ExampleBatch(args=case.args, kwargs=case.kwargs, loss_fn=case.loss_fn)
    planner = planner_for(case, Action.RECOMPUTE_TORCH)
    trace = planner.trace
    hf = anchors.hf_gradient_checkpointing(case.model, case.args, case.kwargs, case.loss_fn)
    if hf.module is not None:
        label, budget = "hf_peak", hf.measured_peak_bytes
    else:
        label, budget = "0.50", int(trace.static_bytes + 0.5 * (trace.baseline_peak_bytes - trace.static_bytes))
    torch_plan = planner.plan(budget_bytes=budget)
    # the same regions under autockpt's own recomputation: only the action differs. Its planner traces the step with
    # the gradient lifetimes and prices that action's simulation needs (and gives that action's floor below)
    function_planner = planner_for(case, Action.RECOMPUTE_OWN)
    function_plan = function_planner.plan_for_regions(torch_plan.regions, strategy="given", action=Action.RECOMPUTE_OWN)
    modules = {
        "none": planner.apply(baseline_plan(planner, "none")),
        "torch": planner.apply(torch_plan),
        "function": function_planner.apply(function_plan),
    }
    peaks = {
        k: autockpt.measure_step(modules[k], case.args, case.kwargs, case.loss_fn).peak_bytes for k in ("torch", "function")
    }
    ratios = round_robin_ratios(modules, "none", batch, repeats)
    return {
        "model": name, "budget": label, "budget_bytes": budget, "regions": len(torch_plan.regions),
        "predicted_ratio_torch": 1 + torch_plan.predicted_overhead,
        "ratio_torch": ratios["torch"], "ratio_function": ratios["function"],
        "peak_torch": peaks["torch"], "peak_function": peaks["function"],
        "floor_torch": floor_bytes(planner),
        "floor_function": floor_bytes(function_planner),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,vit,unet,cnn")
    parser.add_argument("--size", default="small", choices=zoo.SIZES)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="experiments/results/checkpoint_kinds")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    rows = [bench_model(name, args.size, args.repeats) for name in args.models.split(",") if name]
    table = pd.DataFrame(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "checkpoint_kinds.csv", index=False)
    text = (f"Command: `python -m experiments.bench.bench_checkpoint {' '.join(sys.argv[1:])}`; "
            f"{time.perf_counter() - started:.0f} s; ratios: median of {args.repeats} alternating rounds vs `none`.\n\n"
            + markdown_table(table) + "\n")
    (out / "checkpoint_kinds.md").write_text(text)
    write_section("bench_checkpoint", text, output=out)
    print(text)


if __name__ == "__main__":
    main()
