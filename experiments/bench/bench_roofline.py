"""Roofline and benchmark times against measured ones, and plans chosen from each (issue 36, item 2).

    python -m experiments.bench.bench_roofline --out experiments/results/roofline
    python -m experiments.bench.bench_roofline --smoke     # two tiny models, a few rounds; prints, writes nothing

Per model (the zoo's mlp, cnn and transformer; Hugging Face GPT-2 and BERT, random-initialised): the step is traced
and timed on this machine's CPU (``timing="measured"``), and the same trace is timed by the roofline of the CPU as
``local_cpu_spec()`` calibrated it (``RooflineTiming``) and by the op benchmark (``BenchmarkTiming``: each op run alone
on random inputs at its shapes, what ``timing="auto"`` gives a fake trace; it reads only shapes and the repeated
blocks, which the fake trace has the same as the measured one): step and forward times, their ratios, and the rank
correlation of the unit times. Then, at budgets 0.2, 0.5 and 0.8 of the way from the smallest feasible peak to the
unmodified one, a plan is made from each timing (same trace, same memory, same solver); the distinct plans are run
against the unmodified model in alternating rounds in one process (median of the per-round ratios), and the
roofline's and the benchmark's plans are also scored with the measured times (what the simulator, with measured
times, says choosing from them cost). ``--device cuda`` does the same on a GPU (the roofline of the calibrated GPU
and of ``--target``, a table name; with a target the benchmark, which times the local device only, is left out).
Writes ``roofline_times.csv``, ``roofline_plans.csv``, ``roofline.md`` and the section ``bench_roofline`` of the
README.md in ``--out``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import autockpt
from autockpt.core.roofline import unit_rooflines
from autockpt.measure.devices_local import local_device_spec
from autockpt.measure.step import alternating_step_seconds
from autockpt.measure.timing import BenchmarkTiming, compute_dtype, parameter_read_bytes, with_timing
from autockpt.planning.planner import Planner
from autockpt.present import zoo
from experiments.common.results_readme import write_csv, write_section

MODELS = (("mlp", "small"), ("cnn", "small"), ("transformer", "tiny"), ("gpt2", "small"), ("bert", "small"))
FRACTIONS = (0.2, 0.5, 0.8)
SMOKE_MODELS = "mlp:tiny,transformer:tiny"


@dataclass(frozen=True)
class TimeRow:
    model: str
    size: str
    device: str
    spec: str
    units: int
    measured_step_ms: float
    roofline_step_ms: float
    step_ratio: float  # roofline / measured
    measured_forward_ms: float
    roofline_forward_ms: float
    forward_ratio: float
    measured_backward_per_forward: float  # (step - forward) / forward, measured; the roofline takes 2
    unit_rank_correlation: float  # Spearman, over the units timed on their own
    overhead_share: float  # of the roofline forward: the op overhead's part
    memory_bound_units: int
    compute_bound_units: int
    overhead_bound_units: int
    benchmark_step_ms: float  # nan: no benchmark (a target that is not this machine)
    benchmark_forward_ms: float
    benchmark_step_ratio: float  # benchmark / measured
    benchmark_unit_rank_correlation: float
    benchmark_ops_by_roofline: int  # units whose op could not run alone
    benchmark_seconds: float  # what the benchmark took, shapes pass included


@dataclass(frozen=True)
class PlanRow:
    model: str
    fraction: float
    budget_bytes: int
    same_plan: bool
    measured_regions: int
    roofline_regions: int
    measured_action: str
    roofline_action: str
    predicted_peak_measured: int
    predicted_peak_roofline: int
    predicted_overhead_measured: float  # the measured-times plan, by measured times
    roofline_plan_by_measured_times: float  # the roofline-times plan, scored by measured times
    roofline_plan_by_roofline_times: float
    step_ratio_measured_plan: float  # measured step time / unmodified, median of alternating rounds
    step_ratio_roofline_plan: float
    same_plan_benchmark: bool  # the benchmark's plan is the measured times' plan
    benchmark_regions: int
    benchmark_action: str
    benchmark_plan_by_measured_times: float  # nan: no benchmark
    step_ratio_benchmark_plan: float


def spearman(a: list[float], b: list[float]) -> float:
    if len(a) < 3:
        return float("nan")
    ranks = [np.argsort(np.argsort(x)).astype(float) for x in (a, b)]
    return float(np.corrcoef(*ranks)[0, 1])


def time_row(
    case: zoo.ZooCase, size: str, planner: Planner, roofline: Planner, spec_name: str,
    benchmark: tuple[Planner, BenchmarkTiming] | None,
) -> TimeRow:
    measured, timed = planner.trace, roofline.trace
    own = [i for i, u in enumerate(measured.units) if u.forward_ms_timed_at is None]
    nan = float("nan")
    bench_trace = benchmark[0].trace if benchmark is not None else None
    report = benchmark[1].report if benchmark is not None else None
    bench_units = report.benchmarks if report is not None else None
    dtype = compute_dtype(planner.graph, planner.request)
    lines = unit_rooflines(measured, roofline.target or local_device_spec(planner.request.device), dtype,
                           parameter_read_bytes=parameter_read_bytes(planner.graph))
    bounds = [line.bound for line in lines]
    return TimeRow(
        model=case.name, size=size, device=str(planner.request.device), spec=spec_name, units=len(measured.units),
        measured_step_ms=measured.step_ms, roofline_step_ms=timed.step_ms, step_ratio=timed.step_ms / measured.step_ms,
        measured_forward_ms=measured.forward_ms, roofline_forward_ms=timed.forward_ms,
        forward_ratio=timed.forward_ms / measured.forward_ms,
        measured_backward_per_forward=(measured.step_ms - measured.forward_ms) / measured.forward_ms,
        unit_rank_correlation=spearman([measured.units[i].forward_ms for i in own], [timed.units[i].forward_ms for i in own]),
        overhead_share=sum(line.overhead_ms for line in lines) / max(timed.forward_ms, 1e-12),
        memory_bound_units=bounds.count("memory"), compute_bound_units=bounds.count("compute"),
        overhead_bound_units=bounds.count("overhead"),
        benchmark_step_ms=bench_trace.step_ms if bench_trace else nan,
        benchmark_forward_ms=bench_trace.forward_ms if bench_trace else nan,
        benchmark_step_ratio=bench_trace.step_ms / measured.step_ms if bench_trace else nan,
        benchmark_unit_rank_correlation=spearman(
            [measured.units[i].forward_ms for i in own], [bench_trace.units[i].forward_ms for i in own]
        ) if bench_trace else nan,
        benchmark_ops_by_roofline=sum(t is None for t in bench_units.times) if bench_units else 0,
        benchmark_seconds=bench_units.seconds if bench_units else nan,
    )


def roofline_planner(planner: Planner, target: str | None) -> Planner:
    """A planner over the same graph, trace and prices, its times the roofline's (never used to rewrite: the measured
    planner applies both planners' plans, whose fingerprints are the same)."""
    timed = with_timing("roofline", target, planner.graph, planner.request, planner.trace, planner.costs)
    made = Planner(planner.graph, timed.trace, timed.costs, planner.options, step=planner.request)
    made.target = timed.target
    return made


def benchmark_planner(planner: Planner) -> tuple[Planner, BenchmarkTiming]:
    """A planner over the same graph, trace and prices, its times the op benchmark's (each op alone, on this device),
    and the timing (its ``report``). The benchmark reads the trace's shapes and repeated blocks only, which a fake
    trace has the same (``tests/measure/test_fake_trace.py``): these are the times ``FakeTrace`` + "auto" gives."""
    timing = BenchmarkTiming()
    timed = with_timing(timing, None, planner.graph, planner.request, planner.trace, planner.costs)
    return Planner(planner.graph, timed.trace, timed.costs, planner.options, step=planner.request), timing


def plan_rows(
    case: zoo.ZooCase, planner: Planner, roofline: Planner, benchmark: Planner | None, rounds: int,
    fractions: tuple[float, ...] = FRACTIONS,
) -> list[PlanRow]:
    trace = planner.trace
    floor = planner.plan(budget_bytes=trace.baseline_peak_bytes).min_feasible_bytes
    rows = []
    for fraction in fractions:
        budget = int(floor + fraction * (trace.baseline_peak_bytes - floor))
        by_measured, by_roofline = planner.plan(budget_bytes=budget), roofline.plan(budget_bytes=budget)
        by_benchmark = benchmark.plan(budget_bytes=budget) if benchmark is not None else None
        same = by_measured.regions == by_roofline.regions and by_measured.planned_action == by_roofline.planned_action
        rescored = planner.plan_for_regions(by_roofline.regions, strategy="given", action=by_roofline.planned_action)
        # each distinct plan runs once in the alternating rounds (the unmodified model first)
        plans = [by_measured, by_roofline] + ([by_benchmark] if by_benchmark is not None else [])
        keys = [(tuple(p.regions), p.planned_action) for p in plans]
        distinct = list(dict.fromkeys(keys))
        modules = [case.model] + [planner.apply(plans[keys.index(key)]) for key in distinct]
        seconds = alternating_step_seconds(modules, case.args, case.kwargs, case.loss_fn or autockpt.measure.loss.default_loss,
                                           rounds=rounds)
        distinct_ratios = [statistics.median(t / b for t, b in zip(times, seconds[0])) for times in seconds[1:]]
        ratios = [distinct_ratios[distinct.index(key)] for key in keys]
        nan = float("nan")
        bench_rescored = (
            planner.plan_for_regions(by_benchmark.regions, strategy="given", action=by_benchmark.planned_action)
            if by_benchmark is not None else None
        )
        rows.append(PlanRow(
            model=case.name, fraction=fraction, budget_bytes=budget, same_plan=same,
            measured_regions=len(by_measured.regions), roofline_regions=len(by_roofline.regions),
            measured_action=by_measured.planned_action.value, roofline_action=by_roofline.planned_action.value,
            predicted_peak_measured=by_measured.predicted_peak_bytes,
            predicted_peak_roofline=by_roofline.predicted_peak_bytes,
            predicted_overhead_measured=by_measured.predicted_overhead,
            roofline_plan_by_measured_times=rescored.predicted_overhead,
            roofline_plan_by_roofline_times=by_roofline.predicted_overhead,
            step_ratio_measured_plan=ratios[0], step_ratio_roofline_plan=ratios[1],
            same_plan_benchmark=by_benchmark is not None and keys[2] == keys[0],
            benchmark_regions=len(by_benchmark.regions) if by_benchmark is not None else 0,
            benchmark_action=by_benchmark.planned_action.value if by_benchmark is not None else "",
            benchmark_plan_by_measured_times=bench_rescored.predicted_overhead if bench_rescored is not None else nan,
            step_ratio_benchmark_plan=ratios[2] if by_benchmark is not None else nan,
        ))
        print(rows[-1], flush=True)
    return rows


def markdown(time_rows: list[TimeRow], rows: list[PlanRow], spec: autockpt.DeviceSpec, seconds: float,
             command: str) -> str:
    peaks = ", ".join(f"{d} {t * 1e3:.0f} GFLOPS" for d, t in spec.peak_tflops)
    lines = [
        (f"`{command}` ({seconds:.0f} s; {spec.description}). The roofline is `{spec.name}` "
        f"{'from the table' if not spec.name.startswith('local-') else 'as `local_device_spec` calibrated it in this run'}"
        f": {peaks}, memory "
        f"{spec.hbm_gb_per_s:.1f} GB/s, {spec.op_overhead_us:.1f} us per op. Roofline step = 3 x roofline forward "
        "(backward twice forward); measured: the trace's timed steps (median of 3). Ratio = roofline / measured. "
        "Rank correlation: Spearman, unit forward times, units timed on their own. Bound: units whose roofline is "
        "set by memory / compute / op overhead. Benchmark (`BenchmarkTiming`, what a fake trace gets by default): "
        "each op run alone on random inputs at its shapes, forward and backward, median of 3, repeated blocks once; "
        "bench ratio = benchmark step / measured step; by roofline: ops that could not run alone."),
        "",
        ("| model | units | measured step ms | roofline step ms | step ratio | measured fwd ms | roofline fwd ms "
         "| fwd ratio | measured bwd / fwd | unit rank corr. | overhead share | bound mem / comp / ovh "
         "| bench step ms | bench ratio | bench fwd ms | bench rank corr. | bench by roofline | bench s |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in time_rows:
        lines.append(
            f"| {r.model} ({r.size}) | {r.units} | {r.measured_step_ms:.2f} | {r.roofline_step_ms:.2f} | "
            f"{r.step_ratio:.2f} | {r.measured_forward_ms:.2f} | {r.roofline_forward_ms:.2f} | {r.forward_ratio:.2f} | "
            f"{r.measured_backward_per_forward:.1f} | {r.unit_rank_correlation:.2f} | {r.overhead_share:.2f} | {r.memory_bound_units} / "
            f"{r.compute_bound_units} / {r.overhead_bound_units} | {r.benchmark_step_ms:.2f} | "
            f"{r.benchmark_step_ratio:.2f} | {r.benchmark_forward_ms:.2f} | {r.benchmark_unit_rank_correlation:.2f} | "
            f"{r.benchmark_ops_by_roofline} | {r.benchmark_seconds:.1f} |"
        )
    if rows:
        lines += [
            "",
            ("Plans at equal budgets (fraction of the way from the smallest feasible peak to the unmodified peak), one "
            "from measured times (m), one from roofline times (r) and one from benchmark times (b), same trace and "
            "solver. Same plan: r / b the same as m. Predicted overheads are fractions of the measured step (the "
            "roofline's and the benchmark's plans scored by the measured times too); measured: step time / "
            "unmodified step time, median of alternating rounds in one process."),
            "",
            ("| model | budget | same plan r / b | regions m / r / b | action m / r / b | predicted m | r plan, by "
             "measured times | b plan, by measured times | measured step ratio, m plan | r plan | b plan |"),
            "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        yes = {True: "yes", False: "no"}
        for p in rows:
            lines.append(
                f"| {p.model} | {p.fraction:.1f} ({p.budget_bytes}) | {yes[p.same_plan]} / {yes[p.same_plan_benchmark]} | "
                f"{p.measured_regions} / {p.roofline_regions} / {p.benchmark_regions} | "
                f"{p.measured_action} / {p.roofline_action} / {p.benchmark_action or '-'} | "
                f"{p.predicted_overhead_measured:+.3f} | {p.roofline_plan_by_measured_times:+.3f} | "
                f"{p.benchmark_plan_by_measured_times:+.3f} | {p.step_ratio_measured_plan:.3f} | "
                f"{p.step_ratio_roofline_plan:.3f} | {p.step_ratio_benchmark_plan:.3f} |"
            )
        lines += summary_lines(rows)
    return "\n".join(lines)


def summary_lines(rows: list[PlanRow]) -> list[str]:
    """Per timing (roofline, benchmark), how often it chose the measured times' plan and what its plans cost."""
    lines = []
    for label, same, ratio_of, predicted_of in (
        ("roofline", lambda p: p.same_plan, lambda p: p.step_ratio_roofline_plan,
         lambda p: p.roofline_plan_by_measured_times),
        ("benchmark", lambda p: p.same_plan_benchmark, lambda p: p.step_ratio_benchmark_plan,
         lambda p: p.benchmark_plan_by_measured_times),
    ):
        timed = [p for p in rows if not math.isnan(ratio_of(p))]
        differ = [p for p in timed if not same(p)]
        if not timed:
            continue
        if not differ:
            lines += ["", f"Summary, {label}: the same plan as the measured times at all {len(timed)} budgets."]
            continue
        ratio = math.exp(statistics.fmean(math.log(ratio_of(p) / p.step_ratio_measured_plan) for p in differ))
        lost = statistics.fmean(predicted_of(p) - p.predicted_overhead_measured for p in differ)
        worse = sum(ratio_of(p) > p.step_ratio_measured_plan for p in differ)
        lines += [
            "",
            (f"Summary, {label}: the same plan as the measured times at {len(timed) - len(differ)} of {len(timed)} "
            f"budgets. Where they differed ({len(differ)}), the {label}'s plan ran {100 * (ratio - 1):+.1f}% against "
            f"the measured-times plan (geometric mean of the measured step ratios; slower at {worse} of "
            f"{len(differ)}), and the measured times predicted it {100 * lost:+.1f} points of overhead worse on "
            "average."),
        ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/results/roofline"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--target", default=None, help="a table name: the roofline of that device instead")
    parser.add_argument("--models", default=",".join(f"{m}:{s}" for m, s in MODELS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-plans", action="store_true", help="step times only")
    parser.add_argument("--smoke", action="store_true",
                        help=f"check the script works: {SMOKE_MODELS}, 3 rounds, one budget; prints, writes nothing")
    args = parser.parse_args()
    fractions = FRACTIONS
    if args.smoke:
        args.models, args.rounds, fractions = SMOKE_MODELS, 3, (0.5,)
    started = time.perf_counter()
    if args.device == "cpu":
        # one thread: the models are small, and on a busy machine a second OpenMP thread's barrier waits made steps of
        # the same module vary tenfold between runs (the tests run one thread for the same reason)
        torch.set_num_threads(1)
    device = torch.device(args.device)
    spec = autockpt.core.devices.device_spec(args.target) if args.target else local_device_spec(device)
    time_rows, rows = [], []
    for item in args.models.split(","):
        name, size = item.split(":")
        case = zoo.build(name, size)
        case = zoo.ZooCase(
            name=case.name, model=case.model.to(device), loss_fn=case.loss_fn,
            args=tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in case.args),
            kwargs={k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.kwargs.items()},
        )
        planner = Planner.from_model(case.model, example_inputs=case.args, example_kwargs=case.kwargs,
                                     loss_fn=case.loss_fn, timing="measured")
        roofline = roofline_planner(planner, args.target)
        # the benchmark times this machine only: none against another device's table spec
        benchmark = benchmark_planner(planner) if args.target is None else None
        time_rows.append(time_row(case, size, planner, roofline, spec.name, benchmark))
        print(time_rows[-1], flush=True)
        if not args.no_plans:
            rows += plan_rows(case, planner, roofline, benchmark[0] if benchmark else None, args.rounds, fractions)
    if args.smoke:  # a check that the script runs, on whatever machine: no results written
        print(markdown(time_rows, rows, spec, time.perf_counter() - started, "python -m experiments.bench.bench_roofline --smoke"))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "roofline_times.csv", time_rows)
    if rows:
        write_csv(args.out / "roofline_plans.csv", rows)
    command = "python -m experiments.bench.bench_roofline " + " ".join(sys.argv[1:])
    text = markdown(time_rows, rows, spec, time.perf_counter() - started, command.strip())
    (args.out / "roofline.md").write_text(text + "\n")
    write_section("bench_roofline", text, output=args.out)
    print(text)


if __name__ == "__main__":
    main()
