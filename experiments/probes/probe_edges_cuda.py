"""Probe (issue 46, items 1-3, on a GPU): the edges users hit, measured with ``torch.cuda.max_memory_allocated``.

    python -m experiments.probes.probe_edges_cuda --out DIR                    (needs a CUDA device)
    python -m experiments.probes.probe_edges_cuda --out DIR --device cpu       (a dry run, MemTracker peaks)

Three parts, one row per measured step (the plans are verified as ``optimize`` verifies them; the row's step is
measured again by ``autockpt.measure_step`` in the loop the row names, gradients of earlier steps dropped):

* ``loop`` (item 1): the issue's GPT-NeoX (hidden 128, 4 layers, vocabulary 2000, 4 x 256) under bf16 autocast,
  planned for a loop that holds the output through backward (``output_held=True``, the default) and for one that
  drops it (``False``: Hugging Face's Trainer, torchtitan), each at half-way from that loop's floor to its unmodified
  peak, each plan's step measured in both loops; the eager model's step in both loops beside them. Autocast is
  entered for each planning and each step alone (it keeps its casts of the weights until its outermost block ends).
* ``floor`` (item 2): conv nets at the smallest budget autockpt states (``optimize(budget_bytes=1)`` refuses and
  names it; ``optimize`` at it): the zoo's BatchNorm CNN, the issue's Hugging Face ResNet (hidden sizes 32-256,
  depths 2, 8 x 3 x 96 x 96), torchvision's ResNet-18 where torchvision is installed, the zoo's UNet and VAE.
* ``vae`` (item 3): diffusers' ``AutoencoderKL`` (the zoo's, tiny) at half-way: budget kept (measured before the
  gradients compared are made), and the largest gradient difference against the eager model's, relative to that
  gradient's largest value, beside the same between two eager steps (what the device's kernels alone give).

A refusal at the stated minimum is a row (not kept, the refusal's first line); a case that fails otherwise is printed
with its name and leaves no row.

Error = (measured - predicted) / measured (positive: predicted low). Writes ``edges_cuda.csv``, ``edges_cuda.md`` and
the section ``probe_edges_cuda`` of the README.md in ``--out``. Nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn

import autockpt
from autockpt.present import zoo
from autockpt.present.zoo import ZooCase as Case
from experiments.bench.bench_cuda_prediction import on_device
from experiments.bench.bench_min_feasible import optimized_at_stated_minimum
from experiments.common.results_readme import write_section


@dataclass(frozen=True)
class Row:
    part: str
    model: str
    plan: str  # what the plan was made for
    loop: str  # the loop the step was measured in
    budget_bytes: int | None
    predicted_peak_bytes: int | None
    measured_peak_bytes: int
    reserved_peak_bytes: int | None
    error: float | None  # (measured - predicted) / measured
    kept: bool | None
    max_grad_diff: float | None  # largest |optimized - eager| over the parameters, relative to that gradient's largest
    eager_rerun_grad_diff: float | None  # the same between two eager steps: what the device's kernels alone give
    seconds: float
    failure: str = ""  # why the row has no plan (optimize refused the stated minimum)


def neox(device: torch.device) -> Case:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=2000, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, max_position_embeddings=256, use_cache=False)
    ids = torch.randint(0, 2000, (4, 256), device=device)
    return Case(name="gpt-neox", model=GPTNeoXForCausalLM(config).to(device), args=(),
                kwargs={"input_ids": ids, "labels": ids})


def hf_resnet(device: torch.device) -> Case:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[2, 2, 2, 2], num_labels=10)
    images = torch.randn(8, 3, 96, 96, device=device)
    labels = torch.randint(0, 10, (8,), device=device)
    return Case(name="hf-resnet", model=ResNetForImageClassification(config).to(device), args=(images,),
                kwargs={"labels": labels})


def resnet18(device: torch.device) -> Case | None:
    try:
        import torchvision
    except ImportError:
        return None
    torch.manual_seed(0)
    images = torch.randn(8, 3, 96, 96, device=device)
    labels = torch.randint(0, 10, (8,), device=device)
    model = torchvision.models.resnet18(num_classes=10).to(device)
    return Case(name="resnet18", model=model, args=(images,),
                loss_fn=lambda out: nn.functional.cross_entropy(out, labels))


def from_zoo(name: str, device: torch.device) -> Case:
    case = on_device(zoo.build(name), device)
    if name == "vae":  # the zoo's loss holds its own (CPU) sample: the same reconstruction loss on the moved one
        sample = case.args[0]
        case = dataclasses.replace(case, loss_fn=lambda out: (out.sample - sample).pow(2).mean())
    return case


def autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16)


def step_row(part: str, case: Case, plan_for: str, module: nn.Module, *, held: bool,
             plan: autockpt.Plan | None, budget: int | None, under: contextlib.AbstractContextManager | None = None
             ) -> Row:
    """One step of ``module`` measured in the loop ``held`` names (``under``: a context the step runs in, entered
    for it alone: autocast keeps its casts of the weights until its outermost block ends)."""
    started = time.perf_counter()
    module.zero_grad(set_to_none=True)
    with under if under is not None else contextlib.nullcontext():
        measured = autockpt.measure_step(module, case.args, case.kwargs, case.loss_fn, output_held=held)
    module.zero_grad(set_to_none=True)
    predicted = None if plan is None else plan.predicted_peak_bytes
    error = None if predicted is None else round((measured.peak_bytes - predicted) / measured.peak_bytes, 5)
    return Row(part, case.name, plan_for, "output held" if held else "output dropped", budget, predicted,
               measured.peak_bytes, measured.reserved_bytes, error,
               None if budget is None else measured.peak_bytes <= budget, None, None, time.perf_counter() - started)


def loop_rows(device: torch.device) -> list[Row]:
    """Autocast entered for each planning and each measured step on its own, as ``bench_output_loop.py`` does."""
    case = neox(device)
    rows = [step_row("loop", case, "eager", case.model, held=held, plan=None, budget=None, under=autocast(device))
            for held in (True, False)]
    for plan_held in (True, False):
        with autocast(device):
            planner = autockpt.Planner.from_model(case.model, example_kwargs=case.kwargs,
                                                  options=autockpt.PlanOptions(output_held=plan_held))
            probe = planner.plan(budget_bytes=10**15)
            budget = (probe.min_feasible_bytes + probe.baseline_peak_bytes) // 2
            module = planner.optimize(budget_bytes=budget)
        plan = autockpt.get_plan(module)
        plan_for = "output held" if plan_held else "output dropped"
        rows += [step_row("loop", case, plan_for, module, held=held, plan=plan, budget=budget, under=autocast(device))
                 for held in (True, False)]
    return rows


def floor_row(case: Case) -> Row:
    """``optimize`` at the stated minimum; a refusal there is a row of its own (not kept), as in bench_min_feasible."""
    started = time.perf_counter()
    kwargs = {"example_inputs": case.args, "example_kwargs": case.kwargs, "loss_fn": case.loss_fn}
    stated, module, refusal = optimized_at_stated_minimum(case.model, **kwargs)
    if module is None:
        return Row("floor", case.name, "stated minimum", "output held", stated, None, -1, None, None, False, None,
                   None, time.perf_counter() - started, refusal)
    return step_row("floor", case, "stated minimum", module, held=True, plan=autockpt.get_plan(module),
                    budget=stated)


def gradients(module: nn.Module, case: Case, named: dict[nn.Parameter, str]) -> dict[str, torch.Tensor]:
    case.model.zero_grad(set_to_none=True)
    output = module(*case.args, **case.kwargs)
    case.loss_fn(output).backward()
    grads = {named[p]: p.grad.detach().clone() for p in case.model.parameters() if p.grad is not None}
    case.model.zero_grad(set_to_none=True)
    return grads


def largest_relative_difference(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    assert want.keys() == got.keys(), "the two steps gave gradients to different parameters"
    return max(float((want[k] - got[k]).abs().max() / want[k].abs().max().clamp_min(1e-30)) for k in want)


def vae_row(device: torch.device) -> Row:
    case = from_zoo("vae", device)
    planner = autockpt.Planner.from_model(case.model, example_inputs=case.args, loss_fn=case.loss_fn)
    probe = planner.plan(budget_bytes=10**15)
    budget = (probe.min_feasible_bytes + probe.baseline_peak_bytes) // 2
    module = planner.optimize(budget_bytes=budget)
    # measured first: the gradients compared below would be held beside the step, and max_memory_allocated counts
    # every tensor the process holds
    row = step_row("vae", case, "half-way", module, held=True, plan=autockpt.get_plan(module), budget=budget)
    named = {p: name for name, p in case.model.named_parameters()}
    steps = []
    for stepped in (case.model, case.model, module):
        torch.manual_seed(1)
        steps.append(gradients(stepped, case, named))
    eager, rerun, optimized = steps
    return dataclasses.replace(row, max_grad_diff=largest_relative_difference(eager, optimized),
                               eager_rerun_grad_diff=largest_relative_difference(eager, rerun))


def markdown(table: pd.DataFrame, command: str, device: torch.device) -> str:
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (MemTracker)"
    lines = [
        (f"Made by `{command}` on {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}. Peaks in bytes of "
         "one forward + backward (`max_memory_allocated` on CUDA; reserved beside it); error = (measured - predicted) "
         "/ measured (positive: predicted low)."),
        "",
        ("| part | model | plan made for | loop measured | budget | predicted | measured | reserved | error | kept | "
         "grad diff (relative) | eager rerun's | seconds | refused |"),
        "|---|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]

    def figure(value: Any, spec: str = ",.0f") -> str:
        return "" if value is None or pd.isna(value) else format(value, spec)

    for r in table.itertuples():
        error = "" if r.error is None or pd.isna(r.error) else f"{100 * r.error:+.2f} %"
        kept = "" if r.kept is None or pd.isna(r.kept) else ("yes" if r.kept else "no")
        measured = r.measured_peak_bytes if r.measured_peak_bytes >= 0 else None  # -1: refused, not measured
        lines.append(f"| {r.part} | {r.model} | {r.plan} | {r.loop} | {figure(r.budget_bytes)} | "
                     f"{figure(r.predicted_peak_bytes)} | {figure(measured)} | "
                     f"{figure(r.reserved_peak_bytes)} | {error} | {kept} | {figure(r.max_grad_diff, '.2e')} | "
                     f"{figure(r.eager_rerun_grad_diff, '.2e')} | {r.seconds:.1f} | {r.failure} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--parts", default="loop,floor,vae")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --device cpu for a dry run)")
    args.out.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    rows: list[Row] = []

    def run(make: Callable[[], list[Row]], what: str) -> None:
        try:
            new = make()
        except Exception as error:  # noqa: BLE001  one failing case must not hide the others' figures
            print(f"{what}: {type(error).__name__}: {str(error)[:400]}", flush=True)
            new = []
        finally:  # what a case left is freed before the next is measured
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for row in new:
            print(row, flush=True)
        rows.extend(new)
        pd.DataFrame([r.__dict__ for r in rows]).to_csv(args.out / "edges_cuda.csv", index=False)

    def floor_case(name: str, build: Callable[[], Case | None]) -> list[Row]:
        case = build()
        if case is None:
            print(f"floor {name}: not run (torchvision is not installed)", flush=True)
            return []
        return [floor_row(case)]

    if "loop" in parts:
        run(lambda: loop_rows(device), "loop gpt-neox")
    if "floor" in parts:
        builders = {"cnn": lambda: from_zoo("cnn", device), "hf-resnet": lambda: hf_resnet(device),
                    "resnet18": lambda: resnet18(device), "unet": lambda: from_zoo("unet", device),
                    "vae": lambda: from_zoo("vae", device)}
        for name, build in builders.items():
            run(lambda name=name, build=build: floor_case(name, build), f"floor {name}")
    if "vae" in parts:
        run(lambda: [vae_row(device)], "vae")
    command = "python -m experiments.probes.probe_edges_cuda " + " ".join(sys.argv[1:])
    text = markdown(pd.DataFrame([r.__dict__ for r in rows]), command, device)
    (args.out / "edges_cuda.md").write_text(text)
    write_section("probe_edges_cuda", text, output=args.out)
    print(text)


if __name__ == "__main__":
    main()
