"""One rank of a pipeline test: runs ``autockpt.pipeline_schedule`` under gloo and writes what it measured.

Spawned by tests/test_pipeline.py (``torch.multiprocessing.spawn``); the model is rebuilt from a seed on every rank,
as a torchrun script would build it.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Decoder(nn.Module):
    """Embedding, blocks, norm and a vocabulary head (tied to the embedding when asked): no dropout."""

    def __init__(self, vocab: int = 1024, width: int = 32, layers: int = 4, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def build(config: dict[str, Any]) -> nn.Module:
    torch.manual_seed(config["seed"])
    return Decoder(**config["model"])


def run_rank(rank: int, world: int, config: dict[str, Any], plan_path: str, out_dir: str, init_file: str) -> None:
    import autockpt
    from autockpt.trace import StorageTracker

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        model = build(config)
        pplan = autockpt.load_pipeline_plan(plan_path)
        schedule = autockpt.pipeline_schedule(model, pplan, rank=rank, device="cpu", loss_fn=lm_loss)
        batch = torch.load(os.path.join(out_dir, "batch.pt"))
        stage_module = schedule._stage.submod
        peaks, seconds = [], []
        losses: list[torch.Tensor] = []
        for _ in range(config.get("steps", 2)):
            for p in stage_module.parameters():
                p.grad = None
            losses = []
            # MemTracker cannot run a pipelining step: its module hooks register multi-grad hooks, which the
            # torch.autograd.grad of PipelineStage's backward refuses; autockpt's tracker counts the same storages
            # (the parameters, and every storage made during the step: receive buffers on the first step)
            tracker = StorageTracker(torch.device("cpu"), list(stage_module.parameters()))
            dist.barrier()
            started = time.perf_counter()
            with tracker:
                if rank == 0:
                    schedule.step(batch["ids"])
                elif rank == world - 1:
                    schedule.step(target=batch["target"], losses=losses, return_outputs=config.get("return_outputs", True))
                else:
                    schedule.step()
            seconds.append(time.perf_counter() - started)
            peaks.append(max(event.peak_bytes for event in tracker.events))
        for _ in range(config.get("timed_steps", 0)):  # untracked steps, timed (the benchmark's)
            dist.barrier()
            started = time.perf_counter()
            if rank == 0:
                schedule.step(batch["ids"])
            elif rank == world - 1:
                schedule.step(target=batch["target"], losses=[], return_outputs=config.get("return_outputs", True))
            else:
                schedule.step()
            seconds.append(time.perf_counter() - started)
        grads = {name: p.grad.clone() for name, p in stage_module.named_parameters() if p.grad is not None}
        result = {
            "peaks": peaks, "seconds": seconds, "losses": [loss.item() for loss in losses], "grads": grads,
            "state_dict_keys": list(stage_module.state_dict()),
            "same_objects": all(
                any(p is q for q in model.parameters()) for p in stage_module.parameters()
            ),
        }
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as handle:
            pickle.dump(result, handle)
    finally:
        dist.destroy_process_group()
