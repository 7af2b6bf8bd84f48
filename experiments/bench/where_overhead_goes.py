"""Where a plan's measured overhead goes: per-operator CPU time of the planned step against the unmodified one.

A plan's predicted overhead is the re-run kernels' profiled forward time plus the calibrated checkpoint machinery.
This script plans one zoo model at one budget, times the plan against ``none`` (the same captured graph, nothing
checkpointed) in alternating rounds, then runs each under ``torch.profiler`` and lists the operators whose self CPU
time per step grew most, with their call counts: operators called more often are the recomputation; operators
called as often but slower are what the recomputation costs elsewhere (e.g. backward kernels reading freshly
recomputed tensors), which no per-unit forward time predicts.

    python -m experiments.bench.where_overhead_goes unet --budget-bytes 19506984 --checkpoint torch_non_reentrant \\
        --kernel aten::convolution_backward
    python -m experiments.bench.where_overhead_goes gpt2 --budget-bytes 24009736 --top 15

It prints; it writes no results folder.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import profile as torch_profile
from torch.utils._python_dispatch import TorchDispatchMode

import autockpt
from autockpt.measure.loss import default_loss
from autockpt.measure.step import alternating_step_seconds
from autockpt.present import zoo


def self_cpu_ms_per_step(module: torch.nn.Module, case: zoo.ZooCase, steps: int) -> dict[str, tuple[float, float]]:
    """Per operator: (self CPU milliseconds, calls) per step, over ``steps`` profiled steps after two warm-up steps."""
    loss_fn = case.loss_fn or default_loss

    def step() -> None:
        for param in module.parameters():
            param.grad = None
        loss_fn(module(*case.args, **case.kwargs)).backward()

    for _ in range(2):
        step()
    with torch_profile() as recorded:
        for _ in range(steps):
            step()
    return {e.key: (e.self_cpu_time_total / steps / 1000, e.count / steps) for e in recorded.key_averages()}


class _KernelClock(TorchDispatchMode):
    """Wall-clock milliseconds of every call of one aten operator, in call order."""

    def __init__(self, op_name: str) -> None:
        super().__init__()
        self.op_name, self.ms = op_name, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() != self.op_name:
            return func(*args, **(kwargs or {}))
        started = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.ms.append((time.perf_counter() - started) * 1000)
        return out


def kernel_ms(module: torch.nn.Module, case: zoo.ZooCase, op_name: str, steps: int) -> list[float]:
    """Per call of ``op_name`` in one step (call order): the median over ``steps`` steps of its milliseconds."""
    loss_fn = case.loss_fn or default_loss
    per_step = []
    for step in range(steps + 1):
        for param in module.parameters():
            param.grad = None
        with _KernelClock(op_name) as clock:
            loss_fn(module(*case.args, **case.kwargs)).backward()
        if step > 0:  # the first is a warm-up
            per_step.append(clock.ms)
    return [statistics.median(calls) for calls in zip(*per_step)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(zoo.BUILDERS))
    parser.add_argument("--size", default="small", choices=zoo.SIZES)
    parser.add_argument("--budget-bytes", type=int, required=True)
    parser.add_argument("--checkpoint", default="auto",
                        help="auto, torch_non_reentrant or recompute_function (an autockpt.Action's value)")
    parser.add_argument("--rounds", type=int, default=9, help="alternating timing rounds")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per module")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--kernel", default="", help="also time every call of this aten op, e.g. aten::convolution_backward")
    args = parser.parse_args()

    torch.manual_seed(0)
    case = zoo.build(args.model, args.size)
    planner = autockpt.Planner.from_model(
        case.model, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn,
        checkpoint=args.checkpoint,
    )
    plan = planner.plan(budget_bytes=args.budget_bytes)
    none = planner.apply(autockpt.planning.planner.baseline_plan(planner, "none"))
    planned = planner.apply(plan)
    print(plan.summary())

    seconds = alternating_step_seconds([none, planned], case.args, case.kwargs, case.loss_fn or default_loss, rounds=args.rounds)
    ratio = statistics.median(p / n for p, n in zip(seconds[1], seconds[0]))
    print(f"\nmeasured step-time ratio {ratio:.3f} (median of {args.rounds} alternating rounds); "
          f"predicted {1 + plan.predicted_overhead:.3f}")

    before = self_cpu_ms_per_step(none, case, args.steps)
    after = self_cpu_ms_per_step(planned, case, args.steps)
    total_before, total_after = sum(ms for ms, _ in before.values()), sum(ms for ms, _ in after.values())
    print(f"self CPU ms per step under the profiler: none {total_before:.1f}, plan {total_after:.1f}\n")
    print(f"{'added ms':>9} {'none ms':>8} {'plan ms':>8} {'calls':>6} {'calls':>6}  operator")
    grown = sorted(
        ((after.get(k, (0, 0))[0] - before.get(k, (0, 0))[0], k) for k in set(before) | set(after)), reverse=True
    )
    for added, key in grown[: args.top]:
        (ms_before, calls_before), (ms_after, calls_after) = before.get(key, (0, 0)), after.get(key, (0, 0))
        print(f"{added:9.2f} {ms_before:8.2f} {ms_after:8.2f} {calls_before:6.0f} {calls_after:6.0f}  {key}")
    if args.kernel:
        calls_before, calls_after = kernel_ms(none, case, args.kernel, args.steps), kernel_ms(planned, case, args.kernel, args.steps)
        print(f"\n{args.kernel}, call by call (median ms of {args.steps} steps): none, plan, plan / none")
        if len(calls_before) != len(calls_after):
            print(f"(called {len(calls_before)} times without the plan, {len(calls_after)} with it: not compared)")
            return
        for index, (before_ms, after_ms) in enumerate(zip(calls_before, calls_after)):
            print(f"{index:4d} {before_ms:8.3f} {after_ms:8.3f} {after_ms / before_ms:6.2f}")


if __name__ == "__main__":
    main()
