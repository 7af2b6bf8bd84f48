"""The output projection and the cross-entropy computed over chunks of tokens (issue 48's runtime; the planner does
not choose it yet): the full logits, their float32 upcast, their softmax and their gradient never exist at once.

    loss = chunked_linear_cross_entropy(hidden, lm_head.weight, labels, chunk_tokens=1024)

is ``F.cross_entropy((hidden @ weight.T + bias).float(), labels, ignore_index=-100)`` (optionally with Gemma's final
soft-capping ``tanh(z / c) * c`` before the upcast, and the reductions "mean", "sum" or a Hugging Face
``num_items_in_batch`` divisor), holding one chunk of ``chunk_tokens`` x vocabulary logits at a time. Forward keeps
only what it was given (hidden states, weight, bias, labels); backward recomputes each chunk's logits and turns them
into that chunk's gradients (hidden states, weight, bias), so the step pays one more projection (the planner's cost
model prices it) instead of holding ``tokens x vocabulary`` values from forward to backward. Liger-Kernel and Cut
Cross-Entropy do the same with Triton or CUDA kernels; this is plain PyTorch, so it runs on CPU and CUDA, under fake
tensors and ``torch.compile``.

Labels are taken as given: a causal LM's shift (``labels[..., 1:]`` against ``logits[..., :-1, :]``) is the caller's,
as Hugging Face's loss does it before the cross-entropy. Under autocast the projection runs as autocast runs it in
forward, and backward recomputes it under the same autocast state, so the chunks' logits are the forward's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

REDUCTIONS = ("mean", "sum")


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items: float | torch.Tensor | None = None,
    softcap: float | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """The cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``, one chunk of tokens at a time.

    ``hidden``: (..., hidden size); ``labels``: the same leading shape, integers (``ignore_index`` where no loss is
    taken). ``reduction``: "mean" (over the labels that are not ignored, as ``F.cross_entropy``) or "sum";
    ``num_items``: divide the sum by it instead (Hugging Face's ``num_items_in_batch``; with it, ``reduction`` must be
    "sum", as Hugging Face's loss does). ``softcap``: Gemma's final logit soft-capping. ``upcast``: the logits to
    float32 before the softmax (Hugging Face's loss does; without it the softmax runs in the projection's dtype).
    """
    _check(hidden, weight, labels, bias, chunk_tokens, reduction, num_items, softcap)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    if flat_labels.shape[0] != flat_hidden.shape[0]:
        raise ValueError(
            f"labels {tuple(labels.shape)} and hidden states {tuple(hidden.shape)} hold different numbers of tokens "
            f"({flat_labels.shape[0]} and {flat_hidden.shape[0]}): shift the labels (or the hidden states) first"
        )
    return _ChunkedLinearCrossEntropy.apply(
        flat_hidden, weight, bias, flat_labels, chunk_tokens, ignore_index, reduction, num_items, softcap, upcast,
    )


def _check(
    hidden: Any, weight: Any, labels: Any, bias: Any, chunk_tokens: Any, reduction: Any, num_items: Any, softcap: Any,
) -> None:
    if not all(isinstance(t, torch.Tensor) for t in (hidden, weight, labels)):
        raise TypeError("hidden, weight and labels must be tensors")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight {tuple(weight.shape)} must be (vocabulary, hidden size) with hidden size {hidden.shape[-1]} (the "
            "projection's weight, as nn.Linear holds it)"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be (vocabulary,) = ({weight.shape[0]},)")
    if labels.dtype.is_floating_point or labels.dtype.is_complex:
        raise TypeError(f"labels must be integers (class indices), got {labels.dtype}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if num_items is not None and reduction != "sum":
        raise ValueError("num_items divides the summed loss: give reduction='sum' with it, as Hugging Face's loss does")
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive number (Gemma's final_logit_softcapping), got {softcap!r}")


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward sums each chunk's loss; backward recomputes each chunk's logits for its gradients (module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
        chunk_tokens: int, ignore_index: int, reduction: str, num_items: Any, softcap: float | None, upcast: bool,
    ) -> torch.Tensor:
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
        total = hidden.new_zeros((), dtype=torch.float32)
        for rows in _chunks(hidden.shape[0], chunk_tokens):
            logits = _logits(hidden[rows], weight, bias, softcap, upcast)
            picked = logits.gather(1, safe_labels[rows].unsqueeze(1)).squeeze(1)
            total = total + ((torch.logsumexp(logits, dim=-1) - picked) * valid[rows]).sum()
        divisor = _divisor(valid, reduction, num_items)
        # a tensor divisor is saved as autograd saves tensors (not held by ctx), so a trace sees it kept for backward
        divisor_tensor = divisor if isinstance(divisor, torch.Tensor) else None
        ctx.save_for_backward(hidden, weight, bias, safe_labels, valid, divisor_tensor)
        ctx.chunk_tokens, ctx.softcap, ctx.upcast = chunk_tokens, softcap, upcast
        ctx.divisor = None if divisor_tensor is not None else divisor
        ctx.autocast = _autocast_state(hidden.device.type)
        return (total / divisor).to(_loss_dtype(hidden, weight, upcast))

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, safe_labels, valid, divisor_tensor = ctx.saved_tensors
        scale = grad_loss.float() / (divisor_tensor if divisor_tensor is not None else ctx.divisor)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
        for rows in _chunks(hidden.shape[0], ctx.chunk_tokens):
            with _autocast_as(hidden.device.type, ctx.autocast), torch.enable_grad():
                # the chunk's logits again, differentiated through the ops forward ran (projection, soft-capping,
                # upcast): the same kernels, so the same gradients as the model's own loss, to rounding
                chunk = hidden[rows].detach().requires_grad_(ctx.needs_input_grad[0])
                chunk_weight = weight.detach().requires_grad_(ctx.needs_input_grad[1])
                chunk_bias = bias.detach().requires_grad_(grad_bias is not None) if bias is not None else None
                logits = _logits(chunk, chunk_weight, chunk_bias, ctx.softcap, ctx.upcast)
            with torch.no_grad():
                grad_logits = torch.softmax(logits.detach(), dim=-1)
                grad_logits[torch.arange(grad_logits.shape[0], device=grad_logits.device), safe_labels[rows]] -= 1
                grad_logits *= (valid[rows].to(grad_logits.dtype) * scale).unsqueeze(1)
            inputs = [t for t in (chunk, chunk_weight, chunk_bias) if t is not None and t.requires_grad]
            grads = dict(zip(map(id, inputs), torch.autograd.grad(logits, inputs, grad_logits)))
            if grad_hidden is not None:
                grad_hidden[rows] = grads[id(chunk)]
            if grad_weight is not None:
                grad_weight += grads[id(chunk_weight)]
            if grad_bias is not None:
                grad_bias += grads[id(chunk_bias)]
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None, None, None, None, None, None, None,
        )


def _chunks(tokens: int, chunk_tokens: int) -> Iterator[slice]:
    for start in range(0, tokens, chunk_tokens):
        yield slice(start, min(start + chunk_tokens, tokens))


def _logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None, upcast: bool,
) -> torch.Tensor:
    """One chunk's logits as the model and its loss make them: projection, soft-capping, float32 upcast."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits.float() if upcast else logits


def _divisor(valid: torch.Tensor, reduction: str, num_items: Any) -> torch.Tensor | float:
    if num_items is not None:
        return num_items.float() if isinstance(num_items, torch.Tensor) else float(num_items)
    if reduction == "sum":
        return 1.0
    return valid.sum().float()  # "mean": over the labels not ignored (all ignored: 0 / 0, nan, as F.cross_entropy)


def _loss_dtype(hidden: torch.Tensor, weight: torch.Tensor, upcast: bool) -> torch.dtype:
    return torch.float32 if upcast else torch.promote_types(hidden.dtype, weight.dtype)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype | None]:
    if device_type not in ("cpu", "cuda"):
        return False, None
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _autocast_as(device_type: str, state: tuple[bool, torch.dtype | None]) -> contextlib.AbstractContextManager:
    enabled, dtype = state
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)
