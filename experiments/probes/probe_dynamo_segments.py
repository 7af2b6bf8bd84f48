"""Can models with data-dependent Python control flow be captured as the graphs torch._dynamo makes between breaks?

    python -m experiments.probes.probe_dynamo_segments --out experiments/results/dynamo_segments

Issue 24, item 2 asks for a capture path that plans over the graphs ``torch._dynamo`` produces between its graph
breaks, so that a model whose forward branches on a tensor's value inside a loop of layers gets regions spanning
several ops and layers (today it falls to the module-level capture). Before building that path, this probe measures
what dynamo gives on such models with the torch installed, and the floor the existing (module-level) capture reaches:

* per model, the graphs a recording backend (``torch.compile(model, backend=...)``, the custom-backend mechanism the
  path would use) receives in one training step, and the ops in each;
* whether the compiled model still runs its graphs after one step under a ``TorchDispatchMode`` (autockpt's tracer
  and ``MemTracker``, which ``measure_step`` uses, are such modes): dynamo skips frames while a non-infra dispatch
  mode is on the stack and marks their code to run eagerly from then on; a mode whose ``ignore_compile_internals()``
  is True is not skipped for (it sees the graphs' ops);
* the capture autockpt uses today and its floor (``InfeasibleBudgetError.min_feasible_bytes`` at a 1-byte budget) as
  a fraction of the way from static memory to the unmodified peak (the issue's target: at most 0.70).

Nothing is typed in by hand: ``dynamo_segments.csv``, ``dynamo_segments.md`` and the section ``probe_dynamo_segments``
of the README.md in ``--out``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import autockpt
from autockpt.present import zoo
from experiments.common.results_readme import write_csv, write_section

_COMPUTE_OPS = ("call_function", "call_method", "call_module")


class LinearLoop(nn.Module):
    """The issue's example: a loop of Linear layers, the activation chosen by a branch on a tensor's value."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(x)
            x = torch.relu(h) if h.mean() > 0 else torch.tanh(h)
        return x


class DropoutLoop(nn.Module):
    """Dropout under data-dependent control flow: residual Linear-GELU-dropout steps, added or subtracted by a branch."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            y = self.drop(torch.nn.functional.gelu(layer(x)))
            x = x + y if y.mean() > 0 else x - y
        return x


class BranchThenLoop(nn.Module):
    """A branch on a tensor's value before and after a loop of Linear layers (no branch inside the loop)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = torch.relu(h) if h.mean() > 0 else torch.tanh(h)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h * 2 if h.sum() > 0 else h


def cases() -> list[zoo.ZooCase]:
    torch.manual_seed(0)
    width, depth, batch = 128, 12, 256
    built: list[zoo.ZooCase] = [zoo.build("control_flow", "tiny")]
    for name, cls in (("linear_loop", LinearLoop), ("dropout_loop", DropoutLoop), ("branch_then_loop", BranchThenLoop)):
        built.append(zoo.ZooCase(name=name, model=cls(width, depth), args=(torch.randn(batch, width),)))
    return built


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    model: str
    dynamo_graphs: int  # graphs the backend received in one training step
    dynamo_ops_per_graph: str  # compute nodes of each, in order
    graphs_after_dispatch_mode: int  # graphs run in a step after one step under a TorchDispatchMode
    graphs_under_ignoring_mode: int  # graphs run in a step under a mode with ignore_compile_internals() True
    capture: str  # the capture autockpt uses today
    static_bytes: int
    unmodified_peak_bytes: int
    floor_bytes: int
    floor_fraction: float  # (floor - static) / (unmodified peak - static); the target: <= 0.70
    seconds: float


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing (as MemTracker's and autockpt's tracer's modes, seen by dynamo)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _PassThroughIgnoringCompile(_PassThrough):
    """The same, declaring ``ignore_compile_internals``: dynamo does not skip frames while it is on the stack."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def dynamo_graphs(model: nn.Module, args: tuple) -> tuple[list[int], int, int]:
    """(compute nodes of each graph a recording backend receives in one step, graphs run in a step under a dispatch
    mode declaring ``ignore_compile_internals``, graphs run in a step after one step under a plain dispatch mode).
    Resets dynamo's caches first and last: each model is probed from a clean state."""
    torch._dynamo.reset()
    compiled_ops: list[int] = []
    runs: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        index = len(compiled_ops)
        compiled_ops.append(sum(node.op in _COMPUTE_OPS for node in gm.graph.nodes))

        def run(*inputs: torch.Tensor) -> object:
            runs.append(index)
            return gm.forward(*inputs)

        return run

    compiled = torch.compile(model, backend=backend, dynamic=False)
    compiled(*args).sum().backward()
    runs.clear()
    with _PassThroughIgnoringCompile():
        compiled(*args).sum().backward()
    under_ignoring = len(runs)
    with _PassThrough():
        compiled(*args).sum().backward()
    runs.clear()
    compiled(*args).sum().backward()
    after = len(runs)
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    return compiled_ops, under_ignoring, after


def run(case: zoo.ZooCase) -> Row:
    started = time.perf_counter()
    ops, under_ignoring, after = dynamo_graphs(case.model, case.args)
    planner = autockpt.Planner.from_model(case.model, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn)
    trace = planner.trace
    try:
        planner.plan(budget_bytes=1)
        raise AssertionError("a 1-byte budget was accepted")
    except autockpt.InfeasibleBudgetError as error:
        floor = error.min_feasible_bytes
    span = trace.baseline_peak_bytes - trace.static_bytes
    return Row(
        model=case.name, dynamo_graphs=len(ops), dynamo_ops_per_graph=" ".join(map(str, ops)) or "-",
        graphs_after_dispatch_mode=after, graphs_under_ignoring_mode=under_ignoring, capture=planner.graph.kind.value, static_bytes=trace.static_bytes,
        unmodified_peak_bytes=trace.baseline_peak_bytes, floor_bytes=floor,
        floor_fraction=round((floor - trace.static_bytes) / span, 3) if span > 0 else 0.0,
        seconds=round(time.perf_counter() - started, 1),
    )


def markdown(rows: list[Row]) -> str:
    lines = [
        (f"`python -m experiments.probes.probe_dynamo_segments --out experiments/results/dynamo_segments` (CPU, torch "
        f"{torch.__version__}): graphs a `torch.compile(model, backend=...)` recording backend receives in one "
        "training step (ops per graph), graphs run in a step under a `TorchDispatchMode` whose "
        "`ignore_compile_internals()` is True, graphs still run in a step after one step under a plain one (as "
        "MemTracker and autockpt's tracer are), and the floor autockpt reaches today with the capture it uses, as a "
        "fraction of the way from static memory to the unmodified peak (issue 24 item 2's target: at most 0.70)."),
        "",
        ("| model | dynamo graphs | ops per graph | graphs run under an ignoring mode | graphs run after a plain-mode step | capture today | static "
        "bytes | unmodified peak bytes | floor bytes | floor fraction |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.dynamo_graphs} | {r.dynamo_ops_per_graph} | {r.graphs_under_ignoring_mode} | {r.graphs_after_dispatch_mode} | {r.capture} "
            f"| {r.static_bytes} | {r.unmodified_peak_bytes} | {r.floor_bytes} | {r.floor_fraction:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/results/dynamo_segments"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in cases():
        row = run(case)
        print(row, flush=True)
        rows.append(row)
    write_csv(args.out / "dynamo_segments.csv", rows)
    text = markdown(rows)
    (args.out / "dynamo_segments.md").write_text(text + "\n")
    write_section("probe_dynamo_segments", text, output=args.out)
    print(text)


if __name__ == "__main__":
    main()
