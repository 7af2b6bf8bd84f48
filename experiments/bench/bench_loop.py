"""Does the budget hold for the step as the training loop runs it: optimizer.step(), its states, accumulation?

    python -m experiments.bench.bench_loop --out experiments/results/loop

Per model (a 2-layer GPT-NeoX-style decoder, the issue's; the zoo MLP) and loop (SGD with momentum, Adam, AdamW;
AdamW with 2 gradient-accumulation micro-steps): the budget is half-way from the loop's static bytes (parameters,
gradients, inputs, optimizer states) to the unmodified model's peak in that loop. ``autockpt.optimize(...,
optimizer=, gradient_accumulation_steps=)`` plans it; then the user's own loop runs two optimizer steps on the
optimized module with the user's optimizer, MemTracker around every micro-step (forward + backward, and
``optimizer.step()`` at a window's end). Rows: predicted peak, the peak optimize measured while verifying, the loop's
first and later optimizer step (the highest micro-step of each), the same loop on the unmodified model, and on a plan
made for forward + backward only at the same budget (what planning without the optimizer gives). On CPU, where
torch's default optimizers run the for-loop implementation. Nothing is typed in by hand: ``loop.csv``, ``loop.md`` and the
section ``bench_loop`` of the README.md in ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker

import autockpt
from autockpt.present import zoo
from experiments.common.results_readme import write_csv, write_section

LOOPS: dict[str, tuple[Callable[..., torch.optim.Optimizer], int]] = {
    "SGD momentum": (functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9), 1),
    "Adam": (functools.partial(torch.optim.Adam, lr=1e-3), 1),
    "AdamW": (functools.partial(torch.optim.AdamW, lr=1e-3), 1),
    "AdamW, accumulation 2": (functools.partial(torch.optim.AdamW, lr=1e-3), 2),
}


@dataclass(frozen=True)
class Row:
    model: str
    loop: str
    budget_bytes: int
    predicted_peak_bytes: int
    verified_peak_bytes: int
    first_step_peak_bytes: int
    later_step_peak_bytes: int
    kept: bool
    unmodified_first_bytes: int
    unmodified_later_bytes: int
    bare_plan_later_bytes: int  # a plan for forward + backward only, same budget, same loop
    seconds: float


def decoder_case() -> zoo.ZooCase:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(
        vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64,
    )
    ids = torch.randint(0, 128, (2, 64))
    return zoo.ZooCase(name="gpt-neox-2l", model=transformers.GPTNeoXForCausalLM(config), args=(ids,),
                       kwargs={"labels": ids})


def loop_peaks(module: torch.nn.Module, optimizer: torch.optim.Optimizer, case: zoo.ZooCase, micro_steps: int,
               steps: int = 2) -> list[int]:
    """Per optimizer step, the highest MemTracker peak of its micro-steps (the last one includes ``step()``)."""
    loss_fn = case.loss_fn or autockpt.measure.loss.default_loss
    tensors = [t for t in [*case.args, *case.kwargs.values()] if isinstance(t, torch.Tensor)]
    peaks = []
    for _ in range(steps):
        window = []
        for micro in range(micro_steps):
            tracker = MemTracker()
            tracker.track_external(module, optimizer, *tensors)
            with tracker:
                loss_fn(module(*case.args, **case.kwargs)).backward()
                if micro == micro_steps - 1:
                    optimizer.step()
            window.append(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
        peaks.append(max(window))
        optimizer.zero_grad(set_to_none=True)
    return peaks


def run(case: zoo.ZooCase, loop: str) -> Row:
    make, micro_steps = LOOPS[loop]
    started = time.perf_counter()
    kwargs: dict[str, Any] = {"example_inputs": case.args, "example_kwargs": case.kwargs, "loss_fn": case.loss_fn}
    model = case.model
    twin = copy.deepcopy(model)
    optimizer = make(model.parameters())
    in_loop = {"optimizer": optimizer, "gradient_accumulation_steps": micro_steps}
    probe = autockpt.plan(model, budget_bytes=10**15, **kwargs, **in_loop)
    budget = int(probe.static_bytes + 0.5 * (probe.baseline_peak_bytes - probe.static_bytes))
    module = autockpt.optimize(model, budget_bytes=budget, **kwargs, **in_loop)
    plan = autockpt.get_plan(module)
    seconds = time.perf_counter() - started
    first, later = loop_peaks(module, optimizer, case, micro_steps)
    unmodified = loop_peaks(twin, make(twin.parameters()), case, micro_steps)
    bare = autockpt.optimize(model, budget_bytes=budget, **kwargs)
    bare_later = loop_peaks(bare, make(model.parameters()), case, micro_steps)[1]
    return Row(
        model=case.name, loop=loop, budget_bytes=budget, predicted_peak_bytes=plan.predicted_peak_bytes,
        verified_peak_bytes=plan.measured_peak_bytes or 0, first_step_peak_bytes=first, later_step_peak_bytes=later,
        kept=max(first, later) <= budget, unmodified_first_bytes=unmodified[0], unmodified_later_bytes=unmodified[1],
        bare_plan_later_bytes=bare_later, seconds=seconds,
    )


def markdown(rows: list[Row]) -> str:
    kept = sum(r.kept for r in rows)
    lines = [
        ("`python -m experiments.bench.bench_loop --out experiments/results/loop` (CPU, MemTracker around every micro-step "
         f"of the user's own loop, two optimizer steps): the budget was kept on {kept} of {len(rows)} loops. Budget: "
         "half-way from the loop's static bytes to the unmodified peak in that loop. \"bare plan\": planned for "
         "forward + backward only at the same budget, run in the same loop. Bytes."),
        "",
        ("| model | loop | budget | predicted | verified | 1st step | later step | kept | unmodified 1st / later "
         "| bare plan, later step | plan s |"),
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.loop} | {r.budget_bytes} | {r.predicted_peak_bytes} | {r.verified_peak_bytes} | "
            f"{r.first_step_peak_bytes} | {r.later_step_peak_bytes} | {'yes' if r.kept else 'no'} | "
            f"{r.unmodified_first_bytes} / {r.unmodified_later_bytes} | {r.bare_plan_later_bytes} | {r.seconds:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/results/loop"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for build in (decoder_case, functools.partial(zoo.build, "mlp", "tiny")):
        for loop in LOOPS:
            row = run(build(), loop)
            print(row, flush=True)
            rows.append(row)
    write_csv(args.out / "loop.csv", rows)
    text = markdown(rows)
    (args.out / "loop.md").write_text(text + "\n")
    write_section("bench_loop", text, output=args.out)
    print(text)


if __name__ == "__main__":
    main()
