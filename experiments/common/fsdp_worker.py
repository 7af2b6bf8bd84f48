"""One rank of the FSDP2 tests (issue 38): for each case in turn, loads its plan, ``apply_fsdp`` on a model built on
the meta device, then ``to_empty`` and the seeded weights, trains two steps with AdamW on its part of the global batch
under gloo, and writes its losses, full gradients and the peaks ``FSDPMemTracker`` and autockpt's ``StorageTracker``
measured (real tensors).

Spawned by tests/fsdp/test_fsdp_gloo.py (``torch.multiprocessing.start_processes``); the model is rebuilt from a seed
on every rank, as a torchrun script would build it. Shared with experiments/bench/bench_fsdp.py and
experiments/probes/probe_fsdp_cuda.py; spawned ranks import it as ``experiments.common.fsdp_worker``, so the
repository root must be on ``sys.path`` (pytest's ``pythonpath``; ``python -m`` from the root).
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from experiments.common.pipeline_worker import MODELS, lm_loss

__all__ = ["CONFIG", "batch", "build", "lm_loss", "run_rank", "time_alternating", "tracked_peak"]

# activations dominate the step: what checkpointing a unit frees shows in the peak
CONFIG: dict[str, Any] = {"seed": 0, "model": {"vocab": 256, "width": 64, "layers": 4}, "batch": 4, "seq": 128}
LR = 1e-2


def build(config: dict[str, Any]) -> nn.Module:
    """``config["kind"]``: "decoder" (default: LayerNorm and GELU MLP blocks, no attention), "llama" (RMSNorm,
    causal attention with rotary positions, SwiGLU) or "gpt2" (``pipeline_worker.MODELS``)."""
    torch.manual_seed(config["seed"])
    return MODELS[config.get("kind", "decoder")](**config["model"])


def batch(config: dict[str, Any], rank: int | None = None, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (``config["batch"]`` rows per rank, ``world`` ranks), or rank ``rank``'s rows of it."""
    generator = torch.Generator().manual_seed(1)
    vocab, rows = config["model"]["vocab"], config["batch"]
    ids = torch.randint(0, vocab, (rows * world, config["seq"]), generator=generator)
    target = torch.randint(0, vocab, (rows * world, config["seq"]), generator=generator)
    if rank is None:
        return ids, target
    # copies: a slice would keep the global batch's storage, which FSDPMemTracker counts as the rank's input
    return ids[rank * rows:(rank + 1) * rows].clone(), target[rank * rows:(rank + 1) * rows].clone()


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
    built = build(config)
    full = built.state_dict()
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        made = dict(built.named_buffers())  # non-persistent ones too (LlamaStyle's inv_freq): not in state_dict
        for name, buffer in model.named_buffers():
            buffer.copy_(made[name])
        for name, param in model.named_parameters():
            local = param.to_local()
            chunk = torch.chunk(full[name], world, dim=0)[rank] if rank < len(torch.chunk(full[name], world)) else None
            if chunk is not None and chunk.numel():
                local.copy_(chunk)
    return model


def tracked_peak(config: dict[str, Any], fplan: Any, ids: torch.Tensor, target: torch.Tensor,
                 foreach: bool | None = None, make_optimizer: Any = None) -> tuple[int, dict]:
    """This rank's peak over two AdamW steps (``foreach``: AdamW's; ``make_optimizer(parameters)``: another
    optimizer) of a freshly sharded model, by FSDPMemTracker on real tensors, and its breakdown by the tracker's
    categories."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    model = _sharded(config, fplan)
    optimizer = (make_optimizer(model.parameters()) if make_optimizer is not None
                 else torch.optim.AdamW(model.parameters(), lr=LR, foreach=foreach))
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs(((ids,), {}, target))
    with tracker:
        _two_steps(model, optimizer, ids, target, after_first=tracker.reset_mod_stats)
    return _fsdp_tracked_peak(tracker, model)


def _fsdp_tracked_peak(tracker: Any, model: nn.Module) -> tuple[int, dict]:
    """FSDPMemTracker's peak, the host pool's capacity taken off, and its breakdown by the tracker's categories."""
    snapshot = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return int(snapshot["Total"]) - _pool_bytes(model), {getattr(k, "value", str(k)): int(v)
                                                         for k, v in snapshot.items() if k != "Total"}


def _two_steps(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, target: torch.Tensor,
               after_first: Any = None) -> list[float]:
    """Two training steps, as the plan counts them (the first makes the optimizer's states); their losses."""
    losses = []
    for step in range(2):
        loss = lm_loss(model(ids), target)
        loss.backward()
        losses.append(loss.item())  # a float: no tensor kept into the next step
        del loss
        optimizer.step()
        optimizer.zero_grad()
        if step == 0 and after_first is not None:
            after_first()
    return losses


def _pool_bytes(model: nn.Module) -> int:
    """The capacity of the model's host pool of offloaded units (0 without one): on the CPU it is a CPU buffer the
    trackers count (from the first forward on), host memory that the plan's device peak leaves out (beside a GPU no
    tracker of the device counts it)."""
    from autockpt.fsdp import unit_pool

    pool = unit_pool(model)
    return pool.capacity_bytes if pool is not None else 0


def run_rank(rank: int, world: int, jobs: list[tuple[dict[str, Any], str, str]], init_file: str) -> None:
    """Each job ``(config, plan_path, result_path)`` in turn, in one process group: the spawn and the imports, most
    of a case's time on a 2-core machine, are paid once for all of them. ``result_path`` names the rank as
    ``{rank}`` (every rank is given the same jobs: a target function from this module, not from a test module, spares
    each rank importing the test's module and its helpers)."""
    import autockpt

    with _process_group(rank, world, init_file):
        for config, plan_path, result_path in jobs:
            result = _rank_result(config, autockpt.load_fsdp_plan(plan_path), rank, world)
            with open(result_path.format(rank=rank), "wb") as out:
                pickle.dump(result, out)


@contextlib.contextmanager
def _process_group(rank: int, world: int, init_file: str) -> Iterator[None]:
    """This rank in a gloo group of ``world`` (one thread, a 60 s timeout), destroyed on the way out."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rank_result(config: dict[str, Any], fplan: Any, rank: int, world: int) -> dict[str, Any]:
    """This rank's first step's full gradients (a model of their own, untracked), then two steps of a fresh one
    tracked by both trackers at once (``_tracked_steps``): both peaks, the losses (averaged over the ranks) and the
    parameter names. The second step's gradients would need no run of their own, but they follow an AdamW update,
    whose first step moves every weight by about the learning rate whatever its gradient's size: compared so, a
    Hugging Face Llama's differed from the single process's by 1.2e-6 where the first step's keep within 1e-6."""
    ids, target = batch(config, rank, world)
    model = _sharded(config, fplan)
    lm_loss(model(ids), target).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    del model
    tracked = _tracked_steps(config, fplan, ids, target)
    # the gloo race (tests/fsdp/test_fsdp_gloo.py, ``_gloo_race_bytes``) can leave an all-gather buffer alive at a
    # rank's peak: a run over this rank's prediction is made again, once, by every rank (the collectives need them
    # all), and the lower kept, as the two runs of one tracker each that the trackers once had gave
    over = torch.tensor([float(min(tracked["peak_bytes"], tracked["own_peak_bytes"]) > fplan.ranks[rank].peak_bytes)])
    dist.all_reduce(over, op=dist.ReduceOp.MAX)
    if over.item():
        again = _tracked_steps(config, fplan, ids, target)
        tracked = min(tracked, again, key=lambda run: min(run["peak_bytes"], run["own_peak_bytes"]))
    averaged = torch.tensor(tracked.pop("losses"))
    dist.all_reduce(averaged, op=dist.ReduceOp.AVG)  # each rank's loss is its half's mean: the global one is theirs
    return {"losses": averaged.tolist(), "grads": grads, "names": list(grads), **tracked,
            "measured_twice": bool(over.item())}


def _tracked_steps(config: dict[str, Any], fplan: Any, ids: torch.Tensor, target: torch.Tensor) -> dict[str, Any]:
    """Two steps of a freshly sharded model tracked by FSDPMemTracker and autockpt's own ``StorageTracker`` at once
    (each the other's cross-check; one run for both, not one each: issue 46): their peaks, FSDPMemTracker's breakdown
    and the two losses. The order of entering matters: MemTracker keeps the ``UntypedStorage.resize_`` it found when
    made, StorageTracker the one it finds when entered, so StorageTracker, entered inside, wraps FSDPMemTracker's
    wrapper and both see FSDP2's resizes (entered the other way round, StorageTracker would miss them)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from autockpt.measure.storage_tracker import StorageTracker

    model = _sharded(config, fplan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    fsdp_tracker = FSDPMemTracker(model, optimizer)
    fsdp_tracker.track_inputs(((ids,), {}, target))
    own_tracker = StorageTracker(torch.device("cpu"), [*model.parameters(), *model.buffers(), ids, target])
    with fsdp_tracker, own_tracker:
        losses = _two_steps(model, optimizer, ids, target, after_first=fsdp_tracker.reset_mod_stats)
    peak, breakdown = _fsdp_tracked_peak(fsdp_tracker, model)
    own_peak = max(event.peak_bytes for event in own_tracker.events) - _pool_bytes(model)
    return {"peak_bytes": peak, "own_peak_bytes": own_peak, "breakdown": breakdown, "losses": losses}


def time_alternating(rank: int, world: int, config: dict[str, Any], plan_paths: list[str], out_dir: str,
                     init_file: str) -> None:
    """Step time and peak of several FSDP plans of one model in one process group: each rank measures each plan's
    peak (``tracked_peak``), then shards a model per plan, runs two untimed steps of each, then ``config["rounds"]``
    rounds that step each plan once in turn (the slower rank's time is the step's)."""
    import time

    import autockpt

    with _process_group(rank, world, init_file):
        ids, target = batch(config, rank, world)
        plans = [autockpt.load_fsdp_plan(path) for path in plan_paths]
        peaks = [tracked_peak(config, fplan, ids, target)[0] for fplan in plans]
        models = [_sharded(config, fplan) for fplan in plans]
        optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
        seconds: list[list[float]] = [[] for _ in plans]
        for round_index in range(2 + config["rounds"]):
            for index, (model, optimizer) in enumerate(zip(models, optimizers)):
                dist.barrier()
                started = time.perf_counter()
                lm_loss(model(ids), target).backward()
                optimizer.step()
                optimizer.zero_grad()
                elapsed = torch.tensor([time.perf_counter() - started])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if round_index >= 2:
                    seconds[index].append(elapsed.item())
        with open(f"{out_dir}/alternating{rank}.pkl", "wb") as handle:
            pickle.dump({"seconds": seconds, "peaks": peaks}, handle)
