"""Probe (issue 48, item 8, on a GPU): a Llama-3.2-1B-shaped decoder (fewer layers) in bf16 on CUDA, the eager model
against autockpt's plans at their floors: the captured program's own floor (``loss_chunk_tokens=0``) and the floor
with the loss in chunks (``"auto"``), with Liger-Kernel's fused linear cross-entropy beside them where its wheel was
carried (``apply_liger_kernel_to_llama(fused_linear_cross_entropy=True)``, its other kernels off).

    python -m experiments.probes.probe_loss_chunks_cuda --out DIR            (needs a CUDA device)
    python -m experiments.probes.probe_loss_chunks_cuda --out DIR --size small --device cpu   (a dry run)

Per program: ``max_memory_allocated`` (the step's own, forward + backward, no optimizer), reserved, the plan's
prediction, the loss and the largest gradient difference against the eager model, and tokens per second (median of
alternating rounds in one process). GB = 10^9 bytes.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autockpt
from autockpt.measure.step import alternating_step_seconds, measure_step
from experiments.common.anchors import own_step_peak
from experiments.common.results_readme import write_section

# layers, hidden, heads, KV heads, intermediate, vocabulary, batch, sequence
SIZES = {"cuda": (4, 2048, 32, 8, 8192, 128256, 2, 4096), "small": (2, 64, 4, 2, 128, 8000, 2, 64)}


def build(size: str, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor]:
    import transformers

    layers, hidden, heads, kv_heads, intermediate, vocab, batch, seq = SIZES[size]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=intermediate, vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=seq,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).train()
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return model, ids


def loss_of(output: Any) -> torch.Tensor:
    return output.loss


def with_liger(model: nn.Module) -> tuple[nn.Module | None, str]:
    """A copy of ``model`` whose loss is Liger's fused linear cross-entropy, or None and why not."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except Exception as error:  # noqa: BLE001  not carried, or no triton here
        return None, f"liger-kernel not available: {type(error).__name__}: {error}"
    liger = copy.deepcopy(model)
    try:
        apply_liger_kernel_to_llama(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=False,
                                    swiglu=False, model=liger)
    except Exception as error:  # noqa: BLE001
        return None, f"apply_liger_kernel_to_llama failed: {type(error).__name__}: {error}"
    return liger, ""


def largest_gradient_difference(model: nn.Module, reference: nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """(|loss - reference loss|, max |grad - reference grad| / max |reference grad|) of one step."""
    losses = []
    for module in (model, reference):
        for p in module.parameters():
            p.grad = None
        loss = loss_of(module(ids, labels=ids))
        loss.backward()
        losses.append(float(loss))
    worst = 0.0
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        if theirs.grad is not None:
            scale = float(theirs.grad.abs().max()) or 1.0
            worst = max(worst, float((mine.grad.float() - theirs.grad.float()).abs().max()) / scale)
    return abs(losses[0] - losses[1]), worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", default="cuda", choices=sorted(SIZES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--at-liger-peak", action="store_true", help="also autockpt planned at Liger's measured peak")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    model, ids = build(args.size, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    reference = copy.deepcopy(model)  # the eager model, never rewritten
    kwargs = {"labels": ids}
    modules: dict[str, nn.Module] = {"eager": reference}
    rows: dict[str, dict[str, Any]] = {"eager": {}}
    for label, option in (("autockpt floor, loss as captured", 0), ("autockpt floor, loss in chunks", "auto")):
        planner = autockpt.Planner.from_model(model, example_inputs=(ids,), example_kwargs=kwargs,
                                              loss_chunk_tokens=option)
        try:
            planner.plan(budget_bytes=1)
        except autockpt.InfeasibleBudgetError as refused:
            floor = refused.min_feasible_bytes
        try:
            module = planner.optimize(budget_bytes=floor)
        except autockpt.InfeasibleBudgetError as refused:  # not kept when measured: the budget it states is
            module = planner.optimize(budget_bytes=refused.min_feasible_bytes)
        plan = autockpt.get_plan(module)
        modules[label] = module
        rows[label] = {"predicted_peak_bytes": plan.predicted_peak_bytes - plan.foreign_bytes,
                       "loss_chunk_tokens": plan.loss_chunk_tokens, "recomputed_regions": len(plan.regions),
                       "summary": plan.summary()}
        print(plan.summary(), flush=True)
    liger, why = with_liger(model)
    if liger is not None:
        modules["liger fused linear cross-entropy"] = liger
        if args.at_liger_peak:  # autockpt at the peak Liger measures: the comparison at equal memory
            liger_peak = own_step_peak(measure_step(liger, (ids,), kwargs))
            planner = autockpt.Planner.from_model(model, example_inputs=(ids,), example_kwargs=kwargs)
            module = planner.optimize(budget_bytes=liger_peak + planner.trace.foreign_bytes)
            plan = autockpt.get_plan(module)
            label = "autockpt at Liger's peak"
            modules[label] = module
            rows[label] = {"predicted_peak_bytes": plan.predicted_peak_bytes - plan.foreign_bytes,
                           "loss_chunk_tokens": plan.loss_chunk_tokens, "recomputed_regions": len(plan.regions),
                           "summary": plan.summary()}
            print(plan.summary(), flush=True)
    for label, module in modules.items():
        step = measure_step(module, (ids,), kwargs)
        rows.setdefault(label, {}).update({"peak_bytes": own_step_peak(step), "reserved_bytes": step.reserved_bytes})
        if label != "eager":
            rows[label]["loss_difference"], rows[label]["gradient_difference"] = largest_gradient_difference(
                module, reference, ids)
    seconds = alternating_step_seconds(list(modules.values()), (ids,), kwargs, loss_of, rounds=args.rounds)
    tokens = ids.numel()
    for label, times in zip(modules, seconds):
        rows[label]["tokens_per_s"] = tokens / sorted(times)[len(times) // 2]
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "size": SIZES[args.size],
              "liger": why or "applied", "rows": rows}
    (args.out / "loss_chunks_cuda.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
    for label, row in rows.items():
        print(label, {k: v for k, v in row.items() if k != "summary"}, flush=True)
    summarize(args.out)


def summarize(folder: Path) -> None:
    result = json.loads((folder / "loss_chunks_cuda.json").read_text())
    layers, hidden, heads, kv_heads, intermediate, vocab, batch, seq = result["size"]
    lines = [
        (f"Device: {result['device']}. A Llama-3.2-1B-shaped decoder with {layers} layers (hidden {hidden}, {heads} "
         f"heads, {kv_heads} KV heads, intermediate {intermediate}, vocabulary {vocab}, tied), bf16 weights, batch "
         f"{batch} x {seq}, labels = inputs, forward + backward (no optimizer). Peaks: `max_memory_allocated` of the "
         f"step's own tensors; tokens/s: median of alternating rounds. Liger: {result['liger']}."), "",
        "| program | peak GB | predicted GB | reserved GB | chunk | loss diff | max grad diff (rel.) | tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in result["rows"].items():
        predicted = row.get("predicted_peak_bytes")
        lines.append(
            f"| {label} | {row['peak_bytes'] / 1e9:.3f} | {'' if predicted is None else f'{predicted / 1e9:.3f}'} "
            f"| {(row['reserved_bytes'] or 0) / 1e9:.3f} | {row.get('loss_chunk_tokens', '')} "
            f"| {row.get('loss_difference', ''):.3g} | {row.get('gradient_difference', ''):.3g} "
            f"| {row['tokens_per_s']:.0f} |" if label != "eager" else
            f"| {label} | {row['peak_bytes'] / 1e9:.3f} | | {(row['reserved_bytes'] or 0) / 1e9:.3f} | | | "
            f"| {row['tokens_per_s']:.0f} |"
        )
    write_section("probe_loss_chunks_cuda", "\n".join(lines), output=folder)


if __name__ == "__main__":
    main()
