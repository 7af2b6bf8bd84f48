"""Sweep: models x budgets x strategies -> one tidy CSV, a Pareto plot per model, markdown tables, max batch sizes.

Strategies: autockpt (``Planner.optimize`` at each budget: plan, rewrite, measured verification) with its default
checkpoint choice ("auto": plans for torch's non-reentrant checkpoint and for autockpt's own, and keeps the faster
when both keep the budget), and the same with one checkpoint only: ``autockpt_torch`` and ``autockpt_function``; the
baseline policies of ``autockpt.core.solve.baselines`` (one point per model, whatever the budget; ``feasible`` says
whether it keeps each budget), and the external anchors of ``experiments/common/anchors.py`` (Hugging Face gradient
checkpointing, PyTorch's SAC MILP, torch.compile with an activation memory budget), each run for real or reported as
not available with the reason.

Budgets are fractions of the way from static memory (parameters, buffers, inputs, gradients) to the unmodified peak
of the captured graph, plus, for Hugging Face models, a budget equal to the measured peak of HF's own
``gradient_checkpointing_enable`` (label ``hf_peak``). Peaks are measured with MemTracker (``autockpt.measure_step``)
except torch.compile, measured with torch.profiler (column ``peak_method``). Step-time ratios are against ``none``
(the captured graph, rewritten with no region): every module of a model runs once per round in one process, one
warm-up round, then ``--repeats`` rounds; the ratio is the median over rounds of step time / ``none``'s step time in
the same round. torch.compile modules are timed in their own alternating loop right after compiling (a later
compile resets Dynamo's caches).

``--device cuda`` runs every model, input and strategy on the GPU; peaks are then ``torch.cuda.max_memory_allocated``
for every strategy, torch.compile included (column ``peak_method``). That counts everything the process holds on the
device, so the anchors' own copies of the model (HF's, SAC's) are moved to the CPU while any other strategy is
measured, and the previous model is garbage-collected before the next is built (column
``device_resident_before_bytes`` says what was still allocated then): each peak is its own step's.

    python -m experiments.bench.sweep                             # default CPU sweep (size "small")
    python -m experiments.bench.sweep --device cuda --size bench  # the same on a GPU, at the larger zoo size
    python -m experiments.bench.sweep --models gpt2,vit --fractions 0.4 --strategies autockpt,none,every_1 --out /tmp/s

Writes ``sweep.csv``, ``max_batch.csv``, ``pareto_<model>.png`` and ``sweep.md`` into ``--out``, and the section named
after the ``--out`` folder in that folder's README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import math
import platform
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

import autockpt
from autockpt.core.solve.base import AUTO_CHECKPOINT
from autockpt.core.solve.baselines import BASELINE_STRATEGIES, baseline_regions
from autockpt.planning.batch_size import ExampleBatch, TrialOutcome, max_batch_sizes
from autockpt.planning.planner import Planner, baseline_plan
from autockpt.present import zoo
from autockpt.types import Action
from experiments.common import anchors
from experiments.common.results_readme import markdown_table, write_section
from experiments.common.timing import round_robin_ratios, step_time_ratio

logger = logging.getLogger("sweep")

# autockpt's plans: the default choice of checkpoint, and each recompute action the rewriter can apply alone
AUTOCKPT_STRATEGIES: dict[str, Action | str] = {
    "autockpt": AUTO_CHECKPOINT,
    "autockpt_torch": Action.RECOMPUTE_TORCH,
    "autockpt_function": Action.RECOMPUTE_OWN,
}
# "transformer" (the plain 8-layer fx model at size small) is left out of the default: its 308-unit graph and 0.9 s
# steps cost as much sweep time as the other models together on 2 cores; run it with --models transformer
DEFAULT_MODELS = ("mlp", "cnn", "control_flow", "gpt2", "vit", "unet")
DEFAULT_FRACTIONS = (0.3, 0.5, 0.7)
ANCHORS = {"hf": "hf_gradient_checkpointing", "sac": "torch_sac_milp", "compile": "torch_compile_budget"}
DEFAULT_BATCH_MODELS = DEFAULT_MODELS
DEFAULT_BATCH_STRATEGIES = ("autockpt", "none", "every_1", "sqrt_n", "for_transformers", "for_convnets")
MB = 10**6


@dataclass(kw_only=True)
class Point:
    """One measured (or not available) configuration of one model."""

    strategy: str
    budget_label: str = ""  # "" for baselines (budget-independent); the budget it was made for otherwise
    budget_bytes: int | None = None
    status: str = "measured"  # measured | infeasible | unavailable
    module: nn.Module | None = None
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    measured_reserved_bytes: int | None = None  # CUDA: torch.cuda.max_memory_reserved of the measured step; None on CPU
    peak_method: str = "memtracker"
    step_time_ratio: float | None = None
    predicted_ratio: float | None = None  # 1 + the plan's predicted overhead (autockpt's plans and the baselines)
    solve_s: float | None = None
    regions: int | None = None
    capture: str = ""
    checkpoint: str = ""  # autockpt's plans: the recompute action the plan runs with
    notes: str = ""
    same_as: str = ""  # a baseline with exactly the regions of an earlier one is measured once
    eager_profiler_peak_bytes: int | None = None


# ------------------------------------------------------------------------------------------------ inputs


def rebatch(case: zoo.ZooCase, batch: int) -> ExampleBatch:
    """The case's inputs at another batch size: every tensor whose first dimension is the case's batch is tiled or
    cut along it, in the arguments and in tensors the loss function holds (e.g. language-model labels)."""
    original = _batch_of(case)

    def resize(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == original:
            repeats = math.ceil(batch / original)
            return value.repeat(repeats, *([1] * (value.dim() - 1)))[:batch].clone()
        return value

    return _map_inputs(case, resize)


def on_device(case: zoo.ZooCase, device: torch.device) -> zoo.ZooCase:
    """The case with its model, inputs and the tensors its loss function holds on ``device``."""
    if device.type == "cpu":
        return case
    moved = _map_inputs(case, lambda value: value.to(device) if isinstance(value, torch.Tensor) else value)
    return dataclasses.replace(case, model=case.model.to(device), args=moved.args, kwargs=moved.kwargs,
                               loss_fn=moved.loss_fn)


def _map_inputs(case: zoo.ZooCase, change: Callable[[Any], Any]) -> ExampleBatch:
    """``change`` applied to every leaf of the case's inputs and to the cells of its loss function's closure."""
    args = tuple(torch.utils._pytree.tree_map(change, case.args))
    kwargs = torch.utils._pytree.tree_map(change, dict(case.kwargs))
    loss_fn = case.loss_fn
    if isinstance(loss_fn, types.FunctionType) and loss_fn.__closure__:
        cells = tuple(types.CellType(change(c.cell_contents)) for c in loss_fn.__closure__)
        loss_fn = types.FunctionType(loss_fn.__code__, loss_fn.__globals__, loss_fn.__name__, loss_fn.__defaults__, cells)
    return ExampleBatch(args=args, kwargs=kwargs, loss_fn=loss_fn)


@contextlib.contextmanager
def parked(copies: Sequence[nn.Module], device: torch.device) -> Iterator[None]:
    """On CUDA a measured peak counts everything the process holds on the device, so the anchors' own copies of the
    model (and their gradients) wait on the CPU while another strategy is measured."""
    if device.type != "cuda" or not copies:
        yield
        return
    for copy_ in copies:
        copy_.to("cpu")
    try:
        yield
    finally:
        for copy_ in copies:
            copy_.to(device)


def _batch_of(case: zoo.ZooCase) -> int:
    leaves = [t for t in torch.utils._pytree.tree_leaves((case.args, case.kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not leaves:
        raise ValueError(f"zoo case {case.name} has no tensor input with a batch dimension")
    return int(leaves[0].shape[0])


# ------------------------------------------------------------------------------------------------ one model


@dataclass(kw_only=True)
class SweepConfig:
    models: tuple[str, ...] = DEFAULT_MODELS
    size: str = "small"
    fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    strategies: tuple[str, ...] = (*AUTOCKPT_STRATEGIES, *BASELINE_STRATEGIES)
    anchors: tuple[str, ...] = tuple(ANCHORS)
    sac_fractions: tuple[float, ...] = (0.5,)
    compile_models: tuple[str, ...] = ("gpt2",)
    compile_fractions: tuple[float, ...] = (0.5,)
    repeats: int = 5
    batch_models: tuple[str, ...] = DEFAULT_BATCH_MODELS
    batch_strategies: tuple[str, ...] = DEFAULT_BATCH_STRATEGIES
    out: Path = Path("experiments/results/sweep")
    quiet: bool = False
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))


def sweep_model(name: str, config: SweepConfig, bar: tqdm) -> tuple[list[Point], dict[str, int]]:
    """Measure every strategy on one zoo model; returns the points and the budgets (label -> bytes)."""
    torch.manual_seed(0)
    case = on_device(zoo.build(name, config.size), config.device)
    step_peak_method = anchors.step_peak_method(case.model).value
    batch = ExampleBatch(args=case.args, kwargs=case.kwargs, loss_fn=case.loss_fn)
    bar.set_postfix_str(f"{name}: capture + profile")
    planner = Planner.from_model(case.model, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn)
    trace = planner.trace
    capture = planner.graph.kind.value
    budgets = {
        f"{f:.2f}": int(trace.static_bytes + f * (trace.baseline_peak_bytes - trace.static_bytes))
        for f in config.fractions
    }
    points: list[Point] = []
    eager: dict[str, nn.Module] = {}
    anchor_copies: list[nn.Module] = []  # deep copies of the model the anchors made (parked while others are measured)

    reserved: list[int | None] = [None]  # the last measured step's reserved bytes (CUDA)

    def measure(module: nn.Module) -> int:
        measurement = autockpt.measure_step(module, case.args, case.kwargs, case.loss_fn)
        peak, reserved[0] = measurement.peak_bytes, measurement.reserved_bytes
        if measurement.reserved_bytes is not None:
            logger.info("%s: measured %d bytes allocated, %d reserved", name, peak, measurement.reserved_bytes)
        # the gradients it leaves are on the model's own parameters (plans share them): on CUDA a later profile or
        # verification would count them as memory the process holds
        module.zero_grad(set_to_none=True)
        return peak

    # baselines (budget-independent)
    seen: dict[tuple, str] = {}
    for strategy in [s for s in config.strategies if s not in AUTOCKPT_STRATEGIES]:
        bar.set_postfix_str(f"{name}: {strategy}")
        chosen = baseline_regions(planner.graph, trace, strategy)
        if not chosen.available:
            points.append(Point(strategy=strategy, status="unavailable", capture=capture, notes="; ".join(chosen.notes)))
            continue
        key = tuple((r.first_unit, r.last_unit) for r in chosen.regions)
        the_plan = baseline_plan(planner, strategy)
        point = Point(
            strategy=strategy, predicted_peak_bytes=the_plan.predicted_peak_bytes, regions=len(the_plan.regions),
            peak_method=step_peak_method,
            predicted_ratio=1 + the_plan.predicted_overhead, solve_s=0.0, capture=capture, notes="; ".join(chosen.notes),
        )
        if key in seen:
            twin = next(p for p in points if p.strategy == seen[key])
            point.measured_peak_bytes, point.same_as = twin.measured_peak_bytes, seen[key]
            point.measured_reserved_bytes = twin.measured_reserved_bytes
        else:
            module = planner.apply(the_plan)
            point.measured_peak_bytes = measure(module)
            point.measured_reserved_bytes = reserved[0]
            point.module = eager[strategy] = module
            seen[key] = strategy
        points.append(point)
    if "none" not in eager:  # the timing reference
        none_plan = baseline_plan(planner, "none")
        eager["none"] = planner.apply(none_plan)
    eager["original"] = case.model
    points.append(Point(strategy="original", measured_peak_bytes=measure(case.model), capture="eager", solve_s=0.0,
                        peak_method=step_peak_method,
                        notes="the model itself, not captured (timing reference for the anchors)"))
    points[-1].module = case.model
    points[-1].measured_reserved_bytes = reserved[0]

    # Hugging Face anchor, and its budget
    if "hf" in config.anchors:
        bar.set_postfix_str(f"{name}: HF gradient checkpointing")
        result = anchors.hf_gradient_checkpointing(case.model, case.args, case.kwargs, case.loss_fn)
        points.append(_anchor_point(result, capture="eager"))
        if result.module is not None:
            eager[result.strategy] = result.module
            anchor_copies.append(result.module)
            budgets["hf_peak"] = result.measured_peak_bytes

    # autockpt at every budget: its default checkpoint choice (the planner above), and each checkpoint alone
    for strategy in [s for s in AUTOCKPT_STRATEGIES if s in config.strategies]:
        checkpoint = AUTOCKPT_STRATEGIES[strategy]
        if checkpoint != AUTO_CHECKPOINT:
            bar.set_postfix_str(f"{name}: profile for {strategy}")
            with parked(anchor_copies, config.device):  # the profile counts what the device holds besides the step
                planner_for = Planner.from_model(case.model, example_inputs=case.args, example_kwargs=case.kwargs,
                                      loss_fn=case.loss_fn, checkpoint=checkpoint)
        else:
            planner_for = planner
        for label, budget in budgets.items():
            bar.set_postfix_str(f"{name}: {strategy} @ {label}")
            started = time.perf_counter()
            try:
                with parked(anchor_copies, config.device):
                    module = planner_for.optimize(budget_bytes=budget)
            except autockpt.InfeasibleBudgetError as error:
                points.append(Point(strategy=strategy, budget_label=label, budget_bytes=budget, status="infeasible",
                                    capture=capture, notes=f"InfeasibleBudgetError, min feasible {error.min_feasible_bytes} bytes"))
                continue
            plan = module.plan
            reserved[0] = plan.measured_reserved_bytes
            peak = plan.measured_peak_bytes if plan.measured_peak_bytes is not None else measure(module)
            if plan.measured_reserved_bytes is not None:
                logger.info("%s %s @ %s: measured %d bytes allocated, %d reserved", name, strategy, label, peak,
                            plan.measured_reserved_bytes)
            point = Point(
                strategy=strategy, budget_label=label, budget_bytes=budget, module=module,
                predicted_peak_bytes=plan.predicted_peak_bytes, measured_peak_bytes=peak, regions=len(plan.regions),
                predicted_ratio=1 + plan.predicted_overhead, solve_s=plan.solve_time_s, capture=capture,
                peak_method=step_peak_method, checkpoint=plan.planned_action.value, measured_reserved_bytes=reserved[0],
                notes=f"{plan.status.value}; optimize {time.perf_counter() - started:.1f} s",
            )
            points.append(point)
            eager[f"{strategy}@{label}"] = module

    # PyTorch SAC MILP
    if "sac" in config.anchors:
        for fraction in config.sac_fractions:
            label = f"{fraction:.2f}"
            budget = budgets.get(label) or int(trace.static_bytes + fraction * (trace.baseline_peak_bytes - trace.static_bytes))
            bar.set_postfix_str(f"{name}: SAC MILP @ {label}")
            with parked(anchor_copies, config.device):
                result = anchors.torch_sac_milp(case.model, case.args, case.kwargs, case.loss_fn, budget_bytes=budget)
            point = _anchor_point(result, capture="eager", label=label, budget=budget)
            points.append(point)
            if result.module is not None:
                eager[f"{result.strategy}@{label}"] = result.module
                anchor_copies.append(result.module)

    # timing of every eager module, round robin
    bar.set_postfix_str(f"{name}: timing {len(eager)} modules x {config.repeats + 1} rounds")
    ratios = round_robin_ratios(eager, "none", batch, config.repeats)
    by_key = {id(module): key for key, module in eager.items()}
    for point in points:
        if point.module is not None and id(point.module) in by_key:
            point.step_time_ratio = ratios[by_key[id(point.module)]]
    for point in points:
        if point.same_as:
            point.step_time_ratio = next(p.step_time_ratio for p in points if p.strategy == point.same_as)

    # torch.compile, timed on its own right after compiling
    if "compile" in config.anchors:
        fractions = config.compile_fractions if name in config.compile_models else ()
        if not fractions:
            points.append(Point(strategy="torch_compile_budget", status="unavailable", capture="compiled",
                                notes=f"not run by default for {name}: compilation takes about a minute per budget "
                                      "(add it with --compile-models)"))
        for fraction in fractions:
            label = f"{fraction:.2f}"
            bar.set_postfix_str(f"{name}: torch.compile @ {label}")
            case.model.zero_grad(set_to_none=True)  # the timing rounds left gradients; the compiled copy starts without
            with parked(anchor_copies, config.device):
                result = anchors.torch_compile_budget(case.model, case.args, case.kwargs, case.loss_fn,
                                                      fraction=fraction)
            point = _anchor_point(result, capture="compiled", label=label, budget=budgets.get(label))
            if result.module is not None:
                point.step_time_ratio = step_time_ratio(result.module, eager["none"], batch, config.repeats)
                point.module = None
            points.append(point)
            torch._dynamo.reset()
    for point in points:
        point.module = None
    eager.clear()
    anchor_copies.clear()
    return points, budgets


def free_previous_model(device: torch.device) -> int | None:
    """Collect what the previous model left and return the bytes still allocated on a CUDA ``device`` (None on CPU).

    The planners, captured graphs and models of a finished model sit in reference cycles that only the garbage
    collector frees, at a moment of its choosing: on CUDA, where every measurement counts all the process holds on the
    device, an H100 sweep counted GPT-2's 93 MB of parameters in ViT's first profile and in its baseline peaks. Called
    after ``sweep_model`` has returned (its own frame holds the model until then).
    """
    torch._dynamo.reset()  # the compile anchor's graphs: 69 MB stayed allocated after GPT-2's on an H100 (2026-11-24)
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    # a cache warm from the previous model hands out blocks whole (up to 1 MB above a request, not split): the same
    # H100 run measured ViT 3.7 % above its prediction after GPT-2, bench_cuda_prediction 0 % after empty_cache()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def _anchor_point(result: anchors.AnchorResult, *, capture: str, label: str = "", budget: int | None = None) -> Point:
    notes = "; ".join(result.notes) if result.status is anchors.AnchorStatus.MEASURED else f"not available: {result.reason}"
    if result.status is anchors.AnchorStatus.INFEASIBLE:
        notes = result.reason
    return Point(
        strategy=result.strategy, budget_label=label, budget_bytes=budget, status=result.status.value,
        module=result.module, predicted_peak_bytes=result.predicted_peak_bytes,
        measured_peak_bytes=result.measured_peak_bytes, peak_method=result.peak_method.value,
        solve_s=result.solve_time_s, capture=capture, notes=notes,
        eager_profiler_peak_bytes=result.eager_profiler_peak_bytes,
    )


def tidy_rows(name: str, points: list[Point], budgets: dict[str, int]) -> list[dict[str, Any]]:
    """models x budgets x strategies: a budget-independent point appears under every budget."""
    rows = []
    extra = {p.budget_label: p.budget_bytes for p in points if p.budget_label and p.budget_label not in budgets}
    for label, budget in {**budgets, **extra}.items():
        for point in points:
            if point.budget_label != label and (point.budget_label or label in extra):
                continue
            measured = point.measured_peak_bytes
            row = {
                "model": name, "budget": label, "budget_bytes": budget, "strategy": point.strategy,
                "status": point.status, "capture": point.capture, "checkpoint": point.checkpoint, "regions": point.regions,
                "predicted_peak_bytes": point.predicted_peak_bytes, "measured_peak_bytes": measured,
                "measured_reserved_bytes": point.measured_reserved_bytes,
                "peak_method": point.peak_method, "step_time_ratio": point.step_time_ratio,
                "predicted_ratio": point.predicted_ratio,
                "solve_s": point.solve_s,
                "feasible": (measured <= budget) if point.status == "measured" and measured is not None else None,
                "budget_specific": bool(point.budget_label), "same_as": point.same_as,
                "eager_profiler_peak_bytes": point.eager_profiler_peak_bytes, "notes": point.notes,
            }
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ analysis


def unique_points(table: pd.DataFrame) -> pd.DataFrame:
    """One row per measured configuration (a baseline appears once, autockpt once per budget)."""
    measured = table[(table.status == "measured") & table.measured_peak_bytes.notna() & table.step_time_ratio.notna()]
    labels = [f"{s}@{b}" if specific else s for s, b, specific in zip(measured.strategy, measured.budget, measured.budget_specific)]
    measured = measured.assign(point=labels)
    return measured.drop_duplicates(subset=["model", "point"])


def dominated_autockpt(points: pd.DataFrame) -> pd.DataFrame:
    """autockpt points (every autockpt strategy) some other strategy beats on both measured peak and step time (strictly)."""
    rows = []
    ours = points.strategy.isin(list(AUTOCKPT_STRATEGIES))
    for _, p in points[ours].iterrows():
        others = points[(points.model == p.model) & ~ours & (points.strategy != "original")]
        better = others[(others.measured_peak_bytes < p.measured_peak_bytes) & (others.step_time_ratio < p.step_time_ratio)]
        for _, q in better.iterrows():
            rows.append({"model": p.model, "strategy": p.strategy, "autockpt_budget": p.budget, "autockpt_peak_bytes": int(p.measured_peak_bytes),
                         "autockpt_ratio": p.step_time_ratio, "by": q.point, "by_peak_bytes": int(q.measured_peak_bytes),
                         "by_ratio": q.step_time_ratio, "peak_method": q.peak_method})
    return pd.DataFrame(rows)


def hf_target(points: pd.DataFrame) -> pd.DataFrame:
    """At a budget equal to HF's measured peak: autockpt's overhead vs HF's (both against ``none``, and HF also
    against the original eager model)."""
    rows = []
    for (model, strategy), group in points.groupby(["model", "strategy"]):
        if strategy not in AUTOCKPT_STRATEGIES:
            continue
        everything = points[points.model == model]
        hf = everything[everything.strategy == "hf_gradient_checkpointing"]
        ours = group[group.budget == "hf_peak"]
        original = everything[everything.strategy == "original"]
        if hf.empty or ours.empty or ours.step_time_ratio.isna().all():
            continue
        hf_ratio, our_ratio = float(hf.step_time_ratio.iloc[0]), float(ours.step_time_ratio.iloc[0])
        orig_ratio = float(original.step_time_ratio.iloc[0]) if not original.empty else float("nan")
        rows.append({
            "model": model, "strategy": strategy,
            "checkpoint": ours.checkpoint.iloc[0] if "checkpoint" in ours else "",  # older CSVs lack the column
            "hf_peak_bytes": int(hf.measured_peak_bytes.iloc[0]),
            "autockpt_peak_bytes": int(ours.measured_peak_bytes.iloc[0]),
            "hf_overhead": hf_ratio - 1, "autockpt_overhead": our_ratio - 1,
            "hf_overhead_vs_original": hf_ratio / orig_ratio - 1,
            "met": (our_ratio - 1) <= 0.5 * max(hf_ratio - 1, 0.0),
        })
    return pd.DataFrame(rows)


def pareto_plot(points: pd.DataFrame, model: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    group = points[points.model == model]
    markers = "o^sDvP*XhH<>p8"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (strategy, sub) in enumerate(group.groupby("strategy", sort=False)):
        ours = strategy in AUTOCKPT_STRATEGIES
        style = {"marker": markers[i % len(markers)], "s": 90 if ours else 55}
        if ours:
            style.update(color={"autockpt": "black", "autockpt_torch": "tab:blue"}.get(strategy, "tab:red"), zorder=3)
        ax.scatter(sub.measured_peak_bytes / MB, sub.step_time_ratio, label=strategy, **style)
        if ours:
            for _, row in sub.iterrows():
                ax.annotate(row.budget, (row.measured_peak_bytes / MB, row.step_time_ratio), fontsize=7,
                            xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("measured peak (MB = 10^6 bytes)")
    ax.set_ylabel("step time / none (median of alternating rounds)")
    ax.set_title(f"{model}: measured peak vs step time (lower-left is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ max batch


def max_batch_table(config: SweepConfig, bar: tqdm) -> pd.DataFrame:
    rows: list[dict[str, Any]] = []
    for name in config.batch_models:
        free_previous_model(config.device)  # after max_batch_rows has returned: its frame held the previous model
        rows += max_batch_rows(name, config, bar)
        bar.update(1)
        pd.DataFrame(rows).to_csv(config.out / "max_batch.csv", index=False)  # partial results survive a crash
    return pd.DataFrame(rows)


def max_batch_rows(name: str, config: SweepConfig, bar: tqdm) -> list[dict[str, Any]]:
    """One row per batch strategy: the largest batch of ``name`` whose step measures under the zoo batch's peak."""
    case = on_device(zoo.build(name, config.size), config.device)
    batch0 = _batch_of(case)
    budget = autockpt.measure_step(case.model, case.args, case.kwargs, case.loss_fn).peak_bytes
    precision = 1 if batch0 <= 8 else batch0 // 8
    bar.set_postfix_str(f"max batch: {name}")

    def on_trial(trial: Any) -> None:
        bar.set_postfix_str(f"max batch: {name} {trial.strategy} batch {trial.batch_size}: {trial.outcome.value}")

    started = time.perf_counter()
    results = max_batch_sizes(
        lambda: case.model, lambda n: rebatch(case, n), budget_bytes=budget, strategies=config.batch_strategies,
        start=batch0, precision=precision, on_trial=on_trial,
    )
    logger.info("max batch %s: %.0f s", name, time.perf_counter() - started)
    return [
        {
            "model": name, "budget_bytes": budget, "zoo_batch": batch0, "strategy": strategy,
            "max_batch": result.batch_size, "first_over_batch": result.first_over_batch,
            "measured_peak_bytes": result.measured_peak_bytes, "trials": len(result.trials), "precision": precision,
            "last_outcome": result.trials[-1].outcome.value, "last_detail": result.trials[-1].detail,
        }
        for strategy, result in results.items()
    ]


# ------------------------------------------------------------------------------------------------ main


def run(config: SweepConfig) -> dict[str, Path]:
    config.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    total = len(config.models) + len(config.batch_models)
    with tqdm(total=total, desc="sweep", unit="step", disable=True if config.quiet else None, file=sys.stderr) as bar:
        for name in config.models:
            model_started = time.perf_counter()
            resident_bytes = free_previous_model(config.device)
            if resident_bytes is not None:
                logger.info("%s: %d bytes allocated on %s before the model is built",
                            name, resident_bytes, config.device)
            points, budgets = sweep_model(name, config, bar)
            rows += [{**row, "device_resident_before_bytes": resident_bytes}
                     for row in tidy_rows(name, points, budgets)]
            bar.update(1)
            logger.info("%s: %.0f s", name, time.perf_counter() - model_started)
            pd.DataFrame(rows).to_csv(config.out / "sweep.csv", index=False)  # partial results survive a crash
        batch_table = max_batch_table(config, bar) if config.batch_models else pd.DataFrame()
    table = pd.DataFrame(rows)
    paths = {"csv": config.out / "sweep.csv"}
    table.to_csv(paths["csv"], index=False)
    if not batch_table.empty:
        paths["max_batch"] = config.out / "max_batch.csv"
        batch_table.to_csv(paths["max_batch"], index=False)
    points = unique_points(table) if not table.empty else table  # empty: a max-batch-only run (--models "")
    for model in config.models:
        paths[f"png_{model}"] = config.out / f"pareto_{model}.png"
        pareto_plot(points, model, paths[f"png_{model}"])
    wall_s = time.perf_counter() - started
    paths["md"] = config.out / "sweep.md"
    paths["md"].write_text(report(config, table, points, batch_table, wall_s))
    write_section(config.out.name, paths["md"].read_text(), output=config.out)
    print(f"wrote {', '.join(str(p) for p in paths.values())} in {wall_s:.0f} s", file=sys.stderr)
    return paths


def report(config: SweepConfig, table: pd.DataFrame, points: pd.DataFrame, batch_table: pd.DataFrame, wall_s: float,
           command: str | None = None, machine: str | None = None) -> str:
    """The markdown report; ``command`` and ``machine`` default to this process's (rerender passes the original
    run's)."""
    argv = " ".join(sys.argv[1:])
    command = command or f"python -m experiments.bench.sweep{(' ' + argv) if argv else ''}"
    machine = machine or (f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
                          f"Python {platform.python_version()}; device {_device_name(config.device)}")
    lines = [
        "# autockpt sweep",
        "",
        f"Command: `{command}`; wall time {wall_s:.0f} s.",
        (f"Machine: {machine}. Peaks in bytes (MB = 10^6); "
         f"step-time ratio vs `none`, median of {config.repeats} alternating rounds."),
        "",
    ]
    if not table.empty:
        lines += sweep_sections(table, points)
    if not batch_table.empty:
        # 0 because the policy has no plan for the model (e.g. sqrt_n on a module-level capture) is not a measurement;
        # CSVs written before the outcome was recorded (rerender) show the bare numbers
        outcomes = batch_table.get("last_outcome", pd.Series([None] * len(batch_table), index=batch_table.index))
        shown = batch_table.assign(max_batch=[
            "n/a" if batch == 0 and outcome == TrialOutcome.INFEASIBLE.value else str(batch)
            for batch, outcome in zip(batch_table.max_batch, outcomes)
        ])
        pivot = shown.pivot_table(index="model", columns="strategy", values="max_batch", aggfunc="first").reset_index()
        lines += ["", "## Max batch size under a fixed budget (the unmodified model's measured peak at the zoo batch)", "",
                  markdown_table(pivot)]
    return "\n".join(lines) + "\n"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def sweep_sections(table: pd.DataFrame, points: pd.DataFrame) -> list[str]:
    """The measured points, what was not measured, which budgets are kept, and the targets."""
    lines = ["", "## Measured points", ""]
    show = points.assign(measured_MB=points.measured_peak_bytes / MB, predicted_MB=points.predicted_peak_bytes / MB,
                         reserved_MB=points.reindex(columns=["measured_reserved_bytes"]).iloc[:, 0] / MB)
    columns = ["model", "point", "capture", "checkpoint", "regions", "predicted_MB", "measured_MB", "reserved_MB",
               "peak_method", "predicted_ratio", "step_time_ratio", "solve_s"]
    lines.append(markdown_table(show.reindex(columns=columns)))  # reindex: CSVs written before a column lack it
    missing = table[table.status != "measured"].drop_duplicates(subset=["model", "strategy", "status", "notes"])
    if not missing.empty:
        lines += ["", "## Not measured", "", markdown_table(missing[["model", "strategy", "budget", "status", "notes"]])]
    keeps = table.assign(keeps=[("yes" if f in (True, "True") else "no") if s == "measured" else "n/a"
                                 for f, s in zip(table.feasible, table.status)])
    feasible = keeps.pivot_table(index=["model", "budget"], columns="strategy", values="keeps", aggfunc="first")
    lines += ["", "## Which strategy keeps which budget (measured peak <= budget; n/a: not measured)", "",
              markdown_table(feasible.reset_index().fillna("n/a"))]
    target = hf_target(points)
    lines += ["", "## Target: autockpt overhead at HF's measured peak <= half of HF's", ""]
    lines.append(markdown_table(target) if not target.empty else "no Hugging Face model in this sweep")
    dominated = dominated_autockpt(points)
    lines += ["", "## autockpt points dominated by another strategy (lower measured peak and lower step time)", ""]
    lines.append(markdown_table(dominated) if not dominated.empty else "none")
    return lines


def rerender(out: Path, config: SweepConfig, command: str, wall_s: float, machine: str | None = None) -> None:
    """Rewrite the plots and markdown of a finished sweep from its CSVs (no measurement), e.g. for a sweep run on a GPU
    machine whose markdown did not come back; ``machine`` then describes that machine, not this one."""
    table = pd.read_csv(out / "sweep.csv")
    batch_path = out / "max_batch.csv"
    batch_table = pd.read_csv(batch_path) if batch_path.exists() else pd.DataFrame()
    points = unique_points(table)
    for model in table.model.unique():
        pareto_plot(points, model, out / f"pareto_{model}.png")
    (out / "sweep.md").write_text(report(config, table, points, batch_table, wall_s, command=command, machine=machine))
    write_section(out.name, (out / "sweep.md").read_text(), output=out)


def parse_args(argv: Sequence[str] | None = None) -> SweepConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"zoo models ({', '.join(sorted(zoo.BUILDERS))})")
    parser.add_argument("--size", default="small", choices=zoo.SIZES)
    parser.add_argument("--fractions", default=",".join(map(str, DEFAULT_FRACTIONS)),
                        help="budgets as fractions from static memory to the unmodified peak")
    parser.add_argument("--strategies", default=",".join((*AUTOCKPT_STRATEGIES, *BASELINE_STRATEGIES)))
    parser.add_argument("--anchors", default=",".join(ANCHORS), help="hf, sac, compile (empty: none)")
    parser.add_argument("--sac-fractions", default="0.5")
    parser.add_argument("--compile-models", default="gpt2")
    parser.add_argument("--compile-fractions", default="0.5")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-models", default=",".join(DEFAULT_BATCH_MODELS), help="models for the max-batch table (empty: skip)")
    parser.add_argument("--batch-strategies", default=",".join(DEFAULT_BATCH_STRATEGIES))
    parser.add_argument("--out", default="experiments/results/sweep")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--device", default="cpu", help="device to run every model on: cpu, cuda, cuda:1")
    args = parser.parse_args(argv)

    def names(text: str) -> tuple[str, ...]:
        return tuple(part for part in text.split(",") if part)

    config = SweepConfig(
        models=names(args.models), size=args.size, fractions=tuple(float(f) for f in names(args.fractions)),
        strategies=names(args.strategies), anchors=names(args.anchors),
        sac_fractions=tuple(float(f) for f in names(args.sac_fractions)), compile_models=names(args.compile_models),
        compile_fractions=tuple(float(f) for f in names(args.compile_fractions)), repeats=args.repeats,
        batch_models=names(args.batch_models), batch_strategies=names(args.batch_strategies), out=Path(args.out),
        quiet=args.quiet, device=_parse_device(parser, args.device),
    )
    for model in (*config.models, *config.batch_models):
        if model not in zoo.BUILDERS:
            parser.error(f"unknown model {model!r}; choose from {', '.join(sorted(zoo.BUILDERS))}")
    unknown = [a for a in config.anchors if a not in ANCHORS]
    if unknown:
        parser.error(f"unknown anchors {unknown}; choose from {', '.join(ANCHORS)}")
    if config.repeats < 5:
        logger.warning("--repeats %d: the project's standard is a median of at least 5", config.repeats)
    return config


def _parse_device(parser: argparse.ArgumentParser, text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError as error:
        parser.error(f"--device {text!r} is not a torch device ({error}); give cpu, cuda or cuda:N")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {text!r}: the sweep runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {text!r}: this torch build sees no CUDA device (torch {torch.__version__}); "
                     "run on a machine with a GPU and a CUDA build of torch, or give --device cpu")
    return device


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("sweep").setLevel(logging.INFO)
    run(parse_args(argv))


if __name__ == "__main__":
    main()
