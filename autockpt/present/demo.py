"""The README's main job: optimize a built-in model to half of its activation memory and measure the result.

    autockpt demo                      # GPT-2 (random init) when transformers is installed, else a tiny transformer
    autockpt demo --model cnn --fraction 0.4
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch

import autockpt
from autockpt.present import zoo
from autockpt.units import format_bytes


def main(argv: list[str] | None = None, prog: str = "autockpt demo") -> None:
    default_model = "gpt2" if importlib.util.find_spec("transformers") else "transformer"
    parser = argparse.ArgumentParser(prog=prog, description="autockpt demo on a built-in model")
    parser.add_argument("--model", default=default_model, choices=sorted(zoo.BUILDERS))
    parser.add_argument("--size", default="small", choices=zoo.SIZES)
    parser.add_argument(
        "--fraction", type=float, default=0.5,
        help="budget as a fraction of the way from static memory to the unmodified peak (default 0.5)",
    )
    args = parser.parse_args(argv)
    if not 0 < args.fraction:
        parser.error(f"--fraction must be positive, got {args.fraction}")

    case = zoo.build(args.model, args.size)
    print(f"model: {args.model} ({args.size}), {sum(p.numel() for p in case.model.parameters()):,} parameters")
    torch.manual_seed(0)  # same dropout masks for both measured steps, so the losses compare
    unmodified = autockpt.measure_step(case.model, case.args, case.kwargs, case.loss_fn)
    # autockpt.optimize in two steps, to set the budget from the step's own figures: one capture and trace for both
    started = time.perf_counter()
    planner = autockpt.Planner.from_model(
        case.model, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn
    )
    trace = planner.trace
    budget = int(trace.static_bytes + args.fraction * (trace.baseline_peak_bytes - trace.static_bytes))
    print(f"budget: {format_bytes(budget)} ({args.fraction:.0%} of the way from static memory to the unmodified peak)")
    optimized = planner.optimize(budget_bytes=budget)
    print(f"optimize took {time.perf_counter() - started:.1f} s (capture, trace, plan and a verified step)\n")
    plan = autockpt.get_plan(optimized)
    print(plan.summary())

    torch.manual_seed(0)
    measured = autockpt.measure_step(optimized, case.args, case.kwargs, case.loss_fn)
    print("\nmeasured on one training step (MemTracker on CPU, max_memory_allocated on CUDA):")
    print(f"  unmodified model   {format_bytes(unmodified.peak_bytes)}")
    print(f"  optimized model    {format_bytes(measured.peak_bytes)}  (budget {format_bytes(budget)}, "
          f"{'within' if measured.peak_bytes <= budget else 'OVER'} budget)")
    error = (measured.peak_bytes - plan.predicted_peak_bytes) / measured.peak_bytes
    print(f"  prediction error   {100 * error:+.2f}% (predicted {format_bytes(plan.predicted_peak_bytes)})")
    print(f"  loss               {unmodified.loss:.6f} unmodified, {measured.loss:.6f} optimized")


if __name__ == "__main__":
    main()
