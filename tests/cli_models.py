"""Factories the CLI tests name as ``cli_models:function`` (pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch
from torch import nn


def small_mlp() -> nn.Module:
    torch.manual_seed(3)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(64, 4))


def mlp_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(128, 64),)


def keyword_inputs() -> dict[str, torch.Tensor]:
    return {"input": torch.randn(128, 64)}


def raising_factory() -> nn.Module:
    raise RuntimeError("weights file missing")


def not_a_module() -> int:
    return 3


def string_inputs() -> str:
    return "not inputs"
