"""Built-in example models, random-initialised from configs (no downloads), with example inputs.

Used by the demo, the tests and the benchmarks. Hugging Face decoder (gpt2, llama), encoder (bert, vit) and
encoder-decoder (t5) models, a diffusers UNet and VAE, and plain PyTorch models (mlp, cnn, transformer, control_flow). ``build(name, size)`` returns a ``ZooCase``; sizes are "tiny" (tests)
and "small" (benchmarks); ``blocks=`` sets how many repeated blocks a model has at its size's widths and inputs.
Hugging Face and diffusers entries need ``pip install autockpt[zoo]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class ZooCase:
    name: str
    model: nn.Module
    args: tuple
    kwargs: dict = field(default_factory=dict)
    loss_fn: Callable[[Any], torch.Tensor] | None = None


SIZES = ("tiny", "small", "bench")


def build(name: str, size: str = "tiny", *, seed: int = 0, blocks: int | None = None) -> ZooCase:
    """The zoo model ``name`` at ``size``, its weights drawn after ``torch.manual_seed(seed)``. ``blocks``: how many
    repeated blocks it has (layers of the transformers, residual blocks of the conv net, hidden layers of the MLP
    and of control_flow; None: the size's), its widths, inputs and loss the size's; the UNet and VAE have none."""
    if name not in BUILDERS:
        raise ValueError(f"unknown zoo model {name!r}; choose one of {', '.join(sorted(BUILDERS))}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1):
        raise ValueError(f"blocks must be an integer >= 1 or None (the size's), got {blocks!r}")
    if blocks is not None and name in ("unet", "vae"):
        raise ValueError(f"the zoo's {name} has no repeated blocks to set: give blocks=None")
    torch.manual_seed(seed)
    return BUILDERS[name](size, blocks)


# ----------------------------------------------------------------------------------------------- plain PyTorch


def _mlp(size: str, blocks: int | None) -> ZooCase:
    width, depth, batch = {"tiny": (128, 16, 256), "small": (512, 16, 1024), "bench": (1024, 24, 2048)}[size]
    depth = blocks or depth
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    return ZooCase(name="mlp", model=model, args=(torch.randn(batch, width),))


class _ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x  # in place, as in torchvision's ResNet
        return self.relu(out)


class ConvNet(nn.Module):
    """A small ResNet-style conv net: BatchNorm, in-place ReLU and in-place residual adds."""

    def __init__(self, channels: int, blocks: int, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(*[_ResidualBlock(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


def _cnn(size: str, blocks: int | None) -> ZooCase:
    channels, depth, batch, hw = {"tiny": (16, 12, 8, 16), "small": (32, 8, 16, 32), "bench": (64, 8, 32, 32)}[size]
    model = ConvNet(channels, blocks or depth)
    return ZooCase(name="cnn", model=model, args=(torch.randn(batch, 3, hw, hw),), loss_fn=_mean_square)


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(dim // self.heads)
        attn = self.drop(scores.softmax(dim=-1)) @ v
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(batch, seq, dim)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class TinyTransformer(nn.Module):
    """Decoder-style transformer language model with dropout; fx-traceable."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList([_Block(dim, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _transformer(size: str, blocks: int | None) -> ZooCase:
    vocab, dim, heads, layers, seq, batch = {
        "tiny": (64, 64, 4, 6, 64, 4),
        "small": (256, 256, 8, 8, 256, 8),
        "bench": (512, 384, 6, 6, 512, 4),
    }[size]
    model = TinyTransformer(vocab, dim, heads, blocks or layers, seq)
    ids = torch.randint(0, vocab, (batch, seq))
    return ZooCase(name="transformer", model=model, args=(ids,), loss_fn=lambda logits: _lm_loss(logits, ids))


class DataDependentNet(nn.Module):
    """Python control flow on tensor values: not traceable by fx or export."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if x.mean() > 0:  # data-dependent branch
                x = x + layer(x)
            else:
                x = x - layer(x)
        return self.head(x)


def _control_flow(size: str, blocks: int | None) -> ZooCase:
    width, depth, batch = {"tiny": (128, 16, 256), "small": (512, 12, 1024), "bench": (1024, 16, 2048)}[size]
    model = DataDependentNet(width, blocks or depth)
    return ZooCase(name="control_flow", model=model, args=(torch.randn(batch, width),))


# ------------------------------------------------------------------------------------- Hugging Face, diffusers


def _gpt2(size: str, blocks: int | None) -> ZooCase:
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, dim, heads, seq, batch, vocab = {
        "tiny": (4, 64, 4, 64, 2, 128),
        "small": (6, 128, 4, 128, 4, 512),
        "bench": (6, 384, 6, 512, 4, 2048),
    }[size]
    layers = blocks or layers
    config = GPT2Config(
        n_layer=layers, n_embd=dim, n_head=heads, n_positions=seq, vocab_size=vocab, bos_token_id=0, eos_token_id=0
    )
    return _token_case("gpt2", GPT2LMHeadModel(config), vocab, batch, seq)


def _vit(size: str, blocks: int | None) -> ZooCase:
    from transformers import ViTConfig, ViTForImageClassification

    layers, dim, heads, image, patch, batch = {
        "tiny": (4, 64, 4, 32, 4, 4),
        "small": (6, 128, 4, 64, 8, 8),
        "bench": (8, 256, 8, 96, 8, 16),
    }[size]
    layers = blocks or layers
    config = ViTConfig(
        hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * dim,
        image_size=image, patch_size=patch, num_labels=10,
    )
    model = ViTForImageClassification(config)
    return ZooCase(
        name="vit", model=model, args=(torch.randn(batch, 3, image, image),), kwargs={"labels": torch.randint(0, 10, (batch,))}
    )


# layers, width, heads, sequence, batch, vocabulary of the token models below
_TOKEN_SIZES = {"tiny": (4, 64, 4, 32, 2, 128), "small": (6, 128, 4, 128, 4, 512), "bench": (6, 384, 6, 512, 4, 2048)}


def _token_case(name: str, model: nn.Module, vocab: int, batch: int, seq: int) -> ZooCase:
    """Random token ids as input and as labels (the model computes its own loss)."""
    ids = torch.randint(0, vocab, (batch, seq))
    return ZooCase(name=name, model=model, args=(ids,), kwargs={"labels": ids})


def _bert(size: str, blocks: int | None) -> ZooCase:
    from transformers import BertConfig, BertForMaskedLM

    layers, dim, heads, seq, batch, vocab = _TOKEN_SIZES[size]
    layers = blocks or layers
    config = BertConfig(
        vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * dim, max_position_embeddings=seq,
    )
    return _token_case("bert", BertForMaskedLM(config), vocab, batch, seq)


def _t5(size: str, blocks: int | None) -> ZooCase:
    from transformers import T5Config, T5ForConditionalGeneration

    layers, dim, heads, seq, batch, vocab = _TOKEN_SIZES[size]
    layers = blocks or layers
    config = T5Config(
        vocab_size=vocab, d_model=dim, d_ff=4 * dim, num_layers=layers, num_decoder_layers=layers, num_heads=heads,
        d_kv=dim // heads, decoder_start_token_id=0,
    )
    return _token_case("t5", T5ForConditionalGeneration(config), vocab, batch, seq)


def _llama(size: str, blocks: int | None) -> ZooCase:
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, dim, heads, seq, batch, vocab = _TOKEN_SIZES[size]
    layers = blocks or layers
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=4 * dim, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads // 2, max_position_embeddings=seq,
    )
    return _token_case("llama", LlamaForCausalLM(config), vocab, batch, seq)


def _unet(size: str, blocks: int | None) -> ZooCase:
    from diffusers import UNet2DModel

    channels, image, batch = {"tiny": ((16, 32), 16, 2), "small": ((32, 64, 64), 32, 4), "bench": ((64, 128, 128), 64, 8)}[size]
    model = UNet2DModel(
        sample_size=image, in_channels=3, out_channels=3, block_out_channels=channels, layers_per_block=1,
        down_block_types=("DownBlock2D",) * len(channels), up_block_types=("UpBlock2D",) * len(channels),
        norm_num_groups=8,
    )
    sample = torch.randn(batch, 3, image, image)
    return ZooCase(
        name="unet", model=model, args=(sample, torch.tensor(10)), loss_fn=lambda out: out.sample.pow(2).mean()
    )


def _vae(size: str, blocks: int | None) -> ZooCase:
    """diffusers' ``AutoencoderKL`` trained as a reconstruction: encoder, the latent distribution's mode, decoder."""
    from diffusers import AutoencoderKL

    channels, image, batch = {"tiny": ((8, 16), 16, 2), "small": ((32, 64), 32, 4), "bench": ((64, 128), 64, 8)}[size]
    model = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=channels, layers_per_block=1, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * len(channels), up_block_types=("UpDecoderBlock2D",) * len(channels),
        norm_num_groups=8, sample_size=image,
    )
    sample = torch.randn(batch, 3, image, image)
    return ZooCase(name="vae", model=model, args=(sample,), loss_fn=lambda out: (out.sample - sample).pow(2).mean())


def _mean_square(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


BUILDERS: dict[str, Callable[[str, int | None], ZooCase]] = {
    "mlp": _mlp,
    "cnn": _cnn,
    "transformer": _transformer,
    "control_flow": _control_flow,
    "gpt2": _gpt2,
    "bert": _bert,
    "t5": _t5,
    "llama": _llama,
    "vit": _vit,
    "unet": _unet,
    "vae": _vae,
}
