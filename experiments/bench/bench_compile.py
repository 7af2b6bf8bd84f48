"""torch.compile + autockpt against torch.compile's own ``activation_memory_budget``, peaks measured under compile.

    python -m experiments.bench.bench_compile --out experiments/results/compile

Per model (a 2-layer GPT-NeoX-style decoder; the zoo GPT-2 at size tiny, export capture): autockpt plans at budgets
``--fractions`` of the way from static memory to the unmodified eager peak (``Planner.optimize``: planned, rewritten
and verified in eager mode with MemTracker), and the optimized module is compiled with ``torch.compile`` (Inductor);
torch.compile compiles a copy of the original with ``torch._functorch.config.activation_memory_budget`` at each of
``--compile-budgets`` (1.0 is torch.compile's default). ``autockpt compiled=True`` rows: what
``autockpt.optimize(..., compiled=True)`` does (``autockpt.planning.compiled.compiled_module`` on the same planner): the
compiled step is measured and planned again, tighter, while it is over the budget. Every compiled step's peak is measured the same way,
``anchors.profiler_peak_bytes``: the highest running total of the CPU allocator's events during one forward +
backward (MemTracker does not see inside compiled code), plus parameters, buffers and inputs. The same method on the
eager modules is in the table too (it reads higher than MemTracker: it sees kernel workspaces), so ``kept`` compares
a compiled peak with a budget set in MemTracker's terms (``--device cuda``: ``max_memory_allocated`` for all). Step
time: every compiled module of a model and the eager original timed together, one alternating round robin of
``--rounds`` rounds (compile's own points are compiled each by a backend of its own, so they stay compiled side by
side); the ratio is t(module) / t(eager original) in each round, its median reported. A compile point *dominates* an
autockpt point beyond the noise when its compiled peak is lower and its step was faster in at least 75 % of the
rounds; points with only a lower median are listed apart. For reference, autockpt's ``every_1`` baseline (one region
per repeated block) compiled the same way. The machine is shared: ratios are within one process, never absolute times. Nothing is
typed in by hand: ``compile.csv``, ``compile.md`` and the section ``bench_compile`` of the README.md in ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo
from torch._dynamo.utils import counters

import autockpt
from autockpt.measure.step import alternating_step_seconds
from autockpt.planning.compiled import compiled_module
from autockpt.planning.planner import baseline_plan
from autockpt.present import zoo
from experiments.bench import sweep
from experiments.common import anchors
from experiments.common.results_readme import write_csv, write_section

logger = logging.getLogger("bench_compile")
MB = 10**6
DOMINATING_SHARE = 0.75  # a compile point dominates beyond the noise when its step was faster in this share of rounds


@dataclass(frozen=True, kw_only=True)
class Row:
    model: str
    strategy: str  # "autockpt + compile", "autockpt compiled=True", "every_1 + compile" (a baseline), "compile budget"
    # the measurements below are None where the point was not measured (refused, infeasible, not available)
    setting: float  # autockpt: the budget's fraction; compile: activation_memory_budget
    budget_bytes: int | None  # autockpt's budget (MemTracker terms); None for compile's own budget
    eager_memtracker_peak_bytes: int | None = None  # autockpt: the verified eager peak
    eager_profiler_peak_bytes: int | None = None  # the eager module measured like the compiled one
    compiled_peak_bytes: int | None = None  # allocator events under compile
    kept: bool | None = None  # compiled peak <= budget (autockpt only)
    graphs: int | None = None
    graph_breaks: int | None = None
    step_time_ratio: float | None = None  # compiled / eager original, median over the rounds
    round_ratios: tuple[float, ...] = ()  # compiled / eager original in each round of the one round robin
    compile_s: float | None = None
    notes: str = ""


def decoder_case() -> zoo.ZooCase:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256,
    )
    ids = torch.randint(0, 128, (2, 128))
    return zoo.ZooCase(name="neox", model=GPTNeoXForCausalLM(config), args=(ids,), kwargs={"labels": ids})


def build(name: str, size: str) -> zoo.ZooCase:
    return decoder_case() if name == "neox" else zoo.build(name, size)


def compiled_point(module: torch.nn.Module, case: zoo.ZooCase) -> tuple[torch.nn.Module, int, int, float, int]:
    """``torch.compile(module)`` after two steps (the first compiles): the compiled module, its graphs, graph breaks,
    compile seconds and compiled peak. No ``torch._dynamo.reset()``: every module compiled here stays compiled, to be
    timed with the others."""
    counters.clear()
    loss_fn = case.loss_fn or autockpt.measure.loss.default_loss
    started = time.perf_counter()
    compiled = torch.compile(module)
    for _ in range(2):
        for param in module.parameters():
            param.grad = None
        loss_fn(compiled(*case.args, **case.kwargs)).backward()
    seconds = time.perf_counter() - started
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    peak = anchors.profiler_peak_bytes(compiled, case.args, case.kwargs, loss_fn, static_from=module)
    return compiled, graphs, breaks, seconds, peak


def bench_model(name: str, size: str, device: torch.device, fractions: Sequence[float],
                compile_budgets: Sequence[float], rounds: int) -> list[Row]:
    case = sweep.on_device(build(name, size), device)
    loss_fn = case.loss_fn or autockpt.measure.loss.default_loss
    original = case.model
    rows: list[Row] = []
    timed: dict[int, torch.nn.Module] = {}  # row index -> its compiled module, timed together at the end
    torch._dynamo.reset()
    planner = autockpt.Planner.from_model(original, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn)
    trace = planner.trace

    def budget_at(fraction: float) -> int:
        return int(trace.static_bytes + fraction * (trace.baseline_peak_bytes - trace.static_bytes))

    for fraction in fractions:
        budget = budget_at(fraction)
        try:
            module = planner.optimize(budget_bytes=budget)
        except autockpt.InfeasibleBudgetError as error:
            rows.append(Row(model=name, strategy="autockpt + compile", setting=fraction, budget_bytes=budget,
                            notes=f"infeasible in eager: floor {error.min_feasible_bytes} bytes"))
            continue
        plan = module.plan
        eager_profiler = anchors.profiler_peak_bytes(module, case.args, case.kwargs, loss_fn)
        compiled, graphs, breaks, compile_s, peak = compiled_point(module, case)
        timed[len(rows)] = compiled
        rows.append(Row(
            model=name, strategy="autockpt + compile", setting=fraction, budget_bytes=budget,
            eager_memtracker_peak_bytes=plan.measured_peak_bytes, eager_profiler_peak_bytes=eager_profiler,
            compiled_peak_bytes=peak, kept=peak <= budget, graphs=graphs, graph_breaks=breaks,
            compile_s=compile_s, notes=f"{len(plan.regions)} regions, {plan.planned_action.value}",
        ))
        logger.info("%s", rows[-1])
    # optimize(..., compiled=True): planned again, tighter, while the compiled step measures over the budget; of the
    # plans that fit, the fastest compiled one
    for fraction in fractions:
        budget = budget_at(fraction)
        started = time.perf_counter()
        try:
            chosen = compiled_module(planner, budget)
        except autockpt.InfeasibleBudgetError as error:
            rows.append(Row(model=name, strategy="autockpt compiled=True", setting=fraction, budget_bytes=budget,
                            notes=f"refused: smallest budget stated {error.min_feasible_bytes} bytes"))
            continue
        seconds = time.perf_counter() - started  # every plan compiled, measured and timed on the way
        the_plan = chosen._orig_mod.plan
        (choice,) = [note for note in the_plan.notes if "compiled with torch.compile" in note]
        # its plan applied afresh and compiled on its own: graphs and breaks are the kept plan's, not every plan tried's
        compiled, graphs, breaks, _, peak = compiled_point(planner.apply(the_plan), case)
        timed[len(rows)] = compiled
        rows.append(Row(
            model=name, strategy="autockpt compiled=True", setting=fraction, budget_bytes=budget,
            eager_memtracker_peak_bytes=the_plan.measured_peak_bytes, eager_profiler_peak_bytes=None,
            compiled_peak_bytes=peak, kept=peak <= budget, graphs=graphs, graph_breaks=breaks, compile_s=seconds,
            notes=(f"{len(the_plan.regions)} regions, planned for {the_plan.budget_bytes} bytes; "
                   f"{choice.count(', compiled ')} plans compiled"
                   + (f", {choice.split('kept of ')[1].split(' compiled plans')[0]} fit and were timed"
                      if "kept of " in choice else "") + "; compile s: every plan tried"),
        ))
        logger.info("%s", rows[-1])
    # the per-layer checkpoint (autockpt's every_1 baseline: a region per repeated block), compiled the same way
    every = planner.apply(baseline_plan(planner, "every_1"))
    if every.plan.regions:
        eager_profiler = anchors.profiler_peak_bytes(every, case.args, case.kwargs, loss_fn)
        compiled, graphs, breaks, compile_s, peak = compiled_point(every, case)
        timed[len(rows)] = compiled
        rows.append(Row(
            model=name, strategy="every_1 + compile", setting=1.0, budget_bytes=None, eager_memtracker_peak_bytes=None,
            eager_profiler_peak_bytes=eager_profiler, compiled_peak_bytes=peak, kept=None, graphs=graphs,
            graph_breaks=breaks, compile_s=compile_s, notes=f"{len(every.plan.regions)} regions: one per repeated block",
        ))
        logger.info("%s", rows[-1])
    for setting in compile_budgets:
        original.zero_grad(set_to_none=True)
        counters.clear()
        result = anchors.torch_compile_budget(original, case.args, case.kwargs, case.loss_fn, fraction=setting)
        if result.module is None:
            rows.append(Row(model=name, strategy="compile budget", setting=setting, budget_bytes=None,
                            notes=f"not available: {result.reason}"))
            continue
        timed[len(rows)] = result.module
        rows.append(Row(
            model=name, strategy="compile budget", setting=setting, budget_bytes=None,
            eager_memtracker_peak_bytes=None, eager_profiler_peak_bytes=result.eager_profiler_peak_bytes,
            compiled_peak_bytes=result.measured_peak_bytes, kept=None, graphs=counters["stats"]["unique_graphs"],
            graph_breaks=sum(counters["graph_break"].values()), compile_s=result.solve_time_s,
            notes="1.0: torch.compile's default" if setting == 1.0 else "",
        ))
        logger.info("%s", rows[-1])
    # every compiled module and the eager original, timed together: one alternating round robin, so that a
    # difference between two compiled steps is not the drift between two separate timings
    indices = list(timed)
    seconds = alternating_step_seconds([original, *timed.values()], case.args, case.kwargs, loss_fn, rounds=rounds)
    for index, times in zip(indices, seconds[1:]):
        per_round = tuple(t / base for t, base in zip(times, seconds[0]))
        rows[index] = dataclasses.replace(rows[index], step_time_ratio=statistics.median(per_round),
                                          round_ratios=per_round)
    torch._dynamo.reset()
    return rows


def dominated(rows: Sequence[Row]) -> tuple[list[tuple[Row, Row]], list[tuple[Row, Row]]]:
    """(autockpt point, compile point) pairs where compile's has a lower compiled peak and a faster step: beyond the
    noise (its step faster in at least ``DOMINATING_SHARE`` of the rounds, both timed in each round), and within it
    (a lower median ratio only)."""
    beyond, within = [], []
    for ours in rows:
        if not ours.strategy.startswith("autockpt") or ours.compiled_peak_bytes is None:
            continue
        for theirs in rows:
            if (theirs.model != ours.model or theirs.strategy != "compile budget" or theirs.compiled_peak_bytes is None
                    or theirs.compiled_peak_bytes >= ours.compiled_peak_bytes):
                continue
            faster_rounds = sum(t < o for t, o in zip(theirs.round_ratios, ours.round_ratios))
            if faster_rounds >= DOMINATING_SHARE * len(ours.round_ratios):
                beyond.append((ours, theirs))
            elif theirs.step_time_ratio < ours.step_time_ratio:
                within.append((ours, theirs))
    return beyond, within


def markdown(rows: Sequence[Row], command: str, wall_s: float, rounds: int, device: torch.device) -> str:
    def mb(value: int | None) -> str:
        return "" if value is None else f"{value / MB:.3f}"

    def point(row: Row) -> str:
        return f"{mb(row.compiled_peak_bytes)} MB, {row.step_time_ratio:.3f}x"

    on_cuda = device.type == "cuda"
    lines = [
        "# torch.compile + autockpt vs torch.compile's activation_memory_budget",
        "",
        (f"Command: `{command}`; wall time {wall_s:.0f} s. Machine: {platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, device "
        f"{torch.cuda.get_device_name(device) if on_cuda else 'cpu'}; shared with other work while measuring. "
        "Peaks in MB (10^6 bytes). Compiled peaks and `eager profiler` peaks: "
        + ("`torch.cuda.max_memory_allocated` (the eager ones too); " if on_cuda else
           "CPU allocator events in torch.profiler plus parameters, buffers and inputs (MemTracker cannot see inside "
           "compiled code); ")
        + "`eager MemTracker`: the peak autockpt verified its plan at. `kept`: compiled peak <= autockpt's budget (a "
        "budget in MemTracker's terms). Step time: module / eager original in each round of one alternating round "
        f"robin over every module of the model ({rounds} rounds after a warm-up one, all compiled modules alive side "
        "by side), median over the rounds."),
        "",
        ("| model | strategy | setting | budget | eager MemTracker | eager profiler | compiled peak | kept | graphs "
        "| breaks | step time ratio | compile s | notes |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "" if r.step_time_ratio is None else f"{r.step_time_ratio:.3f}"
        compile_s = "" if r.compile_s is None else f"{r.compile_s:.0f}"
        kept = "" if r.kept is None else ("yes" if r.kept else "no")
        lines.append(
            f"| {r.model} | {r.strategy} | {r.setting:.2f} | {mb(r.budget_bytes)} | {mb(r.eager_memtracker_peak_bytes)} "
            f"| {mb(r.eager_profiler_peak_bytes)} | {mb(r.compiled_peak_bytes)} | {kept} | "
            f"{'' if r.graphs is None else r.graphs} | {'' if r.graph_breaks is None else r.graph_breaks} | {ratio} "
            f"| {compile_s} | {r.notes} |"
        )
    beyond, within = dominated(rows)
    lines += ["", ("## autockpt points dominated by a compile-budget point: a lower compiled peak, and a faster step "
                   f"in at least {DOMINATING_SHARE:.0%} of the rounds"), ""]
    lines += [f"- {ours.model} {ours.strategy} @ {ours.setting:.2f} ({point(ours)}) by compile budget "
              f"{theirs.setting:.2f} ({point(theirs)})" for ours, theirs in beyond] or ["none"]
    lines += ["", ("## within the noise: a lower compiled peak and a lower median step time, but not faster in "
                   f"{DOMINATING_SHARE:.0%} of the rounds"), ""]
    lines += [f"- {ours.model} {ours.strategy} @ {ours.setting:.2f} ({point(ours)}) by compile budget "
              f"{theirs.setting:.2f} ({point(theirs)})" for ours, theirs in within] or ["none"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="neox,gpt2")
    parser.add_argument("--size", default="tiny", choices=zoo.SIZES, help="the zoo models' size (neox has one)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fractions", default="0.2,0.4,0.6,0.8")
    parser.add_argument("--compile-budgets", default="1.0,0.7,0.5,0.3,0.1")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default="experiments/results/compile")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    warnings.filterwarnings("ignore", module="torch._dynamo")
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows: list[Row] = []
    for name in args.models.split(","):
        rows += bench_model(
            name, args.size, device, [float(f) for f in args.fractions.split(",")],
            [float(b) for b in args.compile_budgets.split(",")], args.rounds,
        )
        write_csv(out / "compile.csv", rows)  # partial results survive a crash
    command = "python -m experiments.bench.bench_compile" + (" " + " ".join(sys.argv[1:]) if argv is None and sys.argv[1:] else "")
    text = markdown(rows, command, time.perf_counter() - started, args.rounds, device)
    (out / "compile.md").write_text(text)
    write_section("bench_compile", text, output=out)
    print(text)


if __name__ == "__main__":
    main()
