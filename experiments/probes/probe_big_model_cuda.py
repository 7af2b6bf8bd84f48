"""A big model planned without its GPU, then run on it: the CPU-made plan's predictions against CUDA's.

    python -m experiments.probes.probe_big_model_cuda --out DIR                  # Llama-2-7B, bf16, AdamW, 1 x 8192 (H100)
    python -m experiments.probes.probe_big_model_cuda --out DIR --small --device cpu   # a smoke test of the script on CPU

1. The Llama is built on the meta device and planned as a laptop would plan it (``trace="auto"``: fake CPU tensors,
   roofline times for ``target="h100-sxm-80gb"``), at the target's memory and at each ``--budgets`` GB
   (10^9 bytes); the same on fake tensors of the CUDA device (``FakeTrace(device="cuda")``: the allocator's 512-byte
   blocks) when there is one.
2. The model is materialised on the device (random bf16 weights), and its steps measured with the loop's AdamW
   (``autockpt.measure_step``: the step's own peak; ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``
   around a whole step): the unmodified step, then each plan applied (``autockpt.apply_plan``, no re-planning).

Each row: the plan, its predicted peak (from the CPU fake trace, and from the CUDA fake trace), the measured peak,
the difference, whether the budget was kept. Writes ``big_model_cuda.csv`` and prints each row as it is made.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path
from typing import Any

import torch

import autockpt
from autockpt.measure.fake import FakeTrace

LLAMA2_7B = {"layers": 32, "hidden": 4096, "intermediate": 11008, "heads": 32, "kv_heads": 32, "vocab": 32000}
SMALL = {"layers": 2, "hidden": 256, "intermediate": 688, "heads": 4, "kv_heads": 4, "vocab": 1000}


def build(sizes: dict[str, int], seq: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=sizes["layers"], hidden_size=sizes["hidden"], intermediate_size=sizes["intermediate"],
        num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"], vocab_size=sizes["vocab"],
        max_position_embeddings=seq, use_cache=False,
    )
    return LlamaForCausalLM, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--small", action="store_true", help="a 2-layer Llama (smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--budgets", default="75,70", help="GB (10^9 bytes), besides the target's memory")
    args = parser.parse_args()
    sizes = SMALL if args.small else LLAMA2_7B
    seq = 128 if args.small else args.seq
    device = torch.device(args.device)
    make, config = build(sizes, seq)
    rows: list[dict[str, Any]] = []
    args.out.mkdir(parents=True, exist_ok=True)

    with torch.device("meta"):
        meta_model = make(config).to(torch.bfloat16)
    ids = torch.randint(0, sizes["vocab"], (1, seq))
    started = time.perf_counter()
    planner = autockpt.Planner.from_model(
        meta_model, example_inputs=(ids,), example_kwargs={"labels": ids}, target="h100-sxm-80gb",
        optimizer=torch.optim.AdamW,
    )
    plan_s = time.perf_counter() - started
    print(f"planned on meta in {plan_s:.1f} s: {planner.provenance.describe()}", flush=True)
    budgets = [None, *(int(float(b) * 1e9) for b in args.budgets.split(","))]
    if args.small:
        try:
            planner.plan(budget_bytes=1)
        except autockpt.InfeasibleBudgetError as error:
            floor = error.min_feasible_bytes
        budgets = [None, (floor + planner.trace.baseline_peak_bytes) // 2]
    plans = {}
    for budget in budgets:
        try:
            plans[budget] = planner.plan(budget_bytes=budget) if budget else planner.plan()
        except autockpt.InfeasibleBudgetError as error:
            print(f"budget {budget}: infeasible ({error.min_feasible_bytes})", flush=True)
    cuda_fake = None
    if device.type == "cuda":
        started = time.perf_counter()
        cuda_fake = autockpt.Planner.from_model(
            meta_model, example_inputs=(ids,), example_kwargs={"labels": ids}, trace=FakeTrace(device="cuda"),
            target="h100-sxm-80gb", optimizer=torch.optim.AdamW,
        )
        print(f"fake CUDA trace in {time.perf_counter() - started:.1f} s", flush=True)

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with device:
        model = make(config)
    torch.set_default_dtype(previous)
    model.train()
    real_ids = ids.to(device)

    def measured(module: torch.nn.Module) -> dict[str, Any]:
        for param in model.parameters():
            param.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        try:
            step = autockpt.measure_step(
                module, (real_ids,), {"labels": real_ids}, optimizer=torch.optim.AdamW(model.parameters()),
            )
        except torch.OutOfMemoryError as error:
            return {"measured_peak_bytes": None, "outcome": f"out of memory: {str(error)[:120]}"}
        finally:
            for param in model.parameters():
                param.grad = None
        result = {"measured_peak_bytes": step.peak_bytes, "outcome": "ran", "measure_s": round(time.perf_counter() - started, 1),
                  "measured_reserved_bytes": step.reserved_bytes}
        if device.type == "cuda":
            result["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
            result["max_memory_reserved"] = torch.cuda.max_memory_reserved(device)
        return result

    plans = {"unmodified": planner.plan_for_regions((), strategy="unmodified"), **plans}
    for budget, the_plan in plans.items():
        row: dict[str, Any] = {
            "model": "llama-2-7b" if not args.small else "llama-small", "device": str(device),
            "budget_bytes": the_plan.budget_bytes, "regions": len(the_plan.regions),
            "plan": "unmodified" if budget == "unmodified" else "autockpt",
            "loop": the_plan.loop.describe() if the_plan.loop is not None else "",
            "predicted_peak_cpu_fake_bytes": the_plan.predicted_peak_bytes,
            "predicted_step_ms_roofline": round(the_plan.baseline_step_ms * (1 + the_plan.predicted_overhead), 1),
            "plan_wall_s": round(plan_s, 1),
        }
        if cuda_fake is not None:
            row["predicted_peak_cuda_fake_bytes"] = cuda_fake.plan_for_regions(
                the_plan.regions, strategy="cpu plan", action=the_plan.planned_action
            ).predicted_peak_bytes
        started = time.perf_counter()
        module = model if not the_plan.regions else autockpt.apply_plan(
            model, the_plan, example_inputs=(real_ids,), example_kwargs={"labels": real_ids}
        )
        row["apply_s"] = round(time.perf_counter() - started, 1)
        row.update(measured(module))
        if row["measured_peak_bytes"] is not None:
            row["measured_over_predicted_percent"] = round(
                100 * (row["measured_peak_bytes"] - row["predicted_peak_cpu_fake_bytes"])
                / row["predicted_peak_cpu_fake_bytes"], 2
            )
            row["kept_budget"] = row["measured_peak_bytes"] <= row["budget_bytes"]
        print(row, flush=True)
        rows.append(row)
        del module
    fields = sorted({k for row in rows for k in row}, key=lambda k: next(i for i, r in enumerate(rows) if k in r))
    with open(args.out / "big_model_cuda.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
