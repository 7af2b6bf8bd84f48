"""Small models that break naive checkpointing, shared by the test files of several stages."""

from __future__ import annotations

import torch
from torch import nn

from autockpt.present import zoo


class Chain(nn.Module):
    def __init__(self, width: int = 128, depth: int = 12) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class WritesIntoAnEarlierTensor(nn.Module):
    """Each block reads h and later writes into h in place; fine for autograd, fatal if h were a checkpoint input."""

    def __init__(self, width: int = 128, depth: int = 8) -> None:
        super().__init__()
        self.inner = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.outer = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for inner, outer in zip(self.inner, self.outer):
            h = inner(x)
            y = outer(torch.sigmoid(h) * 2)
            h.mul_(0.5)  # in place, after h was read above; Linear saved its input x, not h
            x = torch.tanh(y + h)
        return x


class ShapeBranchConvNet(nn.Module):
    """BatchNorm conv net with a branch on the input shape: fx cannot trace it, export can (shapes are static)."""

    def __init__(self, channels: int = 16, blocks: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()) for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x) if x.shape[0] > 1 else block(x)
        return x.mean()


def frozen_batchnorm_case() -> zoo.ZooCase:
    """A model in train mode whose first BatchNorm layers are frozen (eval): fine-tuning with frozen statistics."""
    torch.manual_seed(0)
    model = ShapeBranchConvNet(blocks=6)
    for block in model.blocks:
        block[1].running_mean.uniform_(-0.5, 0.5)
        block[1].running_var.uniform_(0.5, 2.0)
    model.train()
    for block in model.blocks[:3]:
        block[1].eval()
    return zoo.ZooCase(name="frozen-bn", model=model, args=(torch.randn(8, 3, 16, 16),), loss_fn=lambda out: out)
