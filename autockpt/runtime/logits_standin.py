"""The logits of an eager model's output projection as a stand-in that its cross-entropy computes in chunks (issue 48,
for a loss autockpt does not capture: the FSDP2 root unit, whose forward is the user's code run eagerly).

``chunk_projection(lm_head, chunk_tokens)`` makes the ``nn.Linear`` return, in a training forward (gradients on,
module in training mode), a ``LogitsStandIn`` instead of ``hidden @ weight.T + bias``: a tensor of the logits' shape
and dtype that holds no values, only the hidden states, the weight and bias, and what was done to the logits since.
Ops that act on each token's row alone are applied to the hidden states instead (views and slices of the leading
dims, ``flatten`` of them), ops on each logit are recorded (a float32 upcast, Gemma's soft-capping ``tanh(x / c) * c``),
and ``F.cross_entropy`` on it (2-D, mean or sum, ``ignore_index``, no class weights or smoothing) is
``runtime.chunked_loss.chunked_linear_cross_entropy``: the full logits never exist. That covers Hugging Face's loss
(``logits.float()``, ``.view(-1, vocab)``, ``cross_entropy``, the division by ``num_items_in_batch`` after it) and
torchtitan's (``cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))``). Anything else computes the logits
in full where it is asked (``materialized``) and logs once why: a model output's ``logits`` read after the step is
then computed, not lost. Metadata (shape, dtype, device) is the logits' own.

Exact as the chunked loss is: the loss and gradients of the projection's input, weight and bias equal the unchunked
step's within float tolerance; under autocast the projection runs in the autocast state the stand-in was made in.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils import _pytree as pytree
from typing_extensions import Self

from autockpt.runtime.chunked_loss import chunked_linear_cross_entropy

logger = logging.getLogger(__name__)

_VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape}
_FLATTENS = {torch.Tensor.flatten, torch.flatten}
_SAME = {torch.Tensor.contiguous}
_UPCASTS = {torch.Tensor.float, torch.Tensor.to, torch.Tensor.type}
_DIVIDES = {torch.Tensor.__truediv__, torch.Tensor.div, torch.div, torch.true_divide}
_TANHS = {torch.Tensor.tanh, torch.tanh}
_MULTIPLIES = {torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.mul, torch.mul}
_METADATA = {torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.element_size,
             torch.Tensor.is_floating_point, torch.Tensor.__len__}
_said: set[str] = set()


class LogitsStandIn(torch.Tensor):
    """The logits ``hidden @ weight.T + bias`` (then upcast and soft-capped as recorded) without their values."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    chunk_tokens: int
    vocabulary: int
    logit_dtype: torch.dtype  # the projection's output dtype (autocast's where it was on)
    upcast: bool
    softcap: float | None  # tanh(z / c) * c applied
    capping: tuple[str, float] | None  # a soft-capping under way: ("divided", c) or ("tanh", c)
    autocast: tuple[str, bool, torch.dtype]

    @staticmethod
    def __new__(cls, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk_tokens: int, *,
                logit_dtype: torch.dtype, upcast: bool = False, softcap: float | None = None,
                capping: tuple[str, float] | None = None,
                autocast: tuple[str, bool, torch.dtype] | None = None) -> Self:
        dtype = torch.float32 if upcast else logit_dtype
        made = torch.Tensor._make_wrapper_subclass(
            cls, (*hidden.shape[:-1], weight.shape[0]), dtype=dtype, device=hidden.device, requires_grad=False,
        )
        made.hidden, made.weight, made.bias, made.chunk_tokens = hidden, weight, bias, chunk_tokens
        made.vocabulary, made.logit_dtype, made.upcast = int(weight.shape[0]), logit_dtype, upcast
        made.softcap, made.capping = softcap, capping
        made.autocast = autocast or _autocast_state(hidden.device.type)
        return made

    @classmethod
    def of(cls, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           chunk_tokens: int) -> LogitsStandIn:
        """The stand-in of ``F.linear(hidden, weight, bias)`` as it would run here (its dtype under autocast)."""
        autocast = _autocast_state(hidden.device.type)
        dtype = autocast[2] if autocast[1] else torch.result_type(hidden, weight)
        return cls(hidden, weight, bias, chunk_tokens, logit_dtype=dtype, autocast=autocast)

    def _with(self, **changes: Any) -> LogitsStandIn:
        fields = {"hidden": self.hidden, "upcast": self.upcast, "softcap": self.softcap, "capping": self.capping}
        fields.update(changes)
        return LogitsStandIn(fields.pop("hidden"), self.weight, self.bias, self.chunk_tokens,
                             logit_dtype=self.logit_dtype, autocast=self.autocast, **fields)

    def materialized(self) -> torch.Tensor:
        """The logits in full, as the model would have made them (and upcast and soft-capped as recorded)."""
        with self._autocast():
            logits = F.linear(self.hidden, self.weight, self.bias)
        if self.capping is not None:
            kind, cap = self.capping
            logits = logits / cap if kind == "divided" else torch.tanh(logits / cap)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float() if self.upcast else logits

    def _autocast(self) -> contextlib.AbstractContextManager:
        device_type, enabled, dtype = self.autocast
        return torch.autocast(device_type, dtype=dtype, enabled=enabled)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA or getattr(func, "__name__", "") == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        first = args[0] if args else kwargs.get("input")
        if isinstance(first, LogitsStandIn):
            handled = _lazily(first, func, args[1:] if args else (), {k: v for k, v in kwargs.items() if k != "input"})
            if handled is not NotImplemented:
                return handled
        reason = f"{getattr(func, '__qualname__', func)} read them"
        if reason not in _said:
            _said.add(reason)
            logger.info("autockpt: the logits of a projection computed in chunks were made in full: %s", reason)
        args, kwargs = pytree.tree_map_only(LogitsStandIn, LogitsStandIn.materialized, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise RuntimeError(
            f"{func} reached a LogitsStandIn below autograd (a torch function that does not dispatch through "
            "__torch_function__): turn the chunked loss off (loss_chunk_tokens=0) for this model"
        )


def _lazily(logits: LogitsStandIn, func: Any, rest: tuple, kwargs: dict) -> Any:
    """``func(logits, *rest, **kwargs)`` kept lazy where it can be (NotImplemented where it cannot)."""
    hidden, width = logits.hidden, logits.hidden.shape[-1]
    if func is F.cross_entropy:
        return _cross_entropy(logits, *rest, **kwargs)
    if func in _SAME and not rest:
        return logits
    if func in _VIEWS:
        shape = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else rest
        shape = kwargs.get("shape", shape)
        if shape and shape[-1] == logits.vocabulary and all(isinstance(s, int) for s in shape):
            return logits._with(hidden=hidden.reshape(*shape[:-1], width))
        return NotImplemented
    if func in _FLATTENS:
        start = rest[0] if rest else kwargs.get("start_dim", 0)
        end = rest[1] if len(rest) > 1 else kwargs.get("end_dim", -1)
        end = end % logits.dim()
        if end < logits.dim() - 1:  # the leading dims only: the same on the hidden states
            return logits._with(hidden=hidden.flatten(start, end))
        return NotImplemented
    if func is torch.Tensor.__getitem__ and len(rest) == 1 and _leaves_last_dim(rest[0], logits.dim()):
        return logits._with(hidden=hidden[rest[0]])
    if func in _UPCASTS and _is_float32(rest, kwargs, func):
        if logits.upcast or logits.capping is not None:
            return logits if logits.upcast else NotImplemented
        return logits._with(upcast=True)
    scalar = rest[0] if len(rest) == 1 and isinstance(rest[0], (int, float)) and not kwargs else None
    if logits.upcast or logits.softcap is not None or scalar is None and func not in _TANHS:
        return NotImplemented
    if func in _DIVIDES and scalar is not None and logits.capping is None and math.isfinite(scalar) and scalar:
        return logits._with(capping=("divided", float(scalar)))
    if func in _TANHS and not rest and logits.capping is not None and logits.capping[0] == "divided":
        return logits._with(capping=("tanh", logits.capping[1]))
    if func in _MULTIPLIES and logits.capping == ("tanh", scalar):
        return logits._with(capping=None, softcap=float(scalar))
    return NotImplemented


def _cross_entropy(logits: LogitsStandIn, target: Any = None, weight: Any = None, size_average: Any = None,
                   ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                   label_smoothing: float = 0.0, **kwargs: Any) -> Any:
    target = kwargs.pop("target", target)
    if (kwargs or weight is not None or size_average is not None or reduce is not None or label_smoothing
            or reduction not in ("mean", "sum") or logits.dim() != 2 or logits.capping is not None
            or not isinstance(target, torch.Tensor) or target.dim() != 1 or target.dtype.is_floating_point):
        return NotImplemented
    with logits._autocast():
        return chunked_linear_cross_entropy(
            logits.hidden, logits.weight, target, bias=logits.bias, chunk_tokens=logits.chunk_tokens,
            ignore_index=int(ignore_index), reduction=reduction, softcap=logits.softcap, upcast=logits.upcast,
        )


def _leaves_last_dim(index: Any, ndim: int) -> bool:
    """Whether ``logits[index]`` indexes the leading dims only (slices, integers, an ellipsis; the last dim whole)."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, (int, slice)) or i is Ellipsis for i in items):
        return False
    if Ellipsis in items:
        after = items[items.index(Ellipsis) + 1:]
        return not after or after[-1] == slice(None)
    return len(items) < ndim or items[-1] == slice(None)


def _is_float32(rest: tuple, kwargs: dict, func: Any) -> bool:
    if func is torch.Tensor.float:
        return not rest and not kwargs
    wanted = kwargs.get("dtype", rest[0] if rest else None)
    return wanted is torch.float32 and len(rest) <= 1 and set(kwargs) <= {"dtype"}


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def chunk_projection(projection: nn.Module, chunk_tokens: int) -> Callable[[], None]:
    """Make ``projection`` (an ``nn.Linear``) return a ``LogitsStandIn`` in training forwards (gradients on, training
    mode); elsewhere it runs as written. Returns the function that undoes it. Its name, parameters and state are
    unchanged (its ``forward`` is patched on the instance)."""
    if not isinstance(projection, nn.Linear):
        raise TypeError(f"the projection whose loss is chunked must be an nn.Linear, got {type(projection).__name__}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    had_own = "forward" in projection.__dict__
    original = projection.forward

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and projection.training:
            return LogitsStandIn.of(hidden, projection.weight, projection.bias, chunk_tokens)
        return original(hidden)

    projection.forward = forward

    def undo() -> None:
        if had_own:
            projection.forward = original
        else:
            del projection.forward

    return undo
