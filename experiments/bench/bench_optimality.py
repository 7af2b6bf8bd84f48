"""Benchmark: how far is the production plan's recompute time from the exact optimum at the same budget?

For random small DAG programs (experiments/common/random_graphs.py) and a few small real graphs, at budgets a fraction of the way
from the production solver's memory floor to the unmodified peak, the production plan (``Planner.plan``) is compared
with ``autockpt.core.solve.exact.exact_regions`` (every set of checkpoint regions, cheapest first) on the same profile.
Both are scored by the simulator, so the ratio production_ms / exact_ms measures the solver alone.

Random graphs whose peak no region plan can lower (floor == unmodified peak) give nothing to compare; they are
written as rows with a reason and do not count towards ``--graphs``. Real graphs with more units than the exact
search handles are written as rows with the reason. Where the exact floor is below the production floor, one extra
row per graph ("between floors") records a budget that the production solver refuses although a plan fits.

    python -m experiments.bench.bench_optimality                        # 50 graphs, modelled costs
    python -m experiments.bench.bench_optimality --graphs 100 --costs measured --out /tmp/optimality

Writes ``NAME.csv``, ``NAME.md`` and the section ``bench_NAME`` of README.md into ``--out`` (default
``experiments/results/optimality``; ``--name`` default ``optimality``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import autockpt
from autockpt.core.solve.base import Scorer
from autockpt.core.solve.exact import exact_regions, min_peak_bytes
from autockpt.errors import InfeasibleBudgetError
from autockpt.measure.costs import free_machinery
from autockpt.present import zoo
from autockpt.types import Action, StepTrace
from experiments.common.random_graphs import random_model
from experiments.common.results_readme import RESULTS_DIR, write_section

DEFAULT_FRACTIONS = (0.2, 0.5, 0.8)
TOLERANCE = 0.01  # the target: within 1 % of the exact optimum


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    model: nn.Module
    args: tuple
    loss_fn: Callable[[Any], torch.Tensor] | None = None


class Attention(nn.Module):
    """One single-head self-attention sub-block with a residual, small enough for the exact search."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        scores = F.linear(self.q(h), self.k(h))  # q @ k.T in one op
        return x + self.proj(scores.softmax(dim=-1) @ self.v(h))


def modelled_times(trace: StepTrace) -> StepTrace:
    """``trace`` with forward times from a fixed cost model instead of the clock (memory as measured): 1 us per op,
    1 TFLOP/s, 100 GB/s for the op's outputs; backward twice the forward. The model of the optimality tests
    (``experiments/common/random_graphs.py``): measured times of microsecond ops on a shared CPU are mostly noise."""
    units = tuple(
        dataclasses.replace(u, forward_ms=1e-3 + u.flops * 1e-9 + u.output_bytes * 1e-8) for u in trace.units
    )
    forward_ms = sum(u.forward_ms for u in units)
    return dataclasses.replace(trace, units=units, forward_ms=forward_ms, step_ms=3 * forward_ms)


def real_cases() -> list[Case]:
    """Small real graphs: the zoo's tiny models (too many units for the exact search; recorded as skipped) and
    cut-down versions of the same architectures."""
    cases = []
    for name in ("mlp", "cnn", "transformer"):
        case = zoo.build(name, "tiny")
        cases.append(Case(name=f"zoo:{name}:tiny", model=case.model, args=case.args, loss_fn=case.loss_fn))
    torch.manual_seed(0)
    for depth in (5, 6):  # zoo's mlp layout (Linear + GELU blocks, a Linear head), fewer blocks
        layers: list[nn.Module] = [m for _ in range(depth) for m in (nn.Linear(128, 128), nn.GELU())]
        cases.append(Case(name=f"mlp-depth{depth}", model=nn.Sequential(*layers, nn.Linear(128, 10)),
                          args=(torch.randn(256, 128),)))
    # zoo's ResNet-style ConvNet with one block: BatchNorm, in-place ReLU and residual add (unsafe regions)
    cases.append(Case(name="convnet-1block", model=zoo.ConvNet(8, 1), args=(torch.randn(8, 3, 16, 16),),
                      loss_fn=lambda out: out.pow(2).mean()))
    cases.append(Case(name="attention", model=Attention(64), args=(torch.randn(128, 64),)))
    return cases


def evaluate(
    label: str, kind: str, case: Case, fractions: list[float], costs: str, max_units: int
) -> tuple[list[dict], str | None]:
    """Rows for one graph; the second value is why it gave no comparison (None when it did)."""
    # one action (torch's checkpoint): the exact solver scores plans with the same simulator and action
    action = Action.RECOMPUTE_TORCH
    planner = autockpt.Planner.from_model(case.model, example_inputs=case.args, loss_fn=case.loss_fn, checkpoint=action)
    if costs == "model":  # before the first plan: the solver sees these times, and the machinery priced at zero
        planner.trace = modelled_times(planner.trace)
        planner.costs = free_machinery(planner.costs)
    scorer = Scorer(planner.trace, planner.costs, action)
    units = len(planner.trace.units)
    common = {"kind": kind, "graph": label, "units": units}
    if units > max_units:
        reason = f"{units} units > max_units={max_units}: too many for the exact search"
        return [{**common, "skipped": reason}], reason
    try:
        planner.plan(budget_bytes=1)
        raise AssertionError("a 1-byte budget was accepted")
    except InfeasibleBudgetError as error:
        floor = error.min_feasible_bytes
    baseline = scorer.simulate(()).peak_bytes
    started = time.perf_counter()
    exact_floor = min_peak_bytes(scorer, max_units=max_units)
    floor_seconds = time.perf_counter() - started
    common |= {"production_floor": floor, "exact_floor": exact_floor, "baseline_peak": baseline,
               "exact_floor_seconds": round(floor_seconds, 3)}
    if exact_floor >= baseline:
        reason = "floor == unmodified peak: no region plan lowers the peak"
        return [{**common, "skipped": reason}], reason
    budgets = [(f"{f:g}", int(floor + f * (baseline - floor))) for f in fractions] if floor < baseline else []
    if exact_floor < floor:
        budgets.append(("between floors", (exact_floor + floor) // 2))
    reason = None if floor < baseline else "production floor == unmodified peak, but a region plan lowers the peak"
    rows = []
    for fraction, budget in budgets:
        started = time.perf_counter()
        exact = exact_regions(scorer, budget, max_units=max_units)
        exact_seconds = time.perf_counter() - started
        row = {**common, "fraction": fraction, "budget_bytes": budget, "exact_ms": exact.overhead_ms,
               "exact_peak": exact.peak_bytes, "exact_regions": _regions(exact.regions),
               "plans_examined": exact.plans_examined, "plans_simulated": exact.plans_simulated,
               "exact_seconds": round(exact_seconds, 4)}
        try:
            plan = planner.plan(budget_bytes=budget)
        except InfeasibleBudgetError:
            rows.append({**row, "skipped": "production solver refuses a budget that a region plan fits"})
            continue
        production_ms = scorer.simulate(plan.regions).overhead_ms  # the objective the exact search minimises
        rows.append({**row, "production_ms": production_ms, "ratio": ratio(production_ms, exact.overhead_ms),
                     "production_peak": plan.predicted_peak_bytes, "production_regions": _regions(plan.regions),
                     "production_status": plan.status.value,
                     "production_solve_seconds": round(plan.solve_time_s, 4)})
    if reason is not None:
        rows.append({**common, "skipped": reason})
    return rows, reason


def ratio(production_ms: float, exact_ms: float) -> float:
    if exact_ms > 0:
        return production_ms / exact_ms
    return 1.0 if production_ms <= 1e-9 else math.inf


def _regions(regions: tuple) -> str:
    return " ".join(f"{r.first_unit}-{r.last_unit}" for r in regions) or "-"


def summary_markdown(frame: pd.DataFrame, command: str, costs: str) -> str:
    compared = frame[frame["ratio"].notna() & (frame["fraction"] != "between floors")]
    cost_text = ("modelled (1 us per op + 1 TFLOP/s + 100 GB/s of outputs; memory as measured)" if costs == "model"
                 else "as measured (CPU, noisy)")
    lines = [
        "# Production plan vs exact optimum (recompute time at the same budget)",
        "",
        f"Command: `{command}`",
        "",
        (f"Forward times: {cost_text}. Both plans are scored by the simulator on the same profile. Budgets: the "
         "production floor (InfeasibleBudgetError.min_feasible_bytes) plus a fraction of the gap to the unmodified "
         "peak. ratio = production_ms / exact_ms (1.0 when both are 0); within 1 %: production_ms <= 1.01 * exact_ms "
         "+ 1e-9 ms."),
        "",
    ]
    for kind in ("random", "real"):
        part = compared[compared["kind"] == kind]
        if part.empty:
            continue
        ok = _within(part)
        ratios = sorted(part["ratio"])
        lines += [
            f"## {kind.capitalize()} graphs",
            "",
            "| cases | graphs | within 1 % | share | median ratio | p90 ratio | max ratio | production over budget |",
            "|---|---|---|---|---|---|---|---|",
            (f"| {len(part)} | {part['graph'].nunique()} | {int(ok.sum())} | {ok.mean():.1%} | "
             f"{statistics.median(ratios):.4f} | {_quantile(ratios, 0.9):.4f} | {ratios[-1]:.4f} | "
             f"{int((part['production_peak'] > part['budget_bytes']).sum())} |"),
            "",
        ]
        for fraction, group in part.groupby("fraction", sort=False):
            lines.append(f"- fraction {fraction}: {len(group)} cases, {int(_within(group).sum())} within 1 %, "
                         f"max ratio {group['ratio'].max():.4f}")
        lines.append("")
    worst = compared[~_within(compared)]
    lines += ["## Cases over 1 %", ""]
    if worst.empty:
        lines += ["None.", ""]
    else:
        lines += [("| graph | units | fraction | budget | exact ms | production ms | ratio | exact regions (peak) | "
                   "production regions (peak) |"), "|---|---|---|---|---|---|---|---|---|"]
        for _, row in worst.sort_values("ratio", ascending=False).iterrows():
            lines.append(
                f"| {row['graph']} | {row['units']} | {row['fraction']} | {int(row['budget_bytes'])} | "
                f"{row['exact_ms']:.5f} | {row['production_ms']:.5f} | {row['ratio']:.3f} | {row['exact_regions']} "
                f"({int(row['exact_peak'])}) | {row['production_regions']} ({int(row['production_peak'])}) |"
            )
        lines.append("")

    graphs = frame.dropna(subset=["exact_floor"]).drop_duplicates("graph")
    graphs = graphs[graphs["exact_floor"] < graphs["baseline_peak"]]
    above = graphs[graphs["production_floor"] > graphs["exact_floor"]]
    excess = (above["production_floor"] - above["exact_floor"]) / (above["baseline_peak"] - above["exact_floor"])
    lines += [
        "## Memory floor",
        "",
        f"Graphs where some region plan lowers the peak: {len(graphs)}. The production floor is above the exact floor "
        f"(smallest simulated peak of any region plan) in {len(above)} of them"
        + (f", by up to {excess.max():.0%} of the exact gap (exact floor to unmodified peak): "
           + ", ".join(f"{g} ({e:.0%})" for g, e in zip(above["graph"], excess))
           + ". Budgets between the two floors are refused by the production solver (InfeasibleBudgetError) although "
           "a region plan fits them; rows with fraction 'between floors' in the CSV" if len(above) else "")
        + ".",
        "",
    ]
    skipped = frame[frame["skipped"].notna() & frame["budget_bytes"].isna()]
    if len(skipped):
        lines += ["## Graphs without a comparison", ""]
        for reason, group in skipped.groupby("skipped"):
            names = ", ".join(group["graph"].astype(str))
            lines.append(f"- {reason}: {len(group)} ({names})")
        lines.append("")
    if len(compared):
        exact_s, production_s = compared["exact_seconds"], compared["production_solve_seconds"]
        lines += [
            "## Time",
            "",
            (f"Exact search: median {exact_s.median():.3f} s, max {exact_s.max():.2f} s, at most "
             f"{int(compared['plans_examined'].max())} region sets examined ({int(compared['plans_simulated'].max())} "
             f"simulated). Production solve: median {production_s.median():.3f} s, max {production_s.max():.2f} s."),
            "",
        ]
    return "\n".join(lines)


def _within(rows: pd.DataFrame) -> pd.Series:
    return rows["production_ms"] <= (1 + TOLERANCE) * rows["exact_ms"] + 1e-9


def _quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (works with inf)."""
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graphs", type=int, default=50, help="random graphs with a positive gap to compare")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--fractions", type=float, nargs="+", default=list(DEFAULT_FRACTIONS))
    parser.add_argument("--costs", choices=("model", "measured"), default="model",
                        help="forward times from the cost model (reproducible) or as measured (noisy on CPU)")
    parser.add_argument("--max-units", type=int, default=14)
    parser.add_argument("--no-real", action="store_true", help="random graphs only")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "optimality")
    parser.add_argument("--name", default="optimality", help="output files: NAME.csv and NAME.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")

    rows: list[dict] = []
    seed, compared, skipped = args.first_seed, 0, 0
    with tqdm(total=args.graphs, desc="random graphs", unit="graph") as progress:
        while compared < args.graphs:
            model, x = random_model(seed)
            torch.manual_seed(seed)
            graph_rows, reason = evaluate(f"seed {seed}", "random", Case(name=str(seed), model=model, args=(x,)),
                                          args.fractions, args.costs, args.max_units)
            for row in graph_rows:
                row["seed"] = seed
            rows += graph_rows
            if reason is None:
                compared += 1
                progress.update()
            else:
                skipped += 1
            progress.set_postfix(seed=seed, skipped=skipped)
            seed += 1
    if not args.no_real:
        for case in tqdm(real_cases(), desc="real graphs", unit="graph"):
            torch.manual_seed(0)
            graph_rows, _ = evaluate(case.name, "real", case, args.fractions, args.costs, args.max_units)
            rows += graph_rows

    frame = pd.DataFrame(rows)
    for column in ("skipped", "ratio", "production_ms", "fraction", "budget_bytes", "exact_floor"):
        if column not in frame:
            frame[column] = None
    columns = ["kind", "graph", "seed", "units", "fraction", "budget_bytes", "exact_ms", "production_ms", "ratio",
               "exact_peak", "production_peak", "plans_examined", "plans_simulated", "exact_seconds",
               "production_solve_seconds", "production_status", "exact_regions", "production_regions",
               "production_floor", "exact_floor", "baseline_peak", "exact_floor_seconds", "skipped"]
    frame = frame[[c for c in columns if c in frame] + [c for c in frame if c not in columns]]
    for column in ("seed", "units", "budget_bytes", "exact_peak", "production_peak", "plans_examined",
                   "plans_simulated", "production_floor", "exact_floor", "baseline_peak"):
        if column in frame:
            frame[column] = frame[column].astype("Int64")  # integers with gaps, not floats
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out / f"{args.name}.csv", index=False)
    command = "python -m experiments.bench.bench_optimality " + " ".join(sys.argv[1:] if argv is None else argv)
    (args.out / f"{args.name}.md").write_text(summary_markdown(frame, command.strip(), args.costs))
    write_section(f"bench_{args.name}", (args.out / f"{args.name}.md").read_text(), output=args.out)
    print((args.out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
