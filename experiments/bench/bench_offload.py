"""Recompute only vs recompute + offload vs offload-everything vs Hugging Face checkpointing, at equal budgets.

    python -m experiments.bench.bench_offload --device cuda --out experiments/results/offload_bench_cuda
    python -m experiments.bench.bench_offload --device cpu --size small --out experiments/results/offload_bench_cpu

Per model (a GPT-2-medium-sized decoder and a Llama-style decoder; ``--size small`` shrinks both for a CPU run) and per
budget (HF checkpointing's measured peak, and 20 % of the unmodified activation memory above the static bytes):

* ``hf_checkpointing``: ``gradient_checkpointing_enable()`` (non-reentrant), every decoder layer recomputed;
* ``hf_checkpointing_save_on_cpu`` (CUDA only): the same, with every saved tensor moved to pinned host memory by
  PyTorch's ``torch.autograd.graph.save_on_cpu`` (offload everything that is checkpointed, torchtune-style);
* ``autockpt_recompute``: ``autockpt.optimize(..., budget_bytes=B)`` (no pool);
* ``autockpt_offload``: ``autockpt.optimize(..., budget_bytes=B, host_pool_gb="auto")``: keep, recompute or offload
  per region.

Measured per row: the step's peak (CUDA: ``max_memory_allocated``, and ``max_memory_reserved``; CPU: MemTracker minus
the host pool's buffer), autockpt's predicted peak, the host pool, and the step time as a ratio to the unmodified
model's (median over alternating rounds in this process). On CUDA it also saves a profiler trace of one step of the
offloading module (copy streams beside compute) in ``--out``. Nothing here is typed in by hand: ``bench_offload.csv``, ``bench_offload.md``
and the section ``bench_offload_<device>`` of the README.md in ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autockpt
from autockpt.measure.step import alternating_step_seconds, measure_step
from autockpt.runtime.offload import available_host_bytes
from autockpt.units import format_bytes
from experiments.common.anchors import own_step_peak
from experiments.common.results_readme import write_csv, write_section

# layers, width, heads, sequence, batch, vocabulary
SIZES = {
    "real": {"gpt2-medium": (24, 1024, 16, 1024, 8, 50257), "llama": (16, 2048, 16, 1024, 4, 32000)},
    "small": {"gpt2-medium": (4, 128, 4, 128, 4, 512), "llama": (4, 128, 4, 128, 4, 512)},
}
ROUNDS = 5


def build(name: str, size: str, device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    layers, dim, heads, seq, batch, vocab = SIZES[size][name]
    torch.manual_seed(0)
    if name == "gpt2-medium":
        config = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, n_positions=seq, vocab_size=vocab,
                            bos_token_id=0, eos_token_id=0, use_cache=False)
        model: nn.Module = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=4 * dim, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=seq,
                             use_cache=False)
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return model.to(device).train(), ids


class SaveOnCpu(nn.Module):
    """A model whose every saved tensor goes to pinned host memory (``torch.autograd.graph.save_on_cpu``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return self.model(*args, **kwargs)


@dataclass
class Row:
    model: str
    device: str
    budget_name: str
    budget_bytes: int
    strategy: str
    feasible: bool
    measured_peak_bytes: int | None
    reserved_peak_bytes: int | None
    predicted_peak_bytes: int | None
    host_pool_bytes: int
    offloaded_regions: int
    recomputed_regions: int
    step_time_ratio: float | None  # step time / the unmodified model's, median over alternating rounds
    note: str


def peak_of(module: nn.Module, ids: torch.Tensor) -> tuple[int, int | None]:
    """The step's own peak: on CUDA ``max_memory_allocated`` counts the other modules' parameters on the device too
    (HF's copy beside the model: 1.42 GB at GPT-2-medium's size), so the bytes the step found allocated and does not
    own (``foreign_bytes``) are taken off (``anchors.own_step_peak``)."""
    measured = own_step_peak(measure_step(module, (ids,), {"labels": ids}))
    reserved = torch.cuda.max_memory_reserved(ids.device) if ids.device.type == "cuda" else None
    return measured, reserved


def run_model(name: str, size: str, device: torch.device, out: Path) -> list[Row]:
    model, ids = build(name, size, device)
    kwargs = {"labels": ids}
    hf = copy.deepcopy(model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    modules: dict[str, nn.Module] = {"unmodified": model, "hf_checkpointing": hf}
    if device.type == "cuda":
        modules["hf_checkpointing_save_on_cpu"] = SaveOnCpu(hf)
    hf_peak, _ = peak_of(hf, ids)
    hf.to("cpu")  # autockpt plans for what the device holds: HF's copy of the model is not part of its step
    planner = autockpt.Planner.from_model(model, example_inputs=(ids,), example_kwargs=kwargs, host_pool_gb="auto")
    probe = planner.plan(budget_bytes=10**15)
    budgets = {
        "hf_peak": hf_peak,
        "20pct_activations": int(probe.static_bytes + 0.2 * (probe.baseline_peak_bytes - probe.static_bytes)),
    }
    rows: list[Row] = []
    for budget_name, budget in budgets.items():
        candidates: dict[str, nn.Module | str] = {}
        hf.to("cpu")
        for strategy, pool in (("autockpt_recompute", 0), ("autockpt_offload", available_host_bytes() // 2)):
            planner.host_pool_bytes = pool  # one trace for both: "auto" is half the host memory available
            try:
                candidates[strategy] = planner.optimize(budget_bytes=budget)
            except autockpt.InfeasibleBudgetError as error:
                candidates[strategy] = f"infeasible: smallest peak {error.min_feasible_bytes} bytes"
        hf.to(device)  # timed beside the others; each peak below is its step's own
        timed = {key: module for key, module in {**modules, **candidates}.items() if isinstance(module, nn.Module)}
        seconds = alternating_step_seconds(list(timed.values()), (ids,), kwargs, autockpt.measure.loss.default_loss, rounds=ROUNDS)
        ratio = {key: statistics.median(t / u for t, u in zip(times, seconds[0])) for key, times in zip(timed, seconds)}
        for strategy, module in {**modules, **candidates}.items():
            if strategy == "unmodified":
                continue
            if isinstance(module, str):
                rows.append(Row(name, str(device), budget_name, budget, strategy, False, None, None, None, 0, 0, 0,
                                None, module))
                continue
            measured, reserved = peak_of(module, ids)
            plan = autockpt.get_plan(module) if isinstance(module, autockpt.runtime.rewrite.OptimizedModule) else None
            actions = plan.policy.actions if plan is not None else ()
            rows.append(Row(
                name, str(device), budget_name, budget, strategy, plan is not None or measured <= budget, measured,
                reserved, plan.predicted_peak_bytes if plan else None, plan.host_pool_bytes if plan else 0,
                sum(a is autockpt.Action.OFFLOAD for a in actions), sum(a.recomputes for a in actions),
                ratio[strategy],
                f"predicted overhead {plan.predicted_overhead:.3f}" if plan is not None
                else ("over the budget" if measured > budget else ""),
            ))
        offloading = candidates.get("autockpt_offload")
        if device.type == "cuda" and isinstance(offloading, nn.Module):
            save_trace(offloading, ids, out / f"trace_{name}_{budget_name}.json")
    return rows


def save_trace(module: nn.Module, ids: torch.Tensor, path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        autockpt.measure.loss.default_loss(module(ids, labels=ids)).backward()
        torch.cuda.synchronize(ids.device)
    prof.export_chrome_trace(str(path))


def markdown(rows: list[Row], command: str) -> str:
    lines = [
        f"Made by `{command}` (GB = 10^9 bytes). Peak: "
        + ("`max_memory_allocated` (reserved beside it)" if rows and rows[0].device.startswith("cuda")
           else "MemTracker minus the host pool's buffer")
        + "; step time: ratio to the unmodified model, median of alternating rounds in one process. "
        + f"Machine: torch {torch.__version__}"
        + (f", {torch.cuda.get_device_name()}." if rows and rows[0].device.startswith("cuda") else ", CPU."),
        "",
        "| model | budget | strategy | measured peak | predicted peak | reserved peak | host pool | offloaded / recomputed regions | step time ratio | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    gb = lambda value: "" if not value else format_bytes(value)
    for r in rows:
        lines.append(
            f"| {r.model} | {r.budget_name} ({gb(r.budget_bytes)}) | {r.strategy} | {gb(r.measured_peak_bytes)} | "
            f"{gb(r.predicted_peak_bytes)} | {gb(r.reserved_peak_bytes)} | {gb(r.host_pool_bytes)} | "
            f"{r.offloaded_regions} / {r.recomputed_regions} | "
            f"{'' if r.step_time_ratio is None else f'{r.step_time_ratio:.3f}'} | {r.note} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="real")
    parser.add_argument("--models", default="gpt2-medium,llama")
    parser.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m experiments.bench.bench_offload " + " ".join(sys.argv[1:])
    rows: list[Row] = []
    for name in args.models.split(","):
        rows += run_model(name, args.size, device, args.out)
        # written after every model: a run stopped part-way (a device lease's time limit) keeps what it measured
        write_csv(args.out / "bench_offload.csv", rows)
        text = markdown(rows, command)
        (args.out / "bench_offload.md").write_text(text + "\n")
        write_section(f"bench_offload_{device.type}", text, output=args.out)
    print(text)


if __name__ == "__main__":
    main()
