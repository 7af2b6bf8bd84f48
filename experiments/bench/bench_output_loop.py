"""The loop users write (issue 46, item 1): a plan for a loop that holds the model's output through backward (the
default) and one for a loop that drops it before backward (``output_held=False``: Hugging Face's Trainer,
torchtitan), each measured in both loops.

    python -m experiments.bench.bench_output_loop --out experiments/results/output_loop

The issue's model: a GPT-NeoX decoder (hidden 128, 4 layers, vocabulary 2000, batch 4 x 256), planned and stepped
under bf16 autocast on CPU, loss ``output.loss`` (labels given). Per plan (``output_held`` True / False) the budget
is half-way from that loop's floor to its unmodified peak; ``autockpt.optimize`` plans and verifies it; then the user's
step runs in each loop with torch's MemTracker (the module and the inputs tracked as external): ``held`` keeps the
output until after ``backward()``, ``dropped`` is ``model(**batch).loss.backward()``. Rows: budget, predicted peak,
the measured peak in each loop, and what the optimized module said about the loop (``runtime/output_watch.py``).
Nothing is typed in by hand: ``output_loop.csv``, ``output_loop.md`` and the section ``bench_output_loop`` of the
README.md in ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker

import autockpt
from experiments.common.results_readme import write_csv, write_section


@dataclass(frozen=True)
class Row:
    plan_for: str
    unmodified_peak_bytes: int
    floor_bytes: int
    budget_bytes: int
    predicted_peak_bytes: int
    held_loop_bytes: int
    dropped_loop_bytes: int
    said: str
    seconds: float


def neox() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=2000, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, max_position_embeddings=256, use_cache=False)
    ids = torch.randint(0, 2000, (4, 256))
    return GPTNeoXForCausalLM(config), {"input_ids": ids, "labels": ids}


def loop_peak(module: torch.nn.Module, batch: dict[str, torch.Tensor], *, held: bool) -> int:
    """One step of the user's loop under bf16 autocast, MemTracker around it."""
    for param in module.parameters():
        param.grad = None
    tracker = MemTracker()
    tracker.track_external(module, *batch.values())
    with tracker, torch.autocast("cpu", dtype=torch.bfloat16):
        if held:
            output = module(**batch)
            output.loss.backward()
            del output
        else:
            module(**batch).loss.backward()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run() -> list[Row]:
    rows = []
    for held in (True, False):
        started = time.perf_counter()
        model, batch = neox()
        options = autockpt.PlanOptions(output_held=held)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            planner = autockpt.Planner.from_model(model, example_kwargs=batch, options=options)
            probe = planner.plan(budget_bytes=10**15)
            budget = (probe.min_feasible_bytes + probe.baseline_peak_bytes) // 2
            module = planner.optimize(budget_bytes=budget)
        plan = autockpt.get_plan(module)
        said = _Said()
        logging.getLogger("autockpt.runtime.output_watch").addHandler(said)
        peaks = {loop: loop_peak(module, batch, held=loop) for loop in (True, False)}
        logging.getLogger("autockpt.runtime.output_watch").removeHandler(said)
        rows.append(Row(
            plan_for="output held" if held else "output dropped", unmodified_peak_bytes=probe.baseline_peak_bytes,
            floor_bytes=probe.min_feasible_bytes, budget_bytes=budget, predicted_peak_bytes=plan.predicted_peak_bytes,
            held_loop_bytes=peaks[True], dropped_loop_bytes=peaks[False], said=" / ".join(said.messages) or "-",
            seconds=time.perf_counter() - started,
        ))
        print(rows[-1], flush=True)
    return rows


def markdown(rows: list[Row], command: str, seconds: float) -> str:
    def figure(nbytes: int, predicted: int) -> str:
        return f"{nbytes:,} B ({100 * (nbytes / predicted - 1):+.2f} %)"

    lines = [
        (
            f"`{command}`, {time.strftime('%Y-%m-%d')}, {seconds:.0f} s, torch {torch.__version__}. GPT-NeoX (hidden "
            "128, 4 layers, vocabulary 2000, 4 x 256 tokens), bf16 autocast, CPU; peaks by MemTracker (module and "
            "inputs external). Budget: half-way from the loop's floor to its unmodified peak. In brackets: against "
            "the prediction."
        ),
        "",
        (
            "| plan made for | unmodified peak | floor | budget | predicted | measured, output held | measured, output "
            "dropped | the module said |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.plan_for} | {row.unmodified_peak_bytes:,} B | {row.floor_bytes:,} B | {row.budget_bytes:,} B | "
            f"{row.predicted_peak_bytes:,} B | {figure(row.held_loop_bytes, row.predicted_peak_bytes)} | "
            f"{figure(row.dropped_loop_bytes, row.predicted_peak_bytes)} | {row.said} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/results/output_loop"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = run()
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "output_loop.csv", rows)
    command = ("python -m experiments.bench.bench_output_loop " + " ".join(sys.argv[1:])).strip()
    text = markdown(rows, command, time.perf_counter() - started)
    (args.out / "output_loop.md").write_text(text + "\n")
    write_section("bench_output_loop", text, output=args.out)
    print(text)


if __name__ == "__main__":
    main()
