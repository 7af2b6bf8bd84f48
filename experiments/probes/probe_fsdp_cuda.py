"""FSDP2 plan made on CPU fakes against a real CUDA step (issue 38): plan the test decoder for world 1 here, apply it
on one GPU (NCCL, world 1, a meta model), two AdamW steps under FSDPMemTracker; print predicted against measured.

    python -m experiments.probes.probe_fsdp_cuda          # on a machine with a GPU; "cpu" as argument to try it on gloo
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

import autockpt
from experiments.common.fsdp_worker import CONFIG, LR, batch, build, lm_loss


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    started = time.perf_counter()
    ids, target = batch(CONFIG, 0, 1)
    # the GPU steps AdamW below: the plans cover that loop (0.3: no optimizer by default)
    common = {"world_size": 1, "example_inputs": (ids,), "example_target": target, "loss_fn": lm_loss,
              "optimizer": "adamw"}
    roomy = autockpt.plan_fsdp(build(CONFIG), budget_bytes=10**9, **common)
    middle = (roomy.min_feasible_bytes + roomy.baseline_peak_bytes) // 2
    plans = {"none": roomy, "middle": autockpt.plan_fsdp(build(CONFIG), budget_bytes=middle, **common)}
    print(f"planned in {time.perf_counter() - started:.1f} s", flush=True)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1,
                            init_method="tcp://127.0.0.1:29533")
    try:
        for name, fplan in plans.items():
            for foreach in (False, None):
                with torch.device("meta"):
                    model = build(CONFIG)
                autockpt.apply_fsdp(model, fplan)
                model.to_empty(device=device)
                optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=foreach)
                x, y = ids.to(device), target.to(device)
                tracker = FSDPMemTracker(model, optimizer)
                tracker.track_inputs(((x,), {}, y))
                with tracker:
                    for step in range(2):
                        lm_loss(model(x), y).backward()
                        optimizer.step()
                        optimizer.zero_grad()
                        if step == 0:
                            tracker.reset_mod_stats()
                snap = tracker.get_tracker_snapshot("peak")[torch.device(device, 0) if device == "cuda"
                                                             else torch.device(device)]
                measured = int(snap["Total"])
                print(f"{name} ({len(fplan.checkpointed)} checkpointed) foreach={foreach}: predicted "
                      f"{fplan.predicted_peak_bytes} B, measured {measured} B "
                      f"({100 * (measured / fplan.predicted_peak_bytes - 1):+.3f} %); measured "
                      f"{ {getattr(k, 'value', k): v for k, v in snap.items() if v} }; predicted "
                      f"{ {k: v for k, v in fplan.ranks[0].breakdown if v} }", flush=True)
                del model, optimizer, tracker
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
