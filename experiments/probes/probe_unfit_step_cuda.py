"""optimize() under a device memory below the unmodified step's peak, on CUDA: planned from the fake trace, only the
optimized step measured.

    python -m experiments.probes.probe_unfit_step_cuda --out DIR [--device cuda] [--models gpt2,llama,vit]

Per zoo model ("small" size): the unmodified step's measured peak (``autockpt.measure_step``), then
``autockpt.optimize(model, example_inputs=..., device_memory_bytes=0.7 x that peak)`` (the budget is the device
memory): which trace it chose, how often verification tightened the plan, the plan's predicted and measured peaks
and whether the budget was kept. Writes ``unfit_step_cuda.csv``.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch

import autockpt
from autockpt.present import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="gpt2,llama,vit")
    parser.add_argument("--fractions", default="0.7,0.8", help="device memory as fractions of the unmodified peak")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for name, fraction in [(n, float(f)) for n in args.models.split(",") for f in args.fractions.split(",")]:
        case = zoo.build(name, "small", seed=0)
        model = case.model.to(device)
        inputs = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in case.args)
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.kwargs.items()}
        unmodified = autockpt.measure_step(model, inputs, kwargs, case.loss_fn).peak_bytes
        memory = int(fraction * unmodified)
        started = time.perf_counter()
        try:
            module = autockpt.optimize(model, example_inputs=inputs, example_kwargs=kwargs, loss_fn=case.loss_fn,
                                       device_memory_bytes=memory)
        except autockpt.InfeasibleBudgetError as error:
            rows.append({"model": name, "device": str(device), "unmodified_measured_bytes": unmodified,
                         "device_memory_bytes": memory, "outcome": f"refused: {str(error)[:600]}"})
            print(rows[-1], flush=True)
            continue
        plan = autockpt.get_plan(module)
        row = {
            "model": name, "device": str(device), "unmodified_measured_bytes": unmodified,
            "device_memory_bytes": memory, "trace": plan.provenance.trace, "timing": plan.provenance.timing,
            "baseline_predicted_bytes": plan.baseline_peak_bytes, "predicted_peak_bytes": plan.predicted_peak_bytes,
            "measured_peak_bytes": plan.measured_peak_bytes, "measured_reserved_bytes": plan.measured_reserved_bytes,
            "kept_budget": plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= memory,
            "regions": len(plan.regions), "optimize_s": round(time.perf_counter() - started, 1),
            "notes": " | ".join(n for n in plan.notes if "tighten" in n or "measured" in n or "timing" in n)[:600],
        }
        print(row, flush=True)
        rows.append(row)
        del module, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    fields = sorted({k for row in rows for k in row}, key=lambda k: next(i for i, r in enumerate(rows) if k in r))
    with open(args.out / "unfit_step_cuda.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
