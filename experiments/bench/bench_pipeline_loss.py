"""The last pipeline stage's loss in chunks (issue 48, item 5): a 2-stage plan whose last stage is planned with its
``loss_fn`` (the planner may chunk the loss) against the same model planned with ``loss_chunk_tokens=0`` (the last
stage alone, returning the full logits, as before).

    python -m experiments.bench.bench_pipeline_loss --out experiments/results/pipeline

Model (``experiments/common/pipeline_worker.py``'s ``Decoder``, no dropout): 4 layers of width 64, an untied head
over a vocabulary of 32768; 1F1B, 4 microbatches of 2 x 128 tokens (one microbatch's float32 logits: 33.6 MB);
outputs not returned. Per setting: the smallest budget a split keeps (``InfeasibleBudgetError``), the plan at that
budget and at the unchunked setting's floor (a budget both keep), each run on one gloo rank per stage on CPU
(``pipeline_worker.run_rank``): measured peaks (autockpt's StorageTracker on the first two steps, torch's MemTracker
on a third) against the predictions, and the mean microbatch loss and every gradient against the single-process
model's. The three distinct plans' step times: the median over ``ROUNDS`` rounds of the slower rank, the plans
stepped in turn in one process group (``time_alternating``). Nothing is typed in by hand: ``pipeline_loss.csv``
and the section ``bench_pipeline_loss`` of the README.md in ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

import autockpt
from autockpt.errors import InfeasibleBudgetError
from autockpt.pipeline import PipelinePlanner
from experiments.bench.bench_pipeline import alternating_step_ms, run
from experiments.common.pipeline_worker import build, lm_loss
from experiments.common.results_readme import write_csv, write_section

CONFIG = {"seed": 0, "model": {"vocab": 32768, "width": 64, "layers": 4}, "steps": 2, "return_outputs": False}
BATCH_ROWS, SEQUENCE = 8, 128
MICROBATCHES = 4
ROUNDS = 9
CHUNK_AUTO, CHUNK_OFF = "planned with its loss (auto)", "last stage alone (loss_chunk_tokens=0)"
SETTINGS = {CHUNK_AUTO: "auto", CHUNK_OFF: 0}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    setting: str
    budget_kind: str  # "own floor" or "shared" (the unchunked setting's floor)
    budget_bytes: int
    plan_s: float
    cuts: str
    last_stage_with_loss: bool
    last_stage_chunk_tokens: int
    predicted_peaks_bytes: str  # per stage
    measured_peaks_bytes: str  # per stage: the larger of StorageTracker's and MemTracker's
    max_over_prediction_bytes: int  # measured minus predicted, the largest over stages
    loss_error: float  # |mean microbatch loss - single-process loss|
    max_gradient_error: float
    measured_step_ms: float  # the plans stepped in turn in one process group


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    vocab = CONFIG["model"]["vocab"]
    shape = (BATCH_ROWS, SEQUENCE)
    return torch.randint(0, vocab, shape, generator=generator), torch.randint(0, vocab, shape, generator=generator)


def reference() -> tuple[float, dict[str, torch.Tensor]]:
    """The single-process model's loss and gradients on the whole batch (the mean over microbatches of equal size)."""
    model = build(CONFIG)
    ids, target = batch()
    loss = lm_loss(model(ids), target)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def planner(chunk: str | int) -> tuple[PipelinePlanner, float]:
    ids, target = batch()
    started = time.perf_counter()
    found = PipelinePlanner.from_model(
        build(CONFIG), 2, microbatches=MICROBATCHES, example_inputs=(ids,), example_target=target, loss_fn=lm_loss,
        return_outputs=False, loss_chunk_tokens=chunk,
    )
    return found, time.perf_counter() - started


def floor_of(found: PipelinePlanner) -> int:
    try:
        found.plan(budget_bytes=1)
    except InfeasibleBudgetError as refused:
        return refused.min_feasible_bytes
    raise AssertionError("a budget of 1 byte was kept")


def row(setting: str, kind: str, budget: int, plan_s: float, pplan: autockpt.PipelinePlan,
        expected: tuple[float, dict[str, torch.Tensor]], step_ms: float) -> Row:
    results = run(pplan, CONFIG, batch())
    loss, grads = expected
    measured = [max(*r["peaks"], r["memtracker_peak"]) for r in results]
    gradient_errors = [(g - grads[name]).abs().max().item() for r in results for name, g in r["grads"].items()]
    return Row(
        setting=setting, budget_kind=kind, budget_bytes=budget, plan_s=round(plan_s, 1),
        cuts=" ".join(map(str, pplan.cuts)), last_stage_with_loss=pplan.stages[-1].with_loss,
        last_stage_chunk_tokens=pplan.stage_plans[-1].loss_chunk_tokens,
        predicted_peaks_bytes=" ".join(str(s.predicted_peak_bytes) for s in pplan.stages),
        measured_peaks_bytes=" ".join(map(str, measured)),
        max_over_prediction_bytes=max(m - s.predicted_peak_bytes for m, s in zip(measured, pplan.stages)),
        loss_error=abs(sum(results[-1]["losses"]) / MICROBATCHES - loss),
        max_gradient_error=max(gradient_errors), measured_step_ms=step_ms,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/results/pipeline"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    expected = reference()
    planners = {setting: planner(chunk) for setting, chunk in SETTINGS.items()}
    floors = {setting: floor_of(found) for setting, (found, _) in planners.items()}
    shared = max(floors.values())  # the unchunked setting's floor: both keep it
    planned = {(setting, kind): (budget, found.plan(budget_bytes=budget))
               for setting, (found, _) in planners.items()
               for kind, budget in (("own floor", floors[setting]), ("shared", shared))}
    distinct = {key: value for key, value in planned.items() if key != (CHUNK_OFF, "own floor")}  # its floor: shared
    step_ms = dict(zip(distinct, alternating_step_ms([p for _, p in distinct.values()], {**CONFIG, "rounds": ROUNDS},
                                                     batch())))
    step_ms[(CHUNK_OFF, "own floor")] = step_ms[(CHUNK_OFF, "shared")]
    rows = []
    for (setting, kind), (budget, pplan) in planned.items():
        rows.append(row(setting, kind, budget, planners[setting][1], pplan, expected, round(step_ms[(setting, kind)], 2)))
        print(rows[-1], flush=True)
    write_csv(args.out / "pipeline_loss.csv", rows)
    chunked, alone = (floors[s] for s in SETTINGS)
    floor_ms, shared_ms, alone_ms = (step_ms[key] for key in ((CHUNK_AUTO, "own floor"), (CHUNK_AUTO, "shared"),
                                                              (CHUNK_OFF, "shared")))
    lines = [
        (f"Decoder of 4 layers, width 64, vocabulary {CONFIG['model']['vocab']} (untied head); 2 stages, 1F1B, "
         f"{MICROBATCHES} microbatches of {BATCH_ROWS // MICROBATCHES} x {SEQUENCE} tokens, outputs not returned; "
         "CPU, one gloo rank per stage. Measured peak: the larger of autockpt's StorageTracker (steps 1-2) and torch's "
         f"MemTracker (step 3), per stage; step time: median over {ROUNDS} rounds of the slower rank, the plans "
         "stepped in turn in one process group. "
         f"`python -m experiments.bench.bench_pipeline_loss --out {args.out}`"),
        "",
        (f"- smallest budget a split keeps: {alone} B with the last stage alone, {chunked} B with it planned with its "
         f"loss ({100 * (chunked / alone - 1):+.1f} %)"),
        (f"- step time, the last stage alone at its floor ({shared} B): {alone_ms:.1f} ms; planned with its loss at "
         f"that budget: {shared_ms:.1f} ms ({shared_ms / alone_ms:.2f}x), at its own floor: {floor_ms:.1f} ms "
         f"({floor_ms / alone_ms:.2f}x)"),
        "",
        ("| setting | budget | plan (s) | cuts after unit | last stage with loss | chunk (tokens) | predicted peaks (B) "
         "| measured peaks (B) | max measured - predicted (B) | loss error | max gradient error | step (ms) |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.setting} | {r.budget_kind} {r.budget_bytes} | {r.plan_s} | {r.cuts} | {r.last_stage_with_loss} | "
        f"{r.last_stage_chunk_tokens} | {r.predicted_peaks_bytes} | {r.measured_peaks_bytes} | "
        f"{r.max_over_prediction_bytes} | {r.loss_error:.2e} | {r.max_gradient_error:.2e} | {r.measured_step_ms} |"
        for r in rows
    ]
    text = "\n".join(lines)
    print(text)
    write_section("bench_pipeline_loss", text, output=args.out)


if __name__ == "__main__":
    main()
