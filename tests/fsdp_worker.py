"""One rank of an FSDP2 test (issue 38): loads the plan, ``apply_fsdp`` on a model built on the meta device, then
``to_empty`` and the seeded weights, trains two steps with AdamW on its part of the global batch under gloo, and
writes its losses, full gradients and the peak ``FSDPMemTracker`` measured (real tensors).

Spawned by tests/fsdp/test_fsdp_gloo.py (``torch.multiprocessing.start_processes``); the model is rebuilt from a seed
on every rank, as a torchrun script would build it.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist
from pipeline_worker import Decoder, lm_loss
from torch import nn

__all__ = ["CONFIG", "batch", "build", "lm_loss", "run_rank"]

# activations dominate the step: what checkpointing a unit frees shows in the peak
CONFIG: dict[str, Any] = {"seed": 0, "model": {"vocab": 256, "width": 64, "layers": 4}, "batch": 4, "seq": 128}
LR = 1e-2


def build(config: dict[str, Any]) -> nn.Module:
    torch.manual_seed(config["seed"])
    return Decoder(**config["model"])


def batch(config: dict[str, Any], rank: int | None = None, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (``config["batch"]`` rows per rank, ``world`` ranks), or rank ``rank``'s rows of it."""
    generator = torch.Generator().manual_seed(1)
    vocab, rows = config["model"]["vocab"], config["batch"]
    ids = torch.randint(0, vocab, (rows * world, config["seq"]), generator=generator)
    target = torch.randint(0, vocab, (rows * world, config["seq"]), generator=generator)
    if rank is None:
        return ids, target
    return ids[rank * rows:(rank + 1) * rows], target[rank * rows:(rank + 1) * rows]


def reference(config: dict[str, Any], world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process model on the global batch: two AdamW steps' losses, the first step's gradients."""
    model = build(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids, target = batch(config, world=world)
    losses, grads = [], {}
    for step in range(2):
        loss = lm_loss(model(ids), target)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


def _sharded(config: dict[str, Any], fplan: Any) -> nn.Module:
    """meta -> apply_fsdp -> to_empty -> the seeded weights, each rank its chunk (FSDP2 shards on dim 0)."""
    import autockpt

    with torch.device("meta"):
        model = build(config)
    autockpt.apply_fsdp(model, fplan)
    model.to_empty(device="cpu")
    full = build(config).state_dict()
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local()
            chunk = torch.chunk(full[name], world, dim=0)[rank] if rank < len(torch.chunk(full[name], world)) else None
            if chunk is not None and chunk.numel():
                local.copy_(chunk)
    return model


def run_rank(rank: int, world: int, config: dict[str, Any], plan_path: str, out_dir: str, init_file: str) -> None:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    import autockpt

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        fplan = autockpt.load_fsdp_plan(plan_path)
        ids, target = batch(config, rank, world)
        # 1. losses and gradients
        model = _sharded(config, fplan)
        names = [n for n, _ in model.named_parameters()]
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, grads = [], {}
        for step in range(2):
            loss = lm_loss(model(ids), target)
            loss.backward()
            if step == 0:
                grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach().clone())
        for value in losses:  # each rank's loss is its half's mean: the global one is their mean
            dist.all_reduce(value, op=dist.ReduceOp.AVG)
        del model, optimizer
        # 2. the peak, on a fresh model: FSDPMemTracker on real tensors, two steps as the plan counts them
        model = _sharded(config, fplan)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        ids, target = ids.clone(), target.clone()
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs(((ids,), {}, target))
        with tracker:
            for step in range(2):
                lm_loss(model(ids), target).backward()
                optimizer.step()
                optimizer.zero_grad()
                if step == 0:
                    tracker.reset_mod_stats()
        snapshot = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        result = {
            "losses": [v.item() for v in losses], "grads": grads, "names": names,
            "peak_bytes": int(snapshot["Total"]),
            "breakdown": {getattr(k, "value", str(k)): int(v) for k, v in snapshot.items() if k != "Total"},
        }
        with open(f"{out_dir}/rank{rank}.pkl", "wb") as out:
            pickle.dump(result, out)
    finally:
        dist.destroy_process_group()
