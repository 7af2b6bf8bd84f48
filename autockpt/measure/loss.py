"""The loss of a training step: the default (Hugging Face ``output.loss``, else the floating-point outputs) and a check
of what a user's ``loss_fn`` returns. Profiling, measuring and planning all use it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autockpt.errors import LossFunctionError
from autockpt.types import describe_value


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` (Hugging Face), else ``output["loss"]``, else the sum of all floating-point outputs."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise LossFunctionError(
            f"the model's output has no floating-point tensor that requires grad (got {type(output).__name__}); "
            "pass loss_fn=lambda output: ... that returns the scalar loss to backpropagate."
        )
    return sum(t.sum() for t in leaves)


def checked_loss(loss_fn: Callable[[Any], Any]) -> Callable[[Any], torch.Tensor]:
    """``loss_fn`` with its result checked: a scalar floating-point tensor attached to the graph, or a
    ``LossFunctionError`` that says what came back (instead of backward failing deep inside profiling)."""

    def loss(output: Any) -> torch.Tensor:
        value = loss_fn(output)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point() and value.requires_grad:
            return value
        if isinstance(value, torch.Tensor):
            got = f"a {value.dtype} tensor of shape {tuple(value.shape)} (requires_grad={value.requires_grad})"
        else:
            got = f"{describe_value(value)} ({type(value).__name__})"
        raise LossFunctionError(
            f"loss_fn returned {got}; expected a floating-point tensor with one element that requires grad, computed "
            "from the model's output (e.g. lambda out: out.logits.float().mean()). Reduce it with .mean() or .sum(), "
            "and keep it attached to the graph (no .item(), .detach() or torch.no_grad())."
        )

    return loss
