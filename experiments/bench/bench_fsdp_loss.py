"""The FSDP2 root unit's loss in chunks (issue 48, item 5): ``plan_fsdp`` with the root's head and cross-entropy
weighed in chunks (``loss_chunk_tokens="auto"``) against the loss as the model computes it (``0``), on two gloo
ranks on CPU.

    python -m experiments.bench.bench_fsdp_loss --out experiments/results/fsdp

Model (``experiments/common/pipeline_worker.py``'s ``Decoder``, no dropout): 4 layers of width 64, an untied head
over a vocabulary of 32768; world 2, 2 x 256 tokens per rank (one rank's float32 logits: 67 MB), the loss a
torchtitan-style ``loss_fn`` on the returned logits (``fsdp_worker.lm_loss``), AdamW. Plans: the unchunked setting at
its floor (every unit checkpointed whole), the chunked setting at that budget and at its own floor. Each plan's
peak is measured on both ranks with ``FSDPMemTracker`` on real tensors (two AdamW steps, ``fsdp_worker.time_alternating``)
against the prediction; then the plans are stepped in turn for ``ROUNDS`` rounds in one process group (a step's time
is the slower rank's; the median is reported). Losses and gradients against the single-process model are checked by
``tests/fsdp/test_fsdp_gloo.py`` (case ``loss-in-chunks``). Nothing is typed in by hand: ``fsdp_loss.csv`` and the
section ``bench_fsdp_loss`` of the README.md in ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

import autockpt
from autockpt.errors import InfeasibleBudgetError
from autockpt.fsdp import FSDPPlan
from experiments.common.fsdp_worker import batch, build, lm_loss, time_alternating
from experiments.common.results_readme import write_csv, write_section

CONFIG = {"seed": 0, "model": {"vocab": 32768, "width": 64, "layers": 4}, "batch": 2, "seq": 256, "rounds": 7}
WORLD = 2


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    plan: str
    budget_bytes: int
    loss_chunk_tokens: int
    checkpointed_units: int
    selective_units: int
    predicted_peak_bytes: int
    measured_peak_bytes: str  # FSDPMemTracker on real tensors, per rank
    predicted_step_ms: float
    measured_step_ms: float
    plan_time_s: float


def planned(budget: int | None, chunks: int | str) -> tuple[FSDPPlan | InfeasibleBudgetError, float]:
    ids, target = batch(CONFIG, rank=0, world=WORLD)
    started = time.perf_counter()
    try:
        found: FSDPPlan | InfeasibleBudgetError = autockpt.plan_fsdp(
            build(CONFIG), world_size=WORLD, budget_bytes=budget or 1, example_inputs=(ids,), example_target=target,
            loss_fn=lm_loss, optimizer="adamw", loss_chunk_tokens=chunks,
        )
    except InfeasibleBudgetError as refused:
        found = refused
    return found, time.perf_counter() - started


def alternating(plans: list[FSDPPlan]) -> list[dict]:
    """Per plan: each rank's measured peak and the median step (the slower rank's)."""
    with tempfile.TemporaryDirectory() as folder:
        paths = []
        for index, fplan in enumerate(plans):
            paths.append(str(Path(folder) / f"plan{index}.json"))
            fplan.save(paths[-1])
        mp.spawn(time_alternating, args=(WORLD, CONFIG, paths, folder, str(Path(folder) / "init")), nprocs=WORLD,
                 join=True)
        ranks = [pickle.loads((Path(folder) / f"alternating{r}.pkl").read_bytes()) for r in range(WORLD)]
    return [{"peaks": [rank["peaks"][index] for rank in ranks],
             "step_ms": 1000 * statistics.median(max(times) for times in zip(*(r["seconds"][index] for r in ranks)))}
            for index in range(len(plans))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/results/fsdp"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    refused_alone, _ = planned(None, 0)
    refused_chunked, _ = planned(None, "auto")
    assert isinstance(refused_alone, InfeasibleBudgetError) and isinstance(refused_chunked, InfeasibleBudgetError)
    floor_alone, floor_chunked = refused_alone.min_feasible_bytes, refused_chunked.min_feasible_bytes
    cases = {"unchunked, its floor": (floor_alone, 0), "chunked, the unchunked floor": (floor_alone, "auto"),
             "chunked, its floor": (floor_chunked, "auto")}
    plans, times = {}, {}
    for name, (budget, chunks) in cases.items():
        found, seconds = planned(budget, chunks)
        assert isinstance(found, FSDPPlan), found
        plans[name], times[name] = found, seconds
    measured = dict(zip(plans, alternating(list(plans.values()))))
    rows = [Row(plan=name, budget_bytes=fplan.budget_bytes, loss_chunk_tokens=fplan.loss_chunk_tokens,
                checkpointed_units=len(fplan.checkpointed), selective_units=len(fplan.selective),
                predicted_peak_bytes=fplan.predicted_peak_bytes,
                measured_peak_bytes=" ".join(map(str, measured[name]["peaks"])),
                predicted_step_ms=round(fplan.predicted_step_ms, 2), measured_step_ms=round(measured[name]["step_ms"], 2),
                plan_time_s=round(times[name], 1))
            for name, fplan in plans.items()]
    for row in rows:
        print(row, flush=True)
    write_csv(args.out / "fsdp_loss.csv", rows)
    by = {row.plan: row for row in rows}
    alone, same, low = (by[name] for name in cases)
    lines = [
        (f"Decoder of 4 layers, width 64, vocabulary {CONFIG['model']['vocab']} (untied head), world {WORLD}, "
         f"{CONFIG['batch']} x {CONFIG['seq']} tokens per rank, loss_fn on the returned logits, AdamW; CPU, one gloo "
         "rank per core. Measured peak: FSDPMemTracker on real tensors over two steps, per rank; step: median over "
         f"{CONFIG['rounds']} rounds of the slower rank, the plans stepped in turn in one process group. "
         f"`python -m experiments.bench.bench_fsdp_loss --out {args.out}`"),
        "",
        (f"- smallest per-rank budget: {floor_alone} B with the loss as the model computes it, {floor_chunked} B with "
         f"the root's head and cross-entropy in chunks ({100 * (floor_chunked / floor_alone - 1):+.1f} %)"),
        (f"- at {floor_alone} B: step {alone.measured_step_ms:.1f} ms unchunked, {same.measured_step_ms:.1f} ms "
         f"chunked ({same.measured_step_ms / alone.measured_step_ms:.2f}x); at its own floor "
         f"{low.measured_step_ms:.1f} ms ({low.measured_step_ms / alone.measured_step_ms:.2f}x)"),
        "",
        ("| plan | budget (B) | chunk (tokens) | units checkpointed | selective | predicted peak (B) | measured peaks "
         "(B) | predicted step (ms) | measured step (ms) | plan (s) |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.plan} | {r.budget_bytes} | {r.loss_chunk_tokens} | {r.checkpointed_units} | {r.selective_units} | "
        f"{r.predicted_peak_bytes} | {r.measured_peak_bytes} | {r.predicted_step_ms} | {r.measured_step_ms} | "
        f"{r.plan_time_s} |" for r in rows
    ]
    text = "\n".join(lines)
    print(text)
    write_section("bench_fsdp_loss", text, output=args.out)


if __name__ == "__main__":
    main()
