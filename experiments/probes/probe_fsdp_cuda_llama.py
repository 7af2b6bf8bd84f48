"""FSDP2 plans on one GPU at Llama-3-8B's block shape (issue 38): plans made in this process on CPU fakes for world 1
(``target="h100-sxm-80gb"``: roofline times, no GPU used to plan), then applied on the GPU (NCCL, world 1, a model on
the meta device), each plan's peak measured alone and its step timed against full checkpointing per block.

    python -m experiments.probes.probe_fsdp_cuda_llama --out DIR                 # on a machine with a GPU
    python -m experiments.probes.probe_fsdp_cuda_llama --out /tmp/x --tiny cpu   # a small config on gloo, to try the script
    python -m experiments.probes.probe_fsdp_cuda_llama --parts --batch 2 --pool-gb 0 --plan-only --out DIR  # parts' plans

The model: transformers ``LlamaForCausalLM`` with Llama-3-8B's blocks (hidden 4096, intermediate 14336, 32 heads, 8
KV heads) but ``--layers`` of them (default 4) and a ``--vocab`` (default 32000) that let two models and their
AdamW states sit on one 80 GB GPU at once; 1 x ``--seq`` tokens (default 8192), ``MixedPrecisionPolicy(bfloat16
params, float32 reduce)``, fp32 AdamW (foreach). Plans: nothing checkpointed, full and selective per block (the
roomy plan with every block so), autockpt halfway between selective's peak and nothing checkpointed, autockpt
halfway between the floor and selective's peak, and with a host pool (``--pool-gb`` > 0) autockpt halfway between
every block whole with its inputs offloaded and every block whole. With ``--parts``: every block with its MLP
checkpointed alone, every block with its attention so (their peaks measured on the fake process group as the planner
measures; no step time predicted for these two), autockpt at the MLP plan's peak, and autockpt a tenth of the way from
nothing checkpointed to the floor (where a plan's parts are the cheapest way to fit).

Peak: each plan's model alone on the GPU, two steps from a clean allocator (the first makes the optimizer states):
``torch.cuda.max_memory_allocated`` (and reserved) against ``predicted_peak_bytes``, and ``FSDPMemTracker``'s
figures by category against the plan's breakdown. Time: full checkpointing's model stays on the GPU; each other plan's
model is built beside it and the two step in turn for ``--rounds`` rounds after two untimed steps each (alternating,
one process); a step is timed with ``torch.cuda.synchronize`` and ``time.perf_counter``; the median per-round ratio
against full is set beside the plans' predicted ratio. Losses of the first two steps are compared with full's (same
seeded weights and batch; bf16 compute and nondeterministic attention backward kernels: close, not equal).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autockpt

TARGET = "h100-sxm-80gb"
FOR_LOOP = "full, for-loop AdamW"  # the full plan's peak once more with foreach=False


def llama_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    if args.tiny:
        return LlamaConfig(num_hidden_layers=args.layers, hidden_size=256, intermediate_size=768,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                           max_position_embeddings=args.seq, use_cache=False)
    return LlamaConfig(num_hidden_layers=args.layers, hidden_size=4096, intermediate_size=14336,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=args.vocab,
                       max_position_embeddings=args.seq, use_cache=False)


def meta_model(config: Any) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(config)


def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1).float(), target.flatten())


def make_plans(config: Any, args: argparse.Namespace) -> tuple[dict[str, autockpt.FSDPPlan], dict[str, float]]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # torch 2.11's export of a meta model records meta devices that the fake trace's CPU fakes then fail
    # (assert_tensor_metadata); 2.13 traces it: plan with --plan-only there and carry the plans (--plans)
    planned_model = meta_model(config)
    ids = torch.zeros((args.batch, args.seq), dtype=torch.long, device="meta")
    common = {"world_size": 1, "example_inputs": (ids,), "example_target": ids, "loss_fn": loss_fn,
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
              "target": TARGET, "units": [f"model.layers.{i}" for i in range(config.num_hidden_layers)],
              "optimizer": "adamw"}  # the GPU steps AdamW (0.3: no optimizer by default)
    seconds: dict[str, float] = {}

    def planned(name: str, budget: int, **extra: Any) -> autockpt.FSDPPlan:
        started = time.perf_counter()
        fplan = autockpt.plan_fsdp(planned_model, budget_bytes=budget, **common, **extra)
        seconds[name] = time.perf_counter() - started
        print(f"planned {name!r} in {seconds[name]:.1f} s: {fplan.summary().splitlines()[0]}", flush=True)
        return fplan

    none = planned("none", 10**13)
    inner = tuple(u for u in none.units if u)
    plans = {
        "none": none,
        "full": dataclasses.replace(none, budget_bytes=none.min_feasible_bytes, checkpointed=inner,
                                    predicted_peak_bytes=none.min_feasible_bytes,
                                    predicted_step_ms=none.floor_step_ms, ranks=()),
        "selective": dataclasses.replace(none, budget_bytes=none.selective_peak_bytes, selective=inner,
                                         predicted_peak_bytes=none.selective_peak_bytes,
                                         predicted_step_ms=none.selective_step_ms, ranks=()),
    }
    for name, low, high in (("autockpt keep-selective", none.selective_peak_bytes, none.baseline_peak_bytes),
                            ("autockpt selective-full", none.min_feasible_bytes, none.selective_peak_bytes)):
        if low < high:
            plans[name] = planned(name, (low + high) // 2)
        else:
            print(f"no {name!r} plan: nothing between {low} B and {high} B")
    if args.parts:
        plans.update(parts_plans(planned, config, none, inner, common))
    if not args.pool_gb:
        return plans, seconds
    pool_floor = planned("pool floor", 10**13, host_pool_gb=args.pool_gb).min_feasible_bytes
    if pool_floor < none.min_feasible_bytes:
        plans["autockpt + pool, under full"] = planned("autockpt + pool, under full",
                                                       (pool_floor + none.min_feasible_bytes) // 2,
                                                       host_pool_gb=args.pool_gb)
    else:
        print(f"no pooled plan: the pool floor {pool_floor} B is not under full's {none.min_feasible_bytes} B")
    return plans, seconds


def parts_plans(planned: Any, config: Any, none: autockpt.FSDPPlan, inner: tuple[str, ...],
                common: dict[str, Any]) -> dict[str, autockpt.FSDPPlan]:
    """Every block with one part checkpointed (its peak measured on the fake process group, as the planner does for
    a CUDA target; its step time not predicted: NaN), autockpt at the MLP plan's peak and a tenth under none."""
    from autockpt.fsdp.fake_world import fake_world, measure_sharded_step
    from autockpt.measure.loop import NAMED_OPTIMIZERS

    plans = {}
    for part in ("mlp", "self_attn"):
        parts = tuple(f"{unit}.{part}" for unit in inner)
        with fake_world(1):
            peak = measure_sharded_step(
                meta_model(config), world_size=1, units=none.units, checkpointed=(),
                checkpointed_parts=parts, reshard_after_forward=True, mp_policy=common["mp_policy"],
                inputs=(common["example_inputs"], {}, common["example_target"]), step_loss=loss_fn,
                make_optimizer=NAMED_OPTIMIZERS["adamw"], device_type="cuda",
            ).peak_bytes
        plans[f"{part} per block"] = dataclasses.replace(
            none, budget_bytes=peak, checkpointed_parts=parts, predicted_peak_bytes=peak,
            predicted_step_ms=float("nan"), ranks=())
    plans["autockpt at mlp's peak"] = planned("autockpt at mlp's peak", plans["mlp per block"].predicted_peak_bytes)
    tenth = none.baseline_peak_bytes - (none.baseline_peak_bytes - none.min_feasible_bytes) // 10
    plans["autockpt a tenth under none"] = planned("autockpt a tenth under none", tenth)
    return plans


def build(config: Any, fplan: autockpt.FSDPPlan, device: str) -> torch.nn.Module:
    """meta -> apply_fsdp -> to_empty -> seeded weights (the same on every call) and the rotary buffers."""
    model = meta_model(config)
    autockpt.apply_fsdp(model, fplan)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.to_local().normal_(0.0, 0.02, generator=generator)
        for module in model.modules():
            if hasattr(module, "inv_freq"):  # non-persistent buffers: made at construction, garbage after to_empty
                fresh = type(module)(model.config)
                for name, buffer in fresh.named_buffers(recurse=False):
                    getattr(module, name).copy_(buffer)
    return model


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> torch.Tensor:
    loss = loss_fn(model(ids), ids)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_alone(config: Any, fplan: autockpt.FSDPPlan, device: str, ids: torch.Tensor,
                  foreach: bool | None = None, tracked: bool = True) -> dict[str, Any]:
    """Two steps of ``fplan``'s model alone on the device from a clean allocator: peaks, tracker figures (with
    ``tracked``), losses. ``foreach``: AdamW's (None: torch's default, foreach on CUDA). FSDPMemTracker keeps the
    model it tracked alive after it is left (seen on CPU with torch 2.13: the model outlives ``del`` and
    ``gc.collect``; CUDA check 6's out-of-memory with torch 2.11 fits it), so each tracked row may leave its model
    on the device: ``--no-tracker`` for large models."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from autockpt.fsdp import unit_pool

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        left = torch.cuda.memory_allocated()
    model = build(config, fplan, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)
    tracker = FSDPMemTracker(model, optimizer) if tracked else None
    if tracker is not None:
        tracker.track_inputs(((ids,), {}, ids))
    losses = []
    with tracker if tracker is not None else contextlib.nullcontext():
        for index in range(2):
            losses.append(step(model, optimizer, ids).item())
            if index == 0 and tracker is not None:
                tracker.reset_mod_stats()
    sync(device)
    pool = unit_pool(model)
    result: dict[str, Any] = {"losses": losses, "pool_stats": str(pool.stats()) if pool is not None else "",
                              "tracker_peak_bytes": None, "tracker": {}}
    if tracker is not None:
        key = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device(device)
        snapshot = tracker.get_tracker_snapshot("peak")[key]
        result["tracker_peak_bytes"] = int(snapshot["Total"]) - (pool.capacity_bytes if pool is not None
                                                                  and device == "cpu" else 0)
        result["tracker"] = {getattr(k, "value", str(k)): int(v) for k, v in snapshot.items() if v and k != "Total"}
    if device == "cuda":
        result["max_allocated_bytes"] = torch.cuda.max_memory_allocated() - left
        result["max_reserved_bytes"] = torch.cuda.max_memory_reserved()
    del model, optimizer, tracker
    gc.collect()
    return result


def time_against(config: Any, plans: dict[str, autockpt.FSDPPlan], device: str, ids: torch.Tensor,
                 rounds: int) -> dict[str, tuple[list[float], list[float]]]:
    """Per plan but full: its step seconds and full's, alternating, with full's model kept throughout."""
    full_model = build(config, plans["full"], device)
    full_opt = torch.optim.AdamW(full_model.parameters(), lr=1e-4)
    out: dict[str, tuple[list[float], list[float]]] = {}
    for name, fplan in plans.items():
        if name == "full":
            continue
        model = build(config, fplan, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        pair = [(model, optimizer), (full_model, full_opt)]
        seconds: list[list[float]] = [[], []]
        for round_index in range(2 + rounds):
            order = (0, 1) if round_index % 2 == 0 else (1, 0)
            for which in order:
                sync(device)
                started = time.perf_counter()
                step(*pair[which], ids)
                sync(device)
                if round_index >= 2:
                    seconds[which].append(time.perf_counter() - started)
        out[name] = (seconds[0], seconds[1])
        print(f"timed {name!r}: median {statistics.median(seconds[0]) * 1e3:.1f} ms against full's "
              f"{statistics.median(seconds[1]) * 1e3:.1f} ms", flush=True)
        del model, optimizer, pair
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("device", nargs="?", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1, help="rows of --seq tokens per step")
    parser.add_argument("--parts", action="store_true", help="add the plans of checkpointed parts (MLP, attention)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--pool-gb", type=float, default=16.0)
    parser.add_argument("--tiny", action="store_true", help="a small config (to try the script on a CPU)")
    parser.add_argument("--plans", type=Path, default=None, help="a folder of plans --plan-only wrote")
    parser.add_argument("--plan-only", action="store_true", help="plan, save the plans into --out, stop")
    parser.add_argument("--no-tracker", action="store_true",
                        help="peaks by max_memory_allocated only (FSDPMemTracker keeps each row's model alive)")
    args = parser.parse_args()
    if args.no_tracker and args.device != "cuda":
        parser.error("--no-tracker measures with torch.cuda.max_memory_allocated: it needs the cuda device")
    if args.tiny:
        args.seq = min(args.seq, 256)
    args.out.mkdir(parents=True, exist_ok=True)
    config = llama_config(args)
    if args.plans is not None:
        index = json.loads((args.plans / "plans.json").read_text())
        plans = {name: autockpt.load_fsdp_plan(args.plans / file) for name, file in index["files"].items()}
        plan_seconds = index["seconds"]
    else:
        started = time.perf_counter()
        plans, plan_seconds = make_plans(config, args)
        files = {name: f"plan_{name.replace(' ', '_').replace(',', '')}.json" for name in plans}
        for name, fplan in plans.items():
            fplan.save(args.out / files[name])
        (args.out / "plans.json").write_text(json.dumps({"files": files, "seconds": plan_seconds,
                                                         "torch": torch.__version__}, indent=1))
        print(f"planned in {time.perf_counter() - started:.1f} s", flush=True)
    if args.plan_only:
        return

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1,
                            init_method="tcp://127.0.0.1:29541", timeout=datetime.timedelta(seconds=120))
    try:
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
        ids = ids.to(args.device)
        alone = {}
        # the plans count AdamW's for-loop step: its foreach temporaries are not in the prediction (docs/fsdp.md)
        runs = {**{name: (name, None) for name in plans}, FOR_LOOP: ("full", False)}
        for name, (plan_name, foreach) in runs.items():
            fplan = plans[plan_name]
            alone[name] = measure_alone(config, fplan, args.device, ids, foreach, tracked=not args.no_tracker)
            measured = alone[name].get("max_allocated_bytes", alone[name]["tracker_peak_bytes"])
            print(f"{name}: predicted {fplan.predicted_peak_bytes} B, measured {measured} B "
                  f"({100 * (measured / fplan.predicted_peak_bytes - 1):+.2f} %), tracker "
                  f"{alone[name]['tracker_peak_bytes']} B, losses {alone[name]['losses']}", flush=True)
        timed = time_against(config, plans, args.device, ids, args.rounds) if args.rounds else {}
    finally:
        dist.destroy_process_group()

    rows = []
    full = plans["full"]
    full_seconds = [s for _, f in timed.values() for s in f]
    for name, (plan_name, _) in runs.items():
        fplan = plans[plan_name]
        plan_s, full_s = timed.get(name, (None, None))
        ratios = [a / b for a, b in zip(plan_s, full_s)] if plan_s else [1.0] if name == "full" else [float("nan")]
        seconds = plan_s if plan_s else full_seconds if name == "full" else []
        step_ms = statistics.median(seconds) * 1e3 if seconds else float("nan")
        rows.append({
            "plan": name, "checkpointed": len(fplan.checkpointed) - len(set(fplan.checkpointed)
                                                                        & set(fplan.offloaded)),
            "selective": len(fplan.selective), "offloaded": len(fplan.offloaded),
            "full_offload": len(set(fplan.checkpointed) & set(fplan.offloaded)),
            "parts": len(fplan.checkpointed_parts),
            "units": len(fplan.units) - 1, "host_pool_bytes": fplan.host_pool_bytes,
            "budget_bytes": fplan.budget_bytes, "predicted_peak_bytes": fplan.predicted_peak_bytes,
            "max_allocated_bytes": alone[name].get("max_allocated_bytes"),
            "max_reserved_bytes": alone[name].get("max_reserved_bytes"),
            "tracker_peak_bytes": alone[name]["tracker_peak_bytes"],
            "predicted_step_ms": round(fplan.predicted_step_ms, 3), "measured_step_ms": round(step_ms, 3),
            "predicted_ratio_vs_full": round(fplan.predicted_step_ms / full.predicted_step_ms, 4),
            "measured_ratio_vs_full": round(statistics.median(ratios), 4),
            "round_ratio_min": round(min(ratios), 4), "round_ratio_max": round(max(ratios), 4),
            "loss_step1": alone[name]["losses"][0], "loss_step2": alone[name]["losses"][1],
            "plan_time_s": round(plan_seconds.get(name, 0.0), 1),
        })
    with open(args.out / "fsdp_cuda_llama.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    details = {name: {"predicted": dict(plans[p].ranks[0].breakdown) if plans[p].ranks else None,
                      "tracker": alone[name]["tracker"], "pool": alone[name]["pool_stats"]}
               for name, (p, _) in runs.items()}
    meta = {"command": " ".join(sys.argv), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "config": {k: getattr(args, k) for k in ("layers", "vocab", "seq", "batch", "rounds", "pool_gb", "tiny",
                                                     "parts")}}
    (args.out / "fsdp_cuda_llama.json").write_text(json.dumps({"meta": meta, "details": details}, indent=1))
    print(json.dumps(meta))
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
