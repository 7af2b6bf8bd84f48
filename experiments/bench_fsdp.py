"""FSDP2 plans (issue 38): autockpt's whole-unit checkpointing against no checkpointing and full checkpointing per
block, measured on two gloo ranks on CPU, and a Llama-3-8B plan for 8 H100s made on this machine.

    python experiments/bench_fsdp.py --out experiments/results/fsdp

Part 1, measured (CPU, world 2, one gloo rank per core): the 4-layer decoder of ``tests/fsdp_worker.py`` widened
(``CONFIG`` below), planned here on the fake process group with a per-rank budget 40 % of the way from the floor
(every block checkpointed) to the baseline (nothing checkpointed). Three plans: "none" (nothing checkpointed: over
the budget, the reference), "full" (every block) and "autockpt". Each rank measures each plan's peak with
``FSDPMemTracker`` on real tensors (two AdamW steps), then steps the three in turn for ``--rounds`` rounds in one
process group; a step's time is the slower rank's, the median is reported (``time_alternating``). The predicted step
times are all the autockpt plan's (one benchmark timing of the step: baseline, floor and its own) and have no link
figure on a CPU (collectives priced at 0): the CPU ratios compare compute and recomputation.

Part 2, predicted (no GPU here): a Llama-3-8B configuration (transformers ``LlamaForCausalLM``: 32 layers, hidden
4096, intermediate 14336, 32 heads, 8 KV heads, vocabulary 128256) on the meta device, world 8, 1 x 8192 tokens per
rank, ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, fp32 AdamW states,
``target="h100-sxm-80gb"`` (roofline times in bfloat16, NVLink 4 at 450 GB/s each way) and a per-rank budget of 70
GB (65.2 GiB): the plan, its per-rank breakdown, and predicted tokens/s per GPU against full checkpointing.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the rank worker the tests use
from fsdp_worker import batch, build, lm_loss, time_alternating

import autockpt
from autockpt.units import GB, format_bytes

CONFIG = {"seed": 0, "model": {"vocab": 512, "width": 128, "layers": 4}, "batch": 4, "seq": 256, "rounds": 15}
WORLD = 2
BUDGET_FRACTION = 0.4


@dataclasses.dataclass(frozen=True)
class Row:
    part: str
    plan: str
    world_size: int
    checkpointed_units: int
    units: int
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int | None
    predicted_step_ms: float
    measured_step_ms: float | None
    tokens_per_s_per_rank: float | None
    plan_time_s: float


def _plans(tmp: Path) -> tuple[dict[str, autockpt.FSDPPlan] | None, int, dict[str, float]]:
    ids, target = batch(CONFIG, rank=0, world=WORLD)
    common = {"world_size": WORLD, "example_inputs": (ids,), "example_target": target, "loss_fn": lm_loss}
    seconds = {}
    started = time.perf_counter()
    none = autockpt.plan_fsdp(build(CONFIG), budget_bytes=10**12, **common)
    seconds["none"] = time.perf_counter() - started
    budget = int(none.min_feasible_bytes + BUDGET_FRACTION * (none.baseline_peak_bytes - none.min_feasible_bytes))
    started = time.perf_counter()
    full = autockpt.plan_fsdp(build(CONFIG), budget_bytes=none.min_feasible_bytes, **common)
    seconds["full"] = time.perf_counter() - started
    started = time.perf_counter()
    auto = autockpt.plan_fsdp(build(CONFIG), budget_bytes=budget, **common)
    seconds["autockpt"] = time.perf_counter() - started
    return {"none": none, "full": full, "autockpt": auto}, budget, seconds


def measured_part(tmp: Path) -> list[Row]:
    plans, budget, seconds = _plans(tmp)
    paths = []
    for name, fplan in plans.items():
        paths.append(str(fplan.save(tmp / f"{name}.json")))
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
    auto = plans["autockpt"]  # its one timing prices all three (each plan_fsdp call times the step anew)
    predicted = {"none": auto.baseline_step_ms, "full": auto.floor_step_ms, "autockpt": auto.predicted_step_ms}
    rows = []
    for index, (name, fplan) in enumerate(plans.items()):
        step_s = statistics.median(ranks[0]["seconds"][index])
        rows.append(Row(
            part="gloo-cpu", plan=name, world_size=WORLD, checkpointed_units=len(fplan.checkpointed),
            units=len(fplan.units) - 1, budget_bytes=budget, predicted_peak_bytes=fplan.predicted_peak_bytes,
            measured_peak_bytes=max(r["peaks"][index] for r in ranks), predicted_step_ms=predicted[name],
            measured_step_ms=1e3 * step_s, tokens_per_s_per_rank=tokens / step_s, plan_time_s=seconds[name],
        ))
    return rows


def llama8b_part() -> tuple[list[Row], autockpt.FSDPPlan]:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tokens = 8192
    ids = torch.randint(0, config.vocab_size, (1, tokens), device="meta")

    def loss(out, target):
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), target.flatten())

    started = time.perf_counter()
    fplan = autockpt.plan_fsdp(
        model, world_size=8, budget_gb=70, example_inputs=(ids,), example_target=ids, loss_fn=loss,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        target="h100-sxm-80gb",
    )
    plan_s = time.perf_counter() - started
    inner = [u for u in fplan.units if u]
    rows = [
        Row(part="llama3-8b-h100x8", plan="autockpt", world_size=8, checkpointed_units=len(fplan.checkpointed),
            units=len(inner), budget_bytes=fplan.budget_bytes, predicted_peak_bytes=fplan.predicted_peak_bytes,
            measured_peak_bytes=None, predicted_step_ms=fplan.predicted_step_ms, measured_step_ms=None,
            tokens_per_s_per_rank=tokens / fplan.predicted_step_ms * 1e3, plan_time_s=plan_s),
        Row(part="llama3-8b-h100x8", plan="full", world_size=8, checkpointed_units=len(inner), units=len(inner),
            budget_bytes=fplan.budget_bytes, predicted_peak_bytes=fplan.min_feasible_bytes, measured_peak_bytes=None,
            predicted_step_ms=fplan.floor_step_ms, measured_step_ms=None,
            tokens_per_s_per_rank=tokens / fplan.floor_step_ms * 1e3,
            plan_time_s=plan_s),
    ]
    return rows, fplan


def markdown(rows: list[Row], fplan: autockpt.FSDPPlan | None, command: str, elapsed_s: float) -> str:
    lines = [(f"`{command}`, {time.strftime('%Y-%m-%d', time.gmtime())}, {elapsed_s:.0f} s. GB = 10^9 bytes, "
             "GiB = 2^30 bytes."), ""]
    measured = [r for r in rows if r.part == "gloo-cpu"]
    if measured:
        c = CONFIG
        lines += [
            (f"**Measured, CPU gloo world {WORLD}**: decoder of {c['model']['layers']} blocks, width "
            f"{c['model']['width']}, vocabulary {c['model']['vocab']}, {c['batch']} x {c['seq']} tokens per rank, "
            f"AdamW; budget {BUDGET_FRACTION:.0%} of the way from the floor to the baseline; median of "
            f"{c['rounds']} alternating rounds (slower rank)."), "",
            ("| plan | checkpointed | predicted peak | measured peak (max rank) | under budget | predicted step ms | "
            "measured step ms | measured / none |"), "|---|---|---|---|---|---|---|---|",
        ]
        none = next(r for r in measured if r.plan == "none")
        for r in measured:
            lines.append(
                f"| {r.plan} | {r.checkpointed_units}/{r.units} | {r.predicted_peak_bytes:,} B | "
                f"{r.measured_peak_bytes:,} B | {'yes' if r.measured_peak_bytes <= r.budget_bytes else 'no'} | "
                f"{r.predicted_step_ms:.1f} | {r.measured_step_ms:.1f} | "
                f"{r.measured_step_ms / none.measured_step_ms:.3f} |"
            )
        auto = next(r for r in measured if r.plan == "autockpt")
        full = next(r for r in measured if r.plan == "full")
        lines += ["", (f"Budget {auto.budget_bytes:,} B per rank. autockpt / full measured step "
                      f"{auto.measured_step_ms / full.measured_step_ms:.3f} (predicted "
                      f"{auto.predicted_step_ms / full.predicted_step_ms:.3f})."), ""]
    if fplan is not None:
        big = {r.plan: r for r in rows if r.part == "llama3-8b-h100x8"}
        auto, full = big["autockpt"], big["full"]
        lines += [
            ("**Predicted, Llama-3-8B at world 8 on H100 SXM** (1 x 8192 tokens per rank, bf16 params, fp32 reduce, "
            f"fp32 AdamW, per-rank budget {format_bytes(fplan.budget_bytes)}), planned here in "
            f"{auto.plan_time_s:.0f} s:"), "",
            "```", fplan.summary(), "```", "",
            (f"Predicted tokens/s per GPU: autockpt {auto.tokens_per_s_per_rank:,.0f} ({auto.checkpointed_units} of "
            f"{auto.units} blocks checkpointed) against full checkpointing {full.tokens_per_s_per_rank:,.0f} "
            f"({auto.tokens_per_s_per_rank / full.tokens_per_s_per_rank - 1:+.1%}); peaks "
            f"{auto.predicted_peak_bytes / GB:.2f} GB and {full.predicted_peak_bytes / GB:.2f} GB. Not measured: no "
            "GPU cluster here; roofline times are optimistic (docs/ARCHITECTURE.md, devices.py)."),
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
    fplan = None
    if not args.skip_measured:
        with tempfile.TemporaryDirectory() as tmp:
            rows += measured_part(Path(tmp))
    if not args.skip_llama:
        big, fplan = llama8b_part()
        rows += big
    from results_readme import write_csv, write_section

    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "fsdp.csv", rows)
    command = ("python experiments/bench_fsdp.py " + " ".join(sys.argv[1:])).strip()
    text = markdown(rows, fplan, command, time.perf_counter() - started)
    (args.out / "fsdp.md").write_text(text + "\n")
    write_section("bench_fsdp", text, output=args.out)
    print(text)


if __name__ == "__main__":
    main()
