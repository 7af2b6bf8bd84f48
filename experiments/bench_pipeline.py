"""Pipeline splits at equal per-device budgets: autockpt's split against even-by-layers, parameter-balanced and the
exhaustive best, each given its best per-stage recompute plan by the same solver.

    python experiments/bench_pipeline.py --out experiments/results/pipeline

Model: a decoder with a large vocabulary head (embedding, 6 blocks, norm, untied head of vocab 8192 at width 64:
the head's logits make the last stage heavy), 2 stages, 1F1B, 4 microbatches of 2 x 32 tokens, outputs not
returned. Budget: half-way between the smallest per-device budget any split keeps and the smallest the even split
keeps (both as ``InfeasibleBudgetError`` states them). Per strategy: predicted max stage peak and step time, then a real run of
2 gloo ranks on CPU (``tests/pipeline_worker.py``: autockpt's StorageTracker per rank around ``schedule.step``,
MemTracker cannot run inside a pipelining step) with measured peaks and the median step time over 6 timed steps.
Step times are ratios within this run (2 ranks on a 2-core machine); nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the rank worker the tests use
from pipeline_worker import build, lm_loss, run_rank

import autockpt
from autockpt.errors import InfeasibleBudgetError

CONFIG = {"seed": 0, "model": {"vocab": 8192, "width": 64, "layers": 6, "tied": False}, "steps": 2, "timed_steps": 6,
          "return_outputs": False}
MICROBATCHES = 4


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    strategy: str
    cuts: str
    budget_bytes: int
    predicted_max_peak_bytes: int | None
    measured_max_peak_bytes: int | None
    predicted_step_ms: float | None
    measured_step_ms: float | None
    recomputed_regions: int | None
    note: str = ""


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    vocab = CONFIG["model"]["vocab"]
    return torch.randint(0, vocab, (8, 32), generator=generator), torch.randint(0, vocab, (8, 32), generator=generator)


def plan(budget: int, split: str) -> autockpt.PipelinePlan:
    ids, target = batch()
    return autockpt.plan_pipeline(
        build(CONFIG), 2, budget_bytes=budget, microbatches=MICROBATCHES, example_inputs=(ids,),
        example_target=target, loss_fn=lm_loss, split=split, return_outputs=False,
    )


def run(pplan: autockpt.PipelinePlan) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        ids, target = batch()
        pplan.save(Path(folder) / "plan.json")
        torch.save({"ids": ids, "target": target}, Path(folder) / "batch.pt")
        mp.spawn(run_rank, args=(2, CONFIG, str(Path(folder) / "plan.json"), folder, str(Path(folder) / "init")),
                 nprocs=2, join=True)
        return [pickle.loads((Path(folder) / f"rank{r}.pkl").read_bytes()) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/results/pipeline"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        plan(1, "autockpt")
        raise SystemExit("a 1-byte budget was planned")
    except InfeasibleBudgetError as error:
        floor = error.min_feasible_bytes
    try:
        plan(1, "even-layers")
        raise SystemExit("a 1-byte budget was planned")
    except InfeasibleBudgetError as error:
        even_floor = error.min_feasible_bytes
    budget = (floor + even_floor) // 2  # below what the even split can keep at all
    rows = []
    for strategy in ("autockpt", "exhaustive", "even-layers", "parameter-balanced"):
        try:
            pplan = plan(budget, strategy)
        except InfeasibleBudgetError as error:
            rows.append(Row(strategy=strategy, cuts="-", budget_bytes=budget, predicted_max_peak_bytes=None,
                            measured_max_peak_bytes=None, predicted_step_ms=None, measured_step_ms=None,
                            recomputed_regions=None, note=f"infeasible: needs {error.min_feasible_bytes} bytes"))
            continue
        results = run(pplan)
        timed = [r["seconds"][CONFIG["steps"]:] for r in results]
        rows.append(Row(
            strategy=strategy, cuts=" ".join(map(str, pplan.cuts)), budget_bytes=budget,
            predicted_max_peak_bytes=max(s.predicted_peak_bytes for s in pplan.stages),
            measured_max_peak_bytes=max(max(r["peaks"]) for r in results),
            predicted_step_ms=round(pplan.predicted_step_ms, 3),
            measured_step_ms=round(1000 * statistics.median(max(pair) for pair in zip(*timed)), 3),
            recomputed_regions=sum(len(p.regions) for p in pplan.stage_plans),
        ))
        print(rows[-1], flush=True)
    from results_readme import write_csv, write_section

    write_csv(args.out / "pipeline.csv", rows)
    lines = [
        f"Decoder (vocab {CONFIG['model']['vocab']}, width {CONFIG['model']['width']}, {CONFIG['model']['layers']} "
        f"blocks, untied head), 2 stages, 1F1B, {MICROBATCHES} microbatches, CPU, 2 gloo ranks; budget per device "
        f"{budget} B (smallest any split keeps: {floor} B; the even split: {even_floor} B); schedule.step(return_outputs=False). `python experiments/bench_pipeline.py --out {args.out}`",
        "",
        "| split | cuts after unit | predicted max stage peak (B) | measured max stage peak (B) | predicted step (ms) "
        "| measured step (ms, median of 6) | recomputed regions | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.strategy} | {r.cuts} | {r.predicted_max_peak_bytes} | {r.measured_max_peak_bytes} | "
        f"{r.predicted_step_ms} | {r.measured_step_ms} | {r.recomputed_regions} | {r.note} |" for r in rows
    ]
    text = "\n".join(lines)
    print(text)
    write_section("bench_pipeline", text, output=args.out)


if __name__ == "__main__":
    main()
