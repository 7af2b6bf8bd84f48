"""FSDP2 plans (issue 38): autockpt's per-unit choice (keep, selective or full checkpointing; with a host pool,
offload) against no checkpointing, full checkpointing per block and torchtitan's selective op list per block, at
equal measured per-rank peaks, on two gloo ranks on CPU; and a Llama-3-8B plan for 8 H100s made on this machine.

    python -m experiments.bench.bench_fsdp --out experiments/results/fsdp

Part 1, measured (CPU, world 2, one gloo rank per core): the Llama-style decoder of ``experiments/common/pipeline_worker.py``
(RMSNorm, causal attention with rotary positions, SwiGLU; ``CONFIG`` below), planned here on the fake process group.
Baselines: "none" (nothing checkpointed), "full per block" and "selective per block" (torchtitan's op list on every
block: the outputs of matmuls and attention saved, the rest recomputed). autockpt is given the budget each of the two
checkpointing baselines measures (their fake-process-group peaks, equal to the gloo-measured ones to the byte in every
run so far), one halfway between them, where no baseline but full fits, and, with a host pool of 1 GB, one halfway
between full checkpointing's peak and the floor of every block whole with its inputs offloaded, which no baseline
reaches. Each rank measures each plan's peak with
``FSDPMemTracker`` on real tensors (two AdamW steps), then steps the plans in turn for ``--rounds`` rounds in one
process group; a step's time is the slower rank's; the median step and the median of per-round ratios are reported
(``time_alternating``). Predicted ratios come from one plan_fsdp call each (one benchmark timing of the step prices
the plan and the baselines); on a CPU there is no link figure (collectives priced at 0), so the ratios compare
compute and recomputation, and the timing of single ops on this CPU (shared by two ranks and other work) says little
about a GPU, where matmuls and attention are a larger share of the step.

Part 2, predicted (no GPU here): a Llama-3-8B configuration (transformers ``LlamaForCausalLM``: 32 layers, hidden
4096, intermediate 14336, 32 heads, 8 KV heads, vocabulary 128256, ``use_cache=False``) on the meta device, world 8,
1 x 8192 tokens per rank, ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, fp32 AdamW states,
``target="h100-sxm-80gb"`` (roofline times in bfloat16, NVLink 4 at 450 GB/s each way) and a per-rank budget of 70
GB (65.2 GiB): the plan, and predicted tokens/s per GPU against full and selective checkpointing per block.
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

import autockpt
from autockpt.units import GB, format_bytes
from experiments.common.fsdp_worker import batch, build, lm_loss, time_alternating  # the rank worker the tests use
from experiments.common.results_readme import write_csv, write_section

CONFIG = {"seed": 0, "kind": "llama", "model": {"vocab": 512, "width": 128, "layers": 4, "heads": 4}, "batch": 4,
          "seq": 256, "rounds": 15}
WORLD = 2
# the measured plans: (name, the baseline it is compared with at equal peak, or None)
NONE, FULL, SELECTIVE = "none", "full per block", "selective per block"
AT_FULL, AT_SELECTIVE, BETWEEN = "autockpt at full's peak", "autockpt at selective's peak", "autockpt halfway"
# under what full checkpointing per block reaches: only offloading units' inputs into a host pool gets there
POOLED = "autockpt + host pool, under full's peak"
COMPARED = {AT_FULL: FULL, AT_SELECTIVE: SELECTIVE, BETWEEN: FULL}


@dataclasses.dataclass(frozen=True)
class Row:
    part: str
    plan: str
    world_size: int
    checkpointed_units: int
    selective_units: int
    offloaded_units: int
    host_pool_bytes: int
    units: int
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int | None
    predicted_step_ms: float
    measured_step_ms: float | None
    tokens_per_s_per_rank: float | None
    plan_time_s: float


def _plans() -> tuple[dict[str, autockpt.FSDPPlan], dict[str, float]]:
    """The six plans; the baselines are the roomy plan with every block full or selective (what plan_fsdp measured
    for them on the fake process group: its floor and its all-selective peak)."""
    ids, target = batch(CONFIG, rank=0, world=WORLD)
    # the ranks step AdamW (common/fsdp_worker.py): the plans cover that loop (0.3: no optimizer by default)
    common = {"world_size": WORLD, "example_inputs": (ids,), "example_target": target, "loss_fn": lm_loss,
              "optimizer": "adamw"}
    seconds = {}

    def planned(name: str, budget: int, **extra: float) -> autockpt.FSDPPlan:
        started = time.perf_counter()
        fplan = autockpt.plan_fsdp(build(CONFIG), budget_bytes=budget, **common, **extra)
        seconds[name] = time.perf_counter() - started
        return fplan

    none = planned(NONE, 10**12)
    inner = tuple(u for u in none.units if u)
    full = dataclasses.replace(none, budget_bytes=none.min_feasible_bytes, checkpointed=inner,
                               predicted_peak_bytes=none.min_feasible_bytes, predicted_step_ms=none.floor_step_ms,
                               ranks=())
    selective = dataclasses.replace(none, budget_bytes=none.selective_peak_bytes, selective=inner,
                                    predicted_peak_bytes=none.selective_peak_bytes,
                                    predicted_step_ms=none.selective_step_ms, ranks=())
    seconds[FULL] = seconds[SELECTIVE] = 0.0
    plans = {NONE: none, FULL: full, SELECTIVE: selective,
             AT_FULL: planned(AT_FULL, none.min_feasible_bytes),
             AT_SELECTIVE: planned(AT_SELECTIVE, none.selective_peak_bytes),
             BETWEEN: planned(BETWEEN, (none.min_feasible_bytes + none.selective_peak_bytes) // 2)}
    pool_floor = autockpt.plan_fsdp(build(CONFIG), budget_bytes=10**12, host_pool_gb=1.0, **common).min_feasible_bytes
    plans[POOLED] = planned(POOLED, (pool_floor + none.min_feasible_bytes) // 2, host_pool_gb=1.0)
    return plans, seconds


@dataclasses.dataclass(frozen=True)
class Comparison:
    """An autockpt plan against the baseline whose measured peak was its budget."""

    plan: str
    baseline: str
    round_ratios: tuple[float, ...]  # per alternating round: the plan's step over the baseline's
    predicted_ratio: float  # one plan_fsdp call's timing prices both


def measured_part(tmp: Path) -> tuple[list[Row], list[Comparison]]:
    plans, seconds = _plans()
    paths = []
    for index, fplan in enumerate(plans.values()):
        paths.append(str(fplan.save(tmp / f"plan{index}.json")))
    context = mp.start_processes(time_alternating, args=(WORLD, CONFIG, paths, str(tmp), str(tmp / "init")),
                                 nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 600
    while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise RuntimeError("the gloo ranks did not finish within 600 s")
    ranks = [pickle.loads((tmp / f"alternating{r}.pkl").read_bytes()) for r in range(WORLD)]
    tokens = CONFIG["batch"] * CONFIG["seq"]
    rows = []
    for index, (name, fplan) in enumerate(plans.items()):
        step_s = statistics.median(ranks[0]["seconds"][index])
        rows.append(Row(
            part="gloo-cpu", plan=name, world_size=WORLD, checkpointed_units=len(fplan.checkpointed),
            selective_units=len(fplan.selective), offloaded_units=len(fplan.offloaded),
            host_pool_bytes=fplan.host_pool_bytes, units=len(fplan.units) - 1, budget_bytes=fplan.budget_bytes,
            predicted_peak_bytes=fplan.predicted_peak_bytes,
            measured_peak_bytes=max(r["peaks"][index] for r in ranks), predicted_step_ms=fplan.predicted_step_ms,
            measured_step_ms=1e3 * step_s, tokens_per_s_per_rank=tokens / step_s, plan_time_s=seconds[name],
        ))
    names, seconds_of = list(plans), ranks[0]["seconds"]
    comparisons = [
        Comparison(
            plan=plan, baseline=base,
            round_ratios=tuple(a / b for a, b in zip(seconds_of[names.index(plan)], seconds_of[names.index(base)])),
            predicted_ratio=plans[plan].predicted_step_ms / (plans[plan].floor_step_ms if base == FULL
                                                             else plans[plan].selective_step_ms),
        )
        for plan, base in {**COMPARED, POOLED: FULL}.items()
    ]
    return rows, comparisons


def llama8b_part() -> tuple[list[Row], autockpt.FSDPPlan, autockpt.FSDPPlan]:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tokens = 8192
    ids = torch.randint(0, config.vocab_size, (1, tokens), device="meta")

    def loss(out, target):
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), target.flatten())

    common = {"world_size": 8, "example_inputs": (ids,), "example_target": ids, "loss_fn": loss,
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
              "target": "h100-sxm-80gb", "optimizer": "adamw"}
    started = time.perf_counter()
    fplan = autockpt.plan_fsdp(model, budget_gb=70, **common)
    plan_s = time.perf_counter() - started
    # with a host pool: halfway between full checkpointing's peak and every block whole with its inputs offloaded
    pool_floor = autockpt.plan_fsdp(model, budget_gb=70, host_pool_gb=64, **common).min_feasible_bytes
    started = time.perf_counter()
    pooled = autockpt.plan_fsdp(model, budget_bytes=(pool_floor + fplan.min_feasible_bytes) // 2, host_pool_gb=64,
                                **common)
    pooled_s = time.perf_counter() - started
    inner = [u for u in fplan.units if u]
    part = {"part": "llama3-8b-h100x8", "world_size": 8, "units": len(inner), "measured_peak_bytes": None,
            "measured_step_ms": None}
    rows = [
        Row(plan="autockpt", checkpointed_units=len(fplan.checkpointed), selective_units=len(fplan.selective),
            offloaded_units=0, host_pool_bytes=0, budget_bytes=fplan.budget_bytes,
            predicted_peak_bytes=fplan.predicted_peak_bytes, predicted_step_ms=fplan.predicted_step_ms,
            tokens_per_s_per_rank=tokens / fplan.predicted_step_ms * 1e3, plan_time_s=plan_s, **part),
        Row(plan=FULL, checkpointed_units=len(inner), selective_units=0, offloaded_units=0, host_pool_bytes=0,
            budget_bytes=fplan.budget_bytes, predicted_peak_bytes=fplan.min_feasible_bytes,
            predicted_step_ms=fplan.floor_step_ms, tokens_per_s_per_rank=tokens / fplan.floor_step_ms * 1e3,
            plan_time_s=plan_s, **part),
        Row(plan=SELECTIVE, checkpointed_units=0, selective_units=len(inner), offloaded_units=0, host_pool_bytes=0,
            budget_bytes=fplan.budget_bytes, predicted_peak_bytes=fplan.selective_peak_bytes,
            predicted_step_ms=fplan.selective_step_ms, tokens_per_s_per_rank=tokens / fplan.selective_step_ms * 1e3,
            plan_time_s=plan_s, **part),
        Row(plan=POOLED, checkpointed_units=len(pooled.checkpointed), selective_units=len(pooled.selective),
            offloaded_units=len(pooled.offloaded), host_pool_bytes=pooled.host_pool_bytes,
            budget_bytes=pooled.budget_bytes, predicted_peak_bytes=pooled.predicted_peak_bytes,
            predicted_step_ms=pooled.predicted_step_ms, tokens_per_s_per_rank=tokens / pooled.predicted_step_ms * 1e3,
            plan_time_s=pooled_s, **part),
    ]
    return rows, fplan, pooled


def markdown(rows: list[Row], comparisons: list[Comparison], fplan: autockpt.FSDPPlan | None,
             pooled: autockpt.FSDPPlan | None, command: str, elapsed_s: float) -> str:
    lines = [(f"`{command}`, {time.strftime('%Y-%m-%d', time.gmtime())}, {elapsed_s:.0f} s. GB = 10^9 bytes, "
             "GiB = 2^30 bytes."), ""]
    measured = [r for r in rows if r.part == "gloo-cpu"]
    if measured:
        c = CONFIG
        lines += [
            (f"**Measured, CPU gloo world {WORLD}**: Llama-style decoder of {c['model']['layers']} blocks, width "
            f"{c['model']['width']}, {c['model']['heads']} heads, vocabulary {c['model']['vocab']}, {c['batch']} x "
            f"{c['seq']} tokens per rank, AdamW; median of {c['rounds']} alternating rounds (slower rank). "
            "Units: full / selective / offloaded of all; peaks are device bytes (the CPU host pool, a second CPU "
            "buffer here, taken off: its own column)."), "",
            ("| plan | full / selective / offloaded | host pool | budget | predicted peak | measured peak (max rank) | "
            "under budget | predicted step ms | measured step ms | measured / none |"),
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        none = next(r for r in measured if r.plan == NONE)
        for r in measured:
            budget = "-" if r.plan == NONE else f"{r.budget_bytes:,} B"
            fits = "-" if r.plan == NONE else ("yes" if r.measured_peak_bytes <= r.budget_bytes else "no")
            lines.append(
                f"| {r.plan} | {r.checkpointed_units} / {r.selective_units} / {r.offloaded_units} of {r.units} | "
                f"{r.host_pool_bytes:,} B | {budget} | "
                f"{r.predicted_peak_bytes:,} B | {r.measured_peak_bytes:,} B | {fits} | {r.predicted_step_ms:.1f} | "
                f"{r.measured_step_ms:.1f} | {r.measured_step_ms / none.measured_step_ms:.3f} |"
            )
        lines += ["", ("At equal per-rank peaks (autockpt given the baseline's measured peak as its budget; the host "
                       "pool row is under full's peak, which no baseline reaches):"), "",
                  "| autockpt plan | against | measured step ratio, median of rounds (min-max) | predicted ratio |",
                  "|---|---|---|---|"]
        for c in comparisons:
            ratios = c.round_ratios
            lines.append(f"| {c.plan} | {c.baseline} | {statistics.median(ratios):.3f} ({min(ratios):.3f}-"
                         f"{max(ratios):.3f}) | {c.predicted_ratio:.3f} |")
        lines += ["", ("CPU caveat: two ranks share this machine's cores (and other work); single-op timings on a CPU "
                      "say little about a GPU, and a plan identical to its baseline shows the noise of the ratio."),
                  ""]
    if fplan is not None:
        big = {r.plan: r for r in rows if r.part == "llama3-8b-h100x8"}
        auto, full, selective, pool = big["autockpt"], big[FULL], big[SELECTIVE], big[POOLED]
        lines += [
            ("**Predicted, Llama-3-8B at world 8 on H100 SXM** (1 x 8192 tokens per rank, bf16 params, fp32 reduce, "
            f"fp32 AdamW, per-rank budget {format_bytes(fplan.budget_bytes)}), planned here in "
            f"{auto.plan_time_s:.0f} s:"), "",
            "```", fplan.summary(), "```", "",
            (f"Predicted tokens/s per GPU: autockpt {auto.tokens_per_s_per_rank:,.0f} ({auto.checkpointed_units} "
            f"full, {auto.selective_units} selective of {auto.units} blocks) against full checkpointing "
            f"{full.tokens_per_s_per_rank:,.0f} ({auto.tokens_per_s_per_rank / full.tokens_per_s_per_rank - 1:+.1%})"
            f" and selective per block {selective.tokens_per_s_per_rank:,.0f} "
            f"({auto.tokens_per_s_per_rank / selective.tokens_per_s_per_rank - 1:+.1%}); peaks "
            f"{auto.predicted_peak_bytes / GB:.2f} GB, {full.predicted_peak_bytes / GB:.2f} GB and "
            f"{selective.predicted_peak_bytes / GB:.2f} GB. Not measured: no GPU cluster here; roofline times are "
            "optimistic (docs/ARCHITECTURE.md, devices.py)."), "",
            (f"With a host pool (`host_pool_gb=64`) and a budget of {format_bytes(pool.budget_bytes)}, halfway "
             f"between full checkpointing's peak and the floor with a pool ({format_bytes(pooled.min_feasible_bytes)})"
             f", planned in {pool.plan_time_s:.0f} s: {pool.checkpointed_units} full, "
             f"{pool.selective_units} selective, {pool.offloaded_units} offloaded; predicted peak "
             f"{format_bytes(pool.predicted_peak_bytes)}, host pool {format_bytes(pool.host_pool_bytes)} per rank, "
             f"{pool.tokens_per_s_per_rank:,.0f} tokens/s per GPU "
             f"({pool.tokens_per_s_per_rank / full.tokens_per_s_per_rank - 1:+.1%} against full checkpointing, "
             f"copies over PCIe priced at {pooled.exposed_copy_ms:.1f} ms exposed):"), "",
            "```", pooled.summary(), "```",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/results/fsdp"))
    parser.add_argument("--skip-measured", action="store_true")
    parser.add_argument("--skip-llama", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    rows: list[Row] = []
    comparisons: list[Comparison] = []
    fplan = pooled = None
    if not args.skip_measured:
        with tempfile.TemporaryDirectory() as tmp:
            measured, comparisons = measured_part(Path(tmp))
            rows += measured
    if not args.skip_llama:
        big, fplan, pooled = llama8b_part()
        rows += big
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "fsdp.csv", rows)
    command = ("python -m experiments.bench.bench_fsdp " + " ".join(sys.argv[1:])).strip()
    text = markdown(rows, comparisons, fplan, pooled, command, time.perf_counter() - started)
    (args.out / "fsdp.md").write_text(text + "\n")
    write_section("bench_fsdp", text, output=args.out)
    print(text)


if __name__ == "__main__":
    main()
