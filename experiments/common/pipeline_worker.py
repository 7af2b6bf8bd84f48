"""One rank of a pipeline test: runs ``autockpt.pipeline_schedule`` under gloo and writes what it measured.

Spawned by tests/pipeline/test_pipeline.py (``torch.multiprocessing.spawn``); the model is rebuilt from a seed on
every rank, as a torchrun script would build it. Shared with experiments/bench/bench_pipeline.py (and, through
``fsdp_worker``, the FSDP tests and benchmark); spawned ranks import it as ``experiments.common.pipeline_worker``.
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


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (torch's scaled_dot_product_attention); rotary positions when cos/sin given."""

    def __init__(self, width: int, heads: int, bias: bool) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=bias)
        self.out = nn.Linear(width, width, bias=bias)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        if rotary is not None:
            q, k = _rotate(q, *rotary), _rotate(k, *rotary)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, width))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class GPT2Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, bias=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Style(nn.Module):
    """GPT-2's layout without dropout: token and learned position embeddings, pre-norm blocks, final norm, a
    vocabulary head (untied here unless asked: the large head makes the last stage heavy)."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int = 4, positions: int = 256,
                 tied: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(positions, width)
        self.h = nn.ModuleList(GPT2Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class LlamaBlock(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(width)
        self.self_attn = CausalSelfAttention(width, heads, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(width)
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), (cos, sin))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class LlamaStyle(nn.Module):
    """Llama's layout: RMSNorm, SwiGLU, no biases, rotary positions computed once from a buffer and passed to
    every layer (as Hugging Face's Llama does: they cross every cut), untied head."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int = 4, hidden: int | None = None) -> None:
        super().__init__()
        head_dim = width // heads
        self.embed_tokens = nn.Embedding(vocab, width)
        self.register_buffer(
            "inv_freq", 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)), persistent=False
        )
        self.layers = nn.ModuleList(LlamaBlock(width, heads, hidden or 3 * width) for _ in range(layers))
        self.norm = nn.RMSNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        angles = torch.outer(torch.arange(ids.shape[1], device=ids.device).float(), self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def hugging_face_llama(vocab: int, width: int, layers: int, heads: int = 4) -> nn.Module:
    """Hugging Face's ``LlamaForCausalLM`` with grouped-query attention (half as many key/value heads) returning
    its logits: the eager course a traced library would leave (issue 45: masks, repeated heads) shows here."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class LlamaLogits(LlamaForCausalLM):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(input_ids=ids, use_cache=False).logits

    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=3 * width, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=1024,
                         use_cache=False)
    return LlamaLogits(config)


class TorchEncoderStack(nn.Module):
    """torch's own ``nn.TransformerEncoderLayer`` blocks in a plain ``nn.ModuleList`` under an embedding (issue 46:
    fx keeps each layer as one call, so the traced step shows no repeated run of ops; FSDP's default units come from
    the module list)."""

    def __init__(self, vocab: int = 1024, width: int = 32, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


MODELS = {
    "decoder": Decoder, "gpt2": GPT2Style, "llama": LlamaStyle, "hf-llama": hugging_face_llama,
    "torch-encoder": TorchEncoderStack,
}


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def build(config: dict[str, Any]) -> nn.Module:
    torch.manual_seed(config["seed"])
    return MODELS[config.get("kind", "decoder")](**config["model"])


def _step(schedule: Any, rank: int, world: int, batch: dict, config: dict[str, Any], losses: list) -> None:
    if rank == 0:
        schedule.step(batch["ids"])
    elif rank == world - 1:
        schedule.step(target=batch["target"], losses=losses, return_outputs=config.get("return_outputs", True))
    else:
        schedule.step()


def _buffers_and_batch(schedule: Any, rank: int, world: int, batch: dict) -> list[torch.Tensor]:
    """What a step of this rank holds before it starts besides the stage's parameters: the receive buffers (made by
    the first step: none before it) and the batch tensors this rank is stepped with."""
    stage = schedule._stage
    buffers = [
        info.buffer
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
        for info in infos
        if isinstance(getattr(info, "buffer", None), torch.Tensor)
    ]
    held = [batch["ids"]] if rank == 0 else [batch["target"]] if rank == world - 1 else []
    return [*buffers, *held]


def _memtracker_step(schedule: Any, rank: int, world: int, batch: dict, config: dict[str, Any]) -> int:
    """One more step, gradients reset first, whose peak torch's MemTracker measures: its storage accounting (every
    tensor the step makes, through its dispatch mode, beside what exists before: the stage module's parameters, the
    receive buffers the first step made, the batch tensors this rank is stepped with), without its per-module
    attribution. That attribution (ModTracker's global module hooks) cannot run a pipelining step in torch 2.13: it
    refuses a module called more than once per tracking context ("MemTracker does not support memory tracking for
    multiple iterative calls": the stage module runs once per microbatch), and on the schedule's first step the
    gradient hooks it puts on the receive buffers (leaves) make the backward-metadata inference's
    ``torch.autograd.grad`` raise ("A leaf node was passed to _will_engine_execute_node")."""
    from torch.distributed._tools.mem_tracker import MemTracker

    stage = schedule._stage
    for p in stage.submod.parameters():
        p.grad = None
    tracker = MemTracker()
    tracker.track_external(stage.submod, *_buffers_and_batch(schedule, rank, world, batch))
    module_hooks = tracker._mod_tracker  # entered by MemTracker.__enter__: leave its global module hooks out
    module_hooks.__enter__ = lambda: module_hooks  # type: ignore[method-assign]
    module_hooks.__exit__ = lambda *_: None  # type: ignore[method-assign]
    dist.barrier()
    with tracker:
        _step(schedule, rank, world, batch, config, [])
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def run_rank(rank: int, world: int, config: dict[str, Any], plan_path: str, out_dir: str, init_file: str) -> None:
    import autockpt
    from autockpt.measure.storage_tracker import StorageTracker

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
            # (what exists before the step, read again each step: the receive buffers are made by the first; and
            # every storage made during the step)
            existing = [*stage_module.parameters(), *_buffers_and_batch(schedule, rank, world, batch)]
            tracker = StorageTracker(torch.device("cpu"), existing)
            dist.barrier()
            started = time.perf_counter()
            with tracker:
                _step(schedule, rank, world, batch, config, losses)
            seconds.append(time.perf_counter() - started)
            peaks.append(max(event.peak_bytes for event in tracker.events))
        memtracker_peak = _memtracker_step(schedule, rank, world, batch, config)
        for _ in range(config.get("timed_steps", 0)):  # untracked steps, timed (the benchmark's)
            dist.barrier()
            started = time.perf_counter()
            _step(schedule, rank, world, batch, config, [])
            seconds.append(time.perf_counter() - started)
        grads = {name: p.grad.clone() for name, p in stage_module.named_parameters() if p.grad is not None}
        result = {
            "peaks": peaks, "memtracker_peak": memtracker_peak, "seconds": seconds, "losses": [loss.item() for loss in losses], "grads": grads,
            "state_dict_keys": list(stage_module.state_dict()),
            "same_objects": all(
                any(p is q for q in model.parameters()) for p in stage_module.parameters()
            ),
        }
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as handle:
            pickle.dump(result, handle)
    finally:
        dist.destroy_process_group()


def time_alternating(rank: int, world: int, config: dict[str, Any], plan_paths: list[str], out_dir: str,
                     init_file: str) -> None:
    """Step time of several pipeline plans of one model, compared in one process group: every rank builds a
    schedule per plan, runs two untimed steps of each, then ``config["rounds"]`` rounds that step each plan once in
    turn (the slower rank's time is the step's). Alternating spreads the machine's drift over all plans."""
    import autockpt

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        model = build(config)
        batch = torch.load(os.path.join(out_dir, "batch.pt"))
        schedules = [
            autockpt.pipeline_schedule(model, autockpt.load_pipeline_plan(path), rank=rank, device="cpu",
                                       loss_fn=lm_loss)
            for path in plan_paths
        ]
        seconds: list[list[float]] = [[] for _ in schedules]
        for round_index in range(2 + config["rounds"]):
            for index, schedule in enumerate(schedules):
                for p in model.parameters():
                    p.grad = None
                dist.barrier()
                started = time.perf_counter()
                _step(schedule, rank, world, batch, config, [])
                elapsed = torch.tensor([time.perf_counter() - started])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if round_index >= 2:
                    seconds[index].append(elapsed.item())
        if rank == 0:
            with open(os.path.join(out_dir, "alternating.pkl"), "wb") as handle:
                pickle.dump(seconds, handle)
    finally:
        dist.destroy_process_group()
