"""Pipeline splits at equal per-device budgets: autockpt's split against even-by-layers, parameter-balanced and the
exhaustive best, each given its best per-stage recompute plan by the same solver.

    python -m experiments.bench.bench_pipeline --out experiments/results/pipeline

Models (``experiments/common/pipeline_worker.py``, no dropout): a GPT-2-style decoder (learned positions, LayerNorm, GELU MLP,
untied head) and a Llama-style one (RMSNorm, rotary positions computed once and passed to every layer, SwiGLU, no
biases), both 6 layers of width 64 with a vocabulary of 8192: the head's logits make the last stage heavy in time
and memory. 1F1B, 4 microbatches of 2 x 32 tokens, outputs not returned; 2, 3 and 4 stages.

Budgets per (model, stages), both from ``InfeasibleBudgetError``'s stated minimums: "tight" half-way between the
smallest budget any split keeps and the smallest the even split keeps (when they differ), and "equal" 5 % above the
smallest budget every strategy keeps: the budget at which the step times are compared.

All strategies are planned on one profile of the step (``autockpt.compare_pipeline_splits``: one capture, one timing,
one planner per candidate stage), so their predictions share one cost model; plan time is that call's. Per strategy:
predicted max stage peak and step time, and a real run of
one gloo rank per stage on CPU (``experiments/common/pipeline_worker.py``): measured peaks (autockpt's StorageTracker on the
first two steps, torch's MemTracker on a third) and, with 2 ranks only, the median step time of the slower rank over
15 rounds in which the feasible plans are stepped in turn in one process group (``time_alternating``; more ranks
than this machine's 2 cores would measure contention). Step times are compared as ratios within one
run; nothing is typed in by hand: ``pipeline.csv`` and the section ``bench_pipeline`` of the README.md in ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

import autockpt
from autockpt.errors import InfeasibleBudgetError
from experiments.common.pipeline_worker import build, lm_loss, run_rank, time_alternating  # the tests' rank worker
from experiments.common.results_readme import write_csv, write_section

MODELS = {
    "gpt2-style": {"kind": "gpt2", "model": {"vocab": 8192, "width": 64, "layers": 6}},
    "llama-style": {"kind": "llama", "model": {"vocab": 8192, "width": 64, "layers": 6}},
}
STRATEGIES = ("autockpt", "exhaustive", "even-layers", "parameter-balanced")
MICROBATCHES = 4
ROUNDS = 15  # alternating timed steps per plan


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    model: str
    stages: int
    budget_kind: str
    budget_bytes: int
    strategy: str
    cuts: str
    plan_s: float
    predicted_max_peak_bytes: int | None
    measured_max_peak_bytes: int | None  # the larger of StorageTracker's and MemTracker's, over all ranks
    memtracker_max_peak_bytes: int | None
    predicted_step_ms: float | None
    measured_step_ms: float | None  # 2 ranks only
    recomputed_regions: int | None
    note: str = ""


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 8192, (8, 32), generator=generator), torch.randint(0, 8192, (8, 32), generator=generator)


def config_of(model: str) -> dict:
    return {"seed": 0, **MODELS[model], "steps": 2, "rounds": ROUNDS, "return_outputs": False}


def plans(model: str, stages: int, budget: int) -> tuple[dict[str, autockpt.PipelinePlan | InfeasibleBudgetError], float]:
    """Every strategy on one profile of the step (one cost model), and how long planning took."""
    ids, target = batch()
    started = time.perf_counter()
    found = autockpt.compare_pipeline_splits(
        build(config_of(model)), stages, budget_bytes=budget, splits=STRATEGIES, microbatches=MICROBATCHES,
        example_inputs=(ids,), example_target=target, loss_fn=lm_loss, return_outputs=False,
    )
    return found, time.perf_counter() - started


def run(pplan: autockpt.PipelinePlan, config: dict, tensors: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[dict]:
    """Every rank's result (``pipeline_worker.run_rank``) of ``pplan`` stepped on ``tensors`` (ids, target; default:
    ``batch()``)."""
    with tempfile.TemporaryDirectory() as folder:
        ids, target = tensors or batch()
        pplan.save(Path(folder) / "plan.json")
        torch.save({"ids": ids, "target": target}, Path(folder) / "batch.pt")
        world = pplan.num_stages
        mp.spawn(run_rank, args=(world, config, str(Path(folder) / "plan.json"), folder, str(Path(folder) / "init")),
                 nprocs=world, join=True)
        return [pickle.loads((Path(folder) / f"rank{r}.pkl").read_bytes()) for r in range(world)]


def alternating_step_ms(pplans: list[autockpt.PipelinePlan], config: dict,
                        tensors: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[float]:
    """Median step time of each plan, the plans stepped in turn in one process group (2 ranks)."""
    with tempfile.TemporaryDirectory() as folder:
        ids, target = tensors or batch()
        torch.save({"ids": ids, "target": target}, Path(folder) / "batch.pt")
        paths = []
        for index, pplan in enumerate(pplans):
            paths.append(str(Path(folder) / f"plan{index}.json"))
            pplan.save(paths[-1])
        mp.spawn(time_alternating, args=(2, config, paths, folder, str(Path(folder) / "init")), nprocs=2, join=True)
        seconds = pickle.loads((Path(folder) / "alternating.pkl").read_bytes())
    return [1000 * statistics.median(times) for times in seconds]


def measure(model: str, stages: int, budget_kind: str, budget: int) -> list[Row]:
    found, plan_s = plans(model, stages, budget)
    feasible = [name for name in STRATEGIES if not isinstance(found[name], InfeasibleBudgetError)]
    step_ms = dict(zip(feasible, alternating_step_ms([found[n] for n in feasible], config_of(model)))) \
        if stages == 2 else {}
    rows = []
    for strategy in STRATEGIES:
        common = {"model": model, "stages": stages, "budget_kind": budget_kind, "budget_bytes": budget,
                  "strategy": strategy, "plan_s": round(plan_s, 1)}
        pplan = found[strategy]
        if isinstance(pplan, InfeasibleBudgetError):
            rows.append(Row(**common, cuts="-", predicted_max_peak_bytes=None, measured_max_peak_bytes=None,
                            memtracker_max_peak_bytes=None, predicted_step_ms=None, measured_step_ms=None,
                            recomputed_regions=None, note=f"infeasible: needs {pplan.min_feasible_bytes} B"))
            continue
        results = run(pplan, config_of(model))
        rows.append(Row(
            **common, cuts=" ".join(map(str, pplan.cuts)),
            predicted_max_peak_bytes=max(s.predicted_peak_bytes for s in pplan.stages),
            measured_max_peak_bytes=max(max(*r["peaks"], r["memtracker_peak"]) for r in results),
            memtracker_max_peak_bytes=max(r["memtracker_peak"] for r in results),
            predicted_step_ms=round(pplan.predicted_step_ms, 3),
            measured_step_ms=round(step_ms[strategy], 3) if strategy in step_ms else None,
            recomputed_regions=sum(len(p.regions) for p in pplan.stage_plans),
        ))
        print(rows[-1], flush=True)
    return rows


def budgets(model: str, stages: int) -> dict[str, int]:
    """From the smallest budget each strategy keeps (``InfeasibleBudgetError`` at 1 byte)."""
    floors = {name: error.min_feasible_bytes for name, error in plans(model, stages, 1)[0].items()
              if isinstance(error, InfeasibleBudgetError)}
    chosen = {"equal": int(1.05 * max(floors.values()))}
    if floors["even-layers"] > floors["autockpt"]:
        chosen["tight"] = (floors["autockpt"] + floors["even-layers"]) // 2
    return chosen


def verdicts(rows: list[Row]) -> list[str]:
    """Per (model, stages, budget): autockpt against the exhaustive best and the even split, from the rows."""
    lines = []
    groups = sorted({(r.model, r.stages, r.budget_kind) for r in rows})
    for model, stages, kind in groups:
        by = {r.strategy: r for r in rows if (r.model, r.stages, r.budget_kind) == (model, stages, kind)}
        auto, best, even = by["autockpt"], by["exhaustive"], by["even-layers"]
        parts = [f"{model}, {stages} stages, {kind} budget {auto.budget_bytes} B:"]
        if auto.predicted_step_ms is not None and best.predicted_step_ms is not None:
            parts.append(f"autockpt/exhaustive predicted step {auto.predicted_step_ms / best.predicted_step_ms:.3f}")
        if auto.measured_max_peak_bytes is not None:
            parts.append(f"measured max peak {'<=' if auto.measured_max_peak_bytes <= auto.budget_bytes else '>'} "
                         "budget")
        if even.predicted_step_ms is None:
            parts.append("even split infeasible")
        elif auto.predicted_step_ms is not None:
            parts.append(f"even/autockpt predicted step {even.predicted_step_ms / auto.predicted_step_ms:.2f}x")
            if auto.measured_step_ms and even.measured_step_ms:
                parts.append(f"measured {even.measured_step_ms / auto.measured_step_ms:.2f}x")
        lines.append("- " + ", ".join(parts))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/results/pipeline"))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 3, 4])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models:
        for stages in args.stages:
            for kind, budget in budgets(model, stages).items():
                rows.extend(measure(model, stages, kind, budget))
    write_csv(args.out / "pipeline.csv", rows)
    lines = [
        (f"6-layer decoders of width 64, vocabulary 8192 (untied head), 1F1B, {MICROBATCHES} microbatches of 2 x 32 "
         "tokens, outputs not returned; CPU, one gloo rank per stage. Budgets per device: `tight` half-way between "
         "the smallest any split keeps and the smallest the even split keeps, `equal` 5 % above the smallest every "
         "strategy keeps. Measured peak: the largest over ranks of autockpt's StorageTracker (steps 1-2) and torch's "
         f"MemTracker (step 3); measured step: median over {ROUNDS} rounds of the slower rank, the plans stepped in turn "
         "in one process group, 2 stages only. "
         f"`python -m experiments.bench.bench_pipeline --out {args.out}`"),
        "",
        *verdicts(rows),
        "",
        ("| model | stages | budget | split | cuts after unit | plan (s) | predicted max stage peak (B) | measured max "
         "stage peak (B) | predicted step (ms) | measured step (ms) | recomputed regions | note |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.model} | {r.stages} | {r.budget_kind} {r.budget_bytes} | {r.strategy} | {r.cuts} | {r.plan_s} | "
        f"{r.predicted_max_peak_bytes} | {r.measured_max_peak_bytes} | {r.predicted_step_ms} | {r.measured_step_ms} "
        f"| {r.recomputed_regions} | {r.note} |" for r in rows
    ]
    text = "\n".join(lines)
    print(text)
    write_section("bench_pipeline", text, output=args.out)


if __name__ == "__main__":
    main()
