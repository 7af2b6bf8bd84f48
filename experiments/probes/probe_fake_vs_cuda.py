"""What differs when a CPU box plans for CUDA: the fake trace on CPU tensors against the measured trace on CUDA.

    python -m experiments.probes.probe_fake_vs_cuda --out DIR    (needs a CUDA device)

For a few zoo models: the measured CUDA trace's baseline peak and static bytes, the fake CPU trace's, and the
difference (CUDA allocator rounding, workspaces and kernels' own temporaries, attention kernels' saved tensors).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch

import autockpt
from autockpt.measure.fake import FakeTrace
from autockpt.present import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="mlp,cnn,gpt2,llama,vit")
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        case = zoo.build(name, "small", seed=0)
        cuda = torch.device("cuda")
        model = case.model.to(cuda)
        inputs = tuple(a.to(cuda) if isinstance(a, torch.Tensor) else a for a in case.args)
        kwargs = {k: v.to(cuda) if isinstance(v, torch.Tensor) else v for k, v in case.kwargs.items()}
        measured = autockpt.Planner.from_model(model, example_inputs=inputs, example_kwargs=kwargs,
                                               loss_fn=case.loss_fn).trace
        cpu_model = case.model.to("cpu")
        cpu_inputs = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in inputs)
        cpu_kwargs = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        fake = autockpt.Planner.from_model(cpu_model, example_inputs=cpu_inputs, example_kwargs=cpu_kwargs,
                                           loss_fn=case.loss_fn, trace_source=FakeTrace()).trace
        row = {
            "model": name, "cuda_baseline_peak_bytes": measured.baseline_peak_bytes,
            "fake_cpu_baseline_peak_bytes": fake.baseline_peak_bytes,
            "cuda_static_bytes": measured.static_bytes, "fake_cpu_static_bytes": fake.static_bytes,
            "peak_difference_percent": round(100 * (measured.baseline_peak_bytes - fake.baseline_peak_bytes)
                                             / measured.baseline_peak_bytes, 3),
            "cuda_events": len(measured.events), "fake_events": len(fake.events),
        }
        print(row, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "fake_vs_cuda.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
