"""Scaling benchmark: how planning time, planner memory and plan quality grow with model depth.

GPT-2-style models of 6, 12, 24, 48 layers, Hugging Face Llama models of 12 and 48 layers and a UNet with many blocks,
random-initialised. Each model runs in its own
subprocess, so the planner's peak memory (the process's RSS high-water mark, ``ru_maxrss``) is its own. Per model:
units in the captured graph, capture / profile / solve seconds (solve at each budget fraction), the planner's peak
RSS, and per budget the predicted peak, the measured peak of the rewritten model (MemTracker, one real step), the
prediction error and the predicted overhead. Where repeated blocks were found, the same budget is also solved by the
flat program on the same profile (``flat_solve_s``, ``recompute_vs_flat``: the block plan's recompute ms over the flat
plan's), timed after the block solve so it does not count in ``solve_s``. Budgets given as ``--floor-fractions`` sit
a fraction of the way from the model's memory floor (``InfeasibleBudgetError.min_feasible_bytes`` of a first planner)
to its unmodified peak and are each solved as the *first* plan of a fresh planner: ``plan_solve_time_s`` is that
plan's ``Plan.solve_time_s`` (everything after capture and profiling), the figure issue 20 sets a target for (≤ 2 s
for Llama 12 layers, ≤ 10 s for 48). Writes ``NAME.csv`` (``--name``, default ``bench_scale``), a log-log plot of
solve time against units (``NAME.png``) and the section ``NAME`` of README.md into ``--out`` (default
``experiments/results/scale``).

    python -m experiments.bench.bench_scale                   # GPT-2 6/12/24/48, Llama 12/48 layers and a UNet
    python -m experiments.bench.bench_scale --models gpt2:6,gpt2:12 --fractions 0.5 --no-measure --out /tmp/bs
    python -m experiments.bench.bench_scale --models llama:12,llama:48 --fractions 0.5 --name bench_scale_llama
    python -m experiments.bench.bench_scale --real-sizes          # Llama-2-7B, Llama-3-70B on meta, FakeTrace

``--real-sizes`` (issue 36): models of real size built on the meta device (no weights anywhere), bf16, AdamW, batch
1 x 4096, planned with ``Planner.from_model(..., trace="fake", target="h100-sxm-80gb")`` (a fake trace, roofline
timing on the H100) at budgets given in GB (10^9 bytes), each model in its own subprocess. Per budget: wall seconds
from the imports to this budget's plan or refusal, the process's peak RSS and the load average around it, the plan's
``Plan.breakdown`` at its predicted peak and at the unmodified step's (parameters, gradients, optimizer states,
buffers and inputs, activations, logits and loss, recomputed copies, other device memory, temporaries), the predicted
step time and tokens per second (roofline: forward + backward + recomputation), the provenance; or the refusal's
message, the bound it states (``InfeasibleBudgetError.lower_bound_bytes``: its floor is not searched) and how many
devices of that memory the static bytes need. Writes ``bench_scale_real.csv`` and the section ``bench_scale_real`` of
README.md into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

from experiments.common.results_readme import REPO_ROOT, write_section  # no torch: a subprocess's imports are timed

MODULE = "experiments.bench.bench_scale"  # each model runs in a subprocess of this module, from the repository root
DEFAULT_MODELS = "gpt2:6,gpt2:12,gpt2:24,gpt2:48,llama:12,llama:48,unet:4"
# GPT-2: width 128, 4 heads, sequence 128, batch 2, vocabulary 512; small enough that profiling stays cheap on CPU,
# the graph grows with depth like the real thing (about 55 aten units per layer).
_GPT2 = {"n_embd": 128, "n_head": 4, "seq": 128, "batch": 2, "vocab": 512}
# Llama: the sizes of issue 20's solve-time target (hidden 64, intermediate 176, 4 heads with 2 KV heads)
_LLAMA = {"hidden": 64, "intermediate": 176, "heads": 4, "kv_heads": 2, "seq": 128, "batch": 2, "vocab": 1000}


def build(spec: str):  # -> (model, args, kwargs, loss_fn)
    import torch

    kind, _, depth_text = spec.partition(":")
    depth = int(depth_text)
    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=depth, n_embd=_GPT2["n_embd"], n_head=_GPT2["n_head"], n_positions=_GPT2["seq"],
            vocab_size=_GPT2["vocab"], bos_token_id=0, eos_token_id=0,
        )
        ids = torch.randint(0, _GPT2["vocab"], (_GPT2["batch"], _GPT2["seq"]))
        return GPT2LMHeadModel(config), (ids,), {"labels": ids}, None
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=_LLAMA["hidden"], intermediate_size=_LLAMA["intermediate"], num_attention_heads=_LLAMA["heads"],
            num_key_value_heads=_LLAMA["kv_heads"], num_hidden_layers=depth, vocab_size=_LLAMA["vocab"],
        )
        ids = torch.randint(0, _LLAMA["vocab"], (_LLAMA["batch"], _LLAMA["seq"]))
        return LlamaForCausalLM(config), (ids,), {"labels": ids, "use_cache": False}, None
    if kind == "unet":
        from diffusers import UNet2DModel

        # ``depth`` resnet layers per block, four resolution levels: many repeated blocks
        channels = (32, 64, 64, 128)
        model = UNet2DModel(
            sample_size=32, in_channels=3, out_channels=3, block_out_channels=channels, layers_per_block=depth,
            down_block_types=("DownBlock2D",) * 4, up_block_types=("UpBlock2D",) * 4, norm_num_groups=8,
        )
        sample = torch.randn(2, 3, 32, 32)
        return model, (sample, torch.tensor(10)), {}, lambda out: out.sample.pow(2).mean()
    raise ValueError(f"unknown model spec {spec!r}: use gpt2:LAYERS, llama:LAYERS or unet:LAYERS_PER_BLOCK")


def run_one(spec: str, fractions: list[float], floor_fractions: list[float], measure: bool) -> list[dict]:
    """Plan (and measure) one model in this process; one row per budget fraction, then one per floor fraction."""
    import torch

    import autockpt

    torch.set_num_threads(2)
    model, args, kwargs, loss_fn = build(spec)
    planner = autockpt.Planner.from_model(model, example_inputs=args, example_kwargs=kwargs, loss_fn=loss_fn)
    static, peak = planner.trace.static_bytes, planner.trace.baseline_peak_bytes
    rows = []
    for fraction in fractions:
        budget = int(static + fraction * (peak - static))
        row = {
            "model": spec, "units": len(planner.graph.units), "capture": planner.graph.kind.value,
            "parameters": sum(p.numel() for p in model.parameters()), "fraction": fraction, "budget_bytes": budget,
            "unmodified_peak_bytes": peak, "static_bytes": static, "capture_s": round(planner.capture_time_s, 3),
            "profile_s": round(planner.profile_time_s, 3),
        }
        started = time.perf_counter()
        try:
            plan = planner.plan(budget_bytes=budget)
        except autockpt.InfeasibleBudgetError as error:
            row.update(feasible=False, solve_s=round(time.perf_counter() - started, 3),
                       min_feasible_bytes=error.min_feasible_bytes)
            rows.append(row)
            continue
        solve_s = time.perf_counter() - started
        row.update(
            feasible=True, solve_s=round(solve_s, 3), status=plan.status.value,
            solved_by=plan.solver_stats.status if plan.solver_stats else "",
            min_feasible_bytes=plan.min_feasible_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
            predicted_overhead=round(plan.predicted_overhead, 4), regions=len(plan.regions),
            milp_variables=plan.solver_stats.variables if plan.solver_stats else 0,
            milp_constraints=plan.solver_stats.constraints if plan.solver_stats else 0,
            **_repeated_blocks(planner), **_flat_program(planner, budget, plan.recompute_ms),
        )
        if measure:
            module = planner.apply(plan)
            measured = autockpt.measure_step(module, args, kwargs, loss_fn).peak_bytes
            row.update(measured_peak_bytes=measured,
                       prediction_error=round((measured - plan.predicted_peak_bytes) / measured, 5),
                       within_budget=measured <= budget)
        rows.append(row)
    rows += _first_plans(spec, planner, floor_fractions)
    planner_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    for row in rows:
        row["process_peak_rss_bytes"] = planner_rss
    return rows


def _first_plans(spec: str, planner, floor_fractions: list[float]) -> list[dict]:
    """Per floor fraction: a fresh planner's first plan at floor + fraction x (peak - floor)."""
    import autockpt

    if not floor_fractions:
        return []
    try:
        planner.plan(budget_bytes=1)
    except autockpt.InfeasibleBudgetError as error:
        floor = error.min_feasible_bytes
    peak = planner.trace.baseline_peak_bytes
    rows = []
    for fraction in floor_fractions:
        model, args, kwargs, loss_fn = build(spec)
        budget = int(floor + fraction * (peak - floor))
        fresh = autockpt.Planner.from_model(model, example_inputs=args, example_kwargs=kwargs, loss_fn=loss_fn)
        started = time.perf_counter()
        plan = fresh.plan(budget_bytes=budget)
        rows.append({
            "model": spec, "units": len(fresh.graph.units), "capture": fresh.graph.kind.value,
            "parameters": sum(p.numel() for p in model.parameters()), "fraction": f"floor+{fraction}",
            "budget_bytes": budget, "unmodified_peak_bytes": peak, "static_bytes": fresh.trace.static_bytes,
            "capture_s": round(fresh.capture_time_s, 3), "profile_s": round(fresh.profile_time_s, 3), "feasible": True,
            "solve_s": round(time.perf_counter() - started, 3), "plan_solve_time_s": round(plan.solve_time_s, 3),
            "status": plan.status.value, "min_feasible_bytes": floor, "predicted_peak_bytes": plan.predicted_peak_bytes,
            "predicted_overhead": round(plan.predicted_overhead, 4), "regions": len(plan.regions),
            "checkpoint": plan.planned_action.value,
        })
    return rows


_BLOCK_COUNTS: dict = {}


def _repeated_blocks(planner) -> dict:
    """What structure-aware solving found: block instances and the units they cover, in the problem the planner
    solves for its first action (torch's checkpoint). The Planner keeps its prepared problems to itself, so the same
    problem is prepared again here from the same trace, prices and candidates (once per model, after the timed solve;
    only the counts are kept)."""
    if id(planner) not in _BLOCK_COUNTS:
        from autockpt.core.solve.baselines import baseline_seed_plans
        from autockpt.core.solve.candidates import candidate_regions
        from autockpt.core.solve.prepare import prepare
        from autockpt.core.structure import find_repeated_blocks
        from autockpt.types import CaptureKind

        graph, trace = planner.graph, planner.trace
        # the planner solves by blocks unless switched off or the capture is module-level
        by_blocks = planner.solver_options.repeated_blocks and graph.kind is not CaptureKind.MODULE
        blocks = None
        if by_blocks:
            structure = find_repeated_blocks(graph, trace)
            if structure.families:  # without a family the problem has no blocks: nothing to score
                blocks = prepare(
                    trace, planner.costs, planner.actions[0], *candidate_regions(graph, trace),
                    seed_plans=baseline_seed_plans(graph, trace), structure=structure,
                ).blocks
        sizes = [i.region.last_unit - i.region.first_unit + 1 for i in blocks.instances] if blocks is not None else []
        _BLOCK_COUNTS[id(planner)] = {"block_instances": len(sizes), "units_in_blocks": sum(sizes)}
    return _BLOCK_COUNTS[id(planner)]


_FLAT_PROBLEMS: dict = {}


def _flat_program(planner, budget: int, recompute_ms: float) -> dict:
    """The same budget solved by one flat program over all units, on the same trace: what the blocks save."""
    from autockpt.core.solve.baselines import baseline_seed_plans
    from autockpt.core.solve.candidates import candidate_regions
    from autockpt.core.solve.default import solve_prepared
    from autockpt.core.solve.prepare import prepare

    if not _repeated_blocks(planner)["block_instances"]:
        return {}
    started = time.perf_counter()
    if id(planner) not in _FLAT_PROBLEMS:  # scored once per model, like the planner's own problem
        trace = planner.trace
        _FLAT_PROBLEMS[id(planner)] = prepare(trace, planner.costs, planner.actions[0],
                                              *candidate_regions(planner.graph, trace),
                                              seed_plans=baseline_seed_plans(planner.graph, trace))
    result = solve_prepared(_FLAT_PROBLEMS[id(planner)], budget)
    return {"flat_solve_s": round(time.perf_counter() - started, 3),
            "recompute_vs_flat": round(recompute_ms / result.timeline.recompute_ms, 4)}


# real sizes: (layers, hidden, intermediate, heads, KV heads, vocabulary), budgets in GB
REAL_SIZES = {
    "llama2-7b": ((32, 4096, 11008, 32, 32, 32000), (75, 60)),  # 60: under the unmodified peak
    "llama3-70b": ((80, 8192, 28672, 64, 8, 128256), (80,)),  # static bytes alone are 7 H100s' memory
}
_REAL_SEQ = 4096
_REAL_TARGET = "h100-sxm-80gb"
# the categories of ``Plan.breakdown`` (``record_types.MemoryBreakdown``), as CSV columns
_CATEGORIES = ("parameter", "gradient", "optimizer_state", "buffer_and_input", "activation", "logits", "recomputed",
               "other_device", "temporary")


def gb(value: float | None) -> str:
    """GB (10^9 bytes) with two decimals; empty for None or NaN (a refused row's missing figure)."""
    return "" if value is None or math.isnan(value) else f"{value / 1e9:.2f}"


def _categories(prefix: str, breakdown) -> dict:
    return {f"{prefix}{name}_bytes": getattr(breakdown, f"{name}_bytes") for name in _CATEGORIES}


def run_real(name: str) -> list[dict]:
    """One real-size Llama on the meta device: fake trace, roofline timing on an H100, AdamW, bf16, batch 1 x 4096;
    a row per budget. A refusal's floor is not read (``min_feasible_bytes`` would search it): its bound is."""
    import os

    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import autockpt
    from autockpt.units import GB

    torch.set_num_threads(2)
    (layers, hidden, intermediate, heads, kv_heads, vocab), budgets = REAL_SIZES[name]
    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=_REAL_SEQ, use_cache=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (1, _REAL_SEQ))
    planner = autockpt.Planner.from_model(
        model, example_inputs=(ids,), example_kwargs={"labels": ids}, trace="fake", target=_REAL_TARGET,
        optimizer=torch.optim.AdamW,
    )
    setup_s = time.perf_counter() - started  # imports, build, capture, fake trace, roofline timing
    trace, provenance = planner.trace, planner.provenance
    base = {
        "model": name, "parameters": sum(p.numel() for p in model.parameters()), "batch": 1, "seq": _REAL_SEQ,
        "capture": planner.graph.kind.value, "units": len(planner.graph.units),
        "setup_s": round(setup_s, 2), "capture_s": round(planner.capture_time_s, 2),
        "trace_s": round(planner.profile_time_s, 2),
        "unmodified_peak_bytes": trace.baseline_peak_bytes, "static_bytes": trace.static_bytes,
        "trace_parameter_bytes": trace.parameter_bytes, "trace_gradient_bytes": trace.gradient_bytes,
        "trace_optimizer_state_bytes": trace.optimizer_state_bytes, "trace_buffer_bytes": trace.buffer_bytes,
        "trace_input_bytes": trace.input_bytes,
        "unmodified_step_ms": round(trace.step_ms, 2),
        "provenance_trace": provenance.trace, "provenance_timing": provenance.timing,
        "provenance_device": provenance.device, "provenance_device_memory_bytes": provenance.device_memory_bytes,
        "provenance_reason": provenance.reason, "provenance": provenance.describe(),
    }
    rows = []
    for budget_gb in budgets:
        row = {**base, "budget_gb": budget_gb}
        solve_started = time.perf_counter()
        try:
            plan = planner.plan(budget_bytes=int(budget_gb * GB))
        except autockpt.InfeasibleBudgetError as error:
            solve_s = time.perf_counter() - solve_started
            row.update(
                # the bound of a refusal made before any floor search, else the searched floor itself
                feasible=False, message=str(error),
                lower_bound_bytes=error.lower_bound_bytes if error.lower_bound_bytes is not None
                else error.min_feasible_bytes,
                devices_for_static=math.ceil(trace.static_bytes / int(budget_gb * GB)),
            )
        else:
            solve_s = time.perf_counter() - solve_started
            step_ms = plan.baseline_step_ms * (1 + plan.predicted_overhead)
            row.update(
                feasible=True, status=plan.status.value, predicted_peak_bytes=plan.predicted_peak_bytes,
                min_feasible_bytes=plan.min_feasible_bytes, regions=len(plan.regions),
                checkpoint=plan.planned_action.value, predicted_step_ms=round(step_ms, 2),
                predicted_tokens_per_s=round(_REAL_SEQ / (step_ms / 1e3)),
                **_categories("peak_", plan.breakdown), **_categories("unmodified_", plan.baseline_breakdown),
                peak_phase=plan.breakdown.phase.value, unmodified_phase=plan.baseline_breakdown.phase.value,
            )
        row["solve_s"] = round(solve_s, 3)
        row["wall_s"] = round(setup_s + solve_s, 2)  # from the imports to this budget's answer, alone
        rows.append(row)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    for row in rows:
        row.update(process_peak_rss_bytes=rss, load_before=round(load_before, 2), load_after=round(os.getloadavg()[0], 2))
    return rows


def real_sizes(names: list[str], out: Path) -> None:
    import os

    import pandas as pd

    rows = []
    for name in names:
        done = subprocess.run(
            [sys.executable, "-m", MODULE, "--one-real", name], capture_output=True, text=True, check=False, cwd=REPO_ROOT
        )
        if done.returncode != 0:
            print(f"{name}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    frame = pd.DataFrame(rows)
    folder = out
    folder.mkdir(parents=True, exist_ok=True)
    frame.to_csv(folder / "bench_scale_real.csv", index=False)
    loads = {row["model"]: f"{row['load_before']:.1f} to {row['load_after']:.1f}" for row in rows}
    lines = [
        (
            f"Real-size Llamas built on the meta device, bf16 weights, AdamW, batch 1 x {_REAL_SEQ}, "
            f"`Planner.from_model(..., trace=\"fake\", target=\"{_REAL_TARGET}\", optimizer=torch.optim.AdamW)`: "
            f"a fake trace, roofline timing on the H100; one subprocess each on a machine of {os.cpu_count()} CPU "
            "cores shared with other work (1-minute load average when each started and ended: "
            f"{'; '.join(f'{model} {load}' for model, load in loads.items())}) "
            "(`python -m experiments.bench.bench_scale --real-sizes`). GB = 10^9 bytes. Wall: the imports, building the "
            "model, capture, fake trace and this budget's plan alone (target: at most 60 s); RSS: the process's peak "
            "resident memory (target: at most 4 GB). The categories are `Plan.breakdown` in GB, at the predicted "
            "peak under the plan (they add up to it); step time and tokens/s are the roofline's forward + backward + "
            "recomputation on the H100 (optimizer.step() not timed)."
        ),
        "",
        (
            "| model | budget GB | wall s (capture, trace, solve) | peak RSS GB | units | peak GB | parameters "
            "| gradients | optimizer states | buffers+inputs | activations | logits+loss | recomputed | temporaries "
            "| regions | step ms (unmodified) | tokens/s |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        timing = (f"{row['wall_s']:.1f} ({row['capture_s']:.1f}, {row['trace_s']:.1f}, {row['solve_s']:.2f}) "
                  f"| {row['process_peak_rss_bytes'] / 1e9:.2f} | {row['units']}")
        if row["feasible"]:
            categories = " | ".join(gb(row[f"peak_{name}_bytes"]) for name in _CATEGORIES if name != "other_device")
            lines.append(
                f"| {row['model']} | {row['budget_gb']} | {timing} | {gb(row['predicted_peak_bytes'])} | {categories} "
                f"| {row['regions']} | {row['predicted_step_ms']:.0f} ({row['unmodified_step_ms']:.0f}) "
                f"| {row['predicted_tokens_per_s']:,} |"
            )
        else:
            static = " | ".join(gb(row[f"trace_{name}_bytes"]) for name in ("parameter", "gradient", "optimizer_state"))
            lines.append(
                f"| {row['model']} | {row['budget_gb']} | {timing} | refused (at least {gb(row['lower_bound_bytes'])}) "
                f"| {static} | {gb(row['trace_buffer_bytes'] + row['trace_input_bytes'])} | | | | | | | |"
            )
    lines += ["", f"Made from: {rows[0]['provenance']}." if rows else ""]
    for row in rows:
        if not row["feasible"]:
            refused = (f"{row['model']} at {row['budget_gb']} GB, refused in {row['solve_s']:.3f} s after "
                       f"{row['setup_s']:.1f} s of setup: {row['message']}")
            lines += ["", refused]
    text = "\n".join(lines)
    print(text)
    write_section("bench_scale_real", text, output=folder)


def plot(frame, path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = figure.subplots()
    for fraction, group in frame[frame["feasible"]].groupby(frame["fraction"].astype(str)):
        ax.loglog(group["units"], group["solve_s"], marker="o", linestyle="none", label=f"budget fraction {fraction}")
        for _, row in group.iterrows():
            ax.annotate(row["model"], (row["units"], row["solve_s"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("units in the captured graph (aten nodes)")
    ax.set_ylabel("solve seconds (2 CPU cores)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated specs (default {DEFAULT_MODELS})")
    parser.add_argument("--fractions", default="0.3,0.5", help="budgets: fractions from static memory to the peak")
    parser.add_argument("--floor-fractions", default="0.3",
                        help="first plans of fresh planners: fractions from the floor to the peak ('' for none)")
    parser.add_argument("--no-measure", action="store_true", help="skip the real step of each rewritten model")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/scale"))
    parser.add_argument("--name", default="bench_scale", help="output files NAME.csv and NAME.png, README section NAME")
    parser.add_argument("--real-sizes", nargs="?", const=",".join(REAL_SIZES), metavar="NAMES",
                        help=f"real-size Llamas on meta with FakeTrace instead (default all: {','.join(REAL_SIZES)})")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one model, print JSON rows
    parser.add_argument("--one-real", help=argparse.SUPPRESS)  # internal: one real-size model, print JSON rows
    options = parser.parse_args()
    if options.one_real:
        print(json.dumps(run_real(options.one_real)))
        return
    if options.real_sizes:
        real_sizes(options.real_sizes.split(","), options.out)
        return
    fractions = [float(f) for f in options.fractions.split(",")]
    floor_fractions = [float(f) for f in options.floor_fractions.split(",") if f]
    if options.one:
        print(json.dumps(run_one(options.one, fractions, floor_fractions, not options.no_measure)))
        return

    import pandas as pd

    rows = []
    for spec in options.models.split(","):
        command = [sys.executable, "-m", MODULE, "--one", spec, "--fractions", options.fractions,
                   "--floor-fractions", options.floor_fractions]
        command += ["--no-measure"] if options.no_measure else []
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=REPO_ROOT)  # failures: below
        if done.returncode != 0:
            print(f"{spec}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        found = json.loads(done.stdout.strip().splitlines()[-1])
        rows += found
        print(f"{spec}: {found[0]['units']} units, {time.perf_counter() - started:.0f} s in all", file=sys.stderr)
    frame = pd.DataFrame(rows)
    options.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(options.out / f"{options.name}.csv", index=False)
    plot(frame, options.out / f"{options.name}.png")
    print(frame.to_string(index=False))
    write_section(options.name, f"```\n{frame.to_string(index=False)}\n```", output=options.out)


if __name__ == "__main__":
    main()
