"""Keeping the user's model as it was: planning runs the model, and must leave no trace on it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree


def cuda_devices_of(*trees: Any) -> list[int]:
    """CUDA device indices of every tensor in the given pytrees (for RNG forking)."""
    devices = set()
    for leaf in pytree.tree_leaves(trees):
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            devices.add(leaf.device.index if leaf.device.index is not None else torch.cuda.current_device())
    return sorted(devices)


class BufferState:
    """Every buffer of a model, the tensor object and a copy of its value, to put back later: a forward may update a
    buffer in place (BatchNorm statistics, a step counter) or assign a new tensor to it (``self.count = self.count +
    1``), and running the model while planning must leave neither trace."""

    def __init__(self, model: nn.Module) -> None:
        self._entries = [
            (module, name, buffer, buffer.detach().clone())
            for module in model.modules()
            for name, buffer in module._buffers.items()
            if buffer is not None
        ]

    def restore(self) -> None:
        with torch.no_grad():
            for module, name, buffer, saved in self._entries:
                module._buffers[name] = buffer
                buffer.copy_(saved)


def share_registries(module: nn.Module, owner: nn.Module) -> None:
    """``module`` holds ``owner``'s own submodule, parameter and buffer registries (not copies): its parameters,
    buffers and ``state_dict`` are ``owner``'s under the same names, and an assignment through either (``self.count =
    self.count + 1``) is seen through both. Called in ``module.__init__`` after ``nn.Module.__init__``."""
    for registry in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
        module.__dict__[registry] = getattr(owner, registry)


def buffer_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every buffer's value, by name."""
    return {name: buffer.detach().clone() for name, buffer in model.named_buffers()}


@contextlib.contextmanager
def preserved_model_state(model: nn.Module, *inputs: Any) -> Iterator[None]:
    """Restore buffers (BatchNorm statistics, the tensor objects too), parameter gradients, the gradients of input
    tensors that require grad (an ``inputs_embeds`` the user reuses), train/eval flags and RNG state on exit."""
    buffers = BufferState(model)
    leaves = [leaf for leaf in pytree.tree_leaves(inputs) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    grads = [(tensor, tensor.grad) for tensor in [*model.parameters(), *leaves] if tensor.is_leaf]
    for tensor, _ in grads:  # backward would add into the user's gradient tensors in place: they wait aside
        tensor.grad = None
    modes = [(m, m.training) for m in model.modules()]
    devices = cuda_devices_of(inputs, list(model.parameters()))
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            buffers.restore()
            for tensor, grad in grads:
                tensor.grad = grad
            for module, training in modes:
                module.training = training


def training_modes(model: nn.Module) -> tuple[bool, ...]:
    """The train/eval flag of every submodule, in ``model.modules()`` order."""
    return tuple(module.training for module in model.modules())


def enter_training_modes(model: nn.Module) -> None:
    """Put ``model`` in the modes its training step runs in. A model in train mode keeps every submodule's flag as
    the user set it (a frozen BatchNorm or a dropout switched off stays so); a model in eval mode is put in train
    mode throughout, as ``model.train()`` does. Callers restore the flags (``preserved_model_state``)."""
    if not model.training:
        model.train()


@functools.cache
def _autocast_device_types() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    """Per device type: whether autocast is on and to which dtype."""
    return tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in _autocast_device_types())


def start_autocast_step() -> None:
    """Empty autocast's cache of low-precision copies of leaves (parameters), as at the first step of an autocast
    context, when autocast and its cache are on.

    Why: a copy made by an earlier step of the same context is reused, and its gradient function
    (``ToCopyBackward0``) is then older than everything the step records. Autograd runs ready nodes newest first, so
    every such node waited for the end of backward (measured on CPU), holding each weight's low-precision gradient
    until then and making the float32 gradients all at the end: the peak depended on whether the training loop
    enters autocast once or once per step. The trace measures a first step, and the optimized module starts each
    training step as one, so both run the same whatever the loop does. Clearing costs the casts again, as a context
    per step does; copies an autograd graph still holds stay alive.
    """
    if torch.is_autocast_cache_enabled() and any(enabled for _, enabled, _ in autocast_state()):
        torch.clear_autocast_cache()


@contextlib.contextmanager
def weights_put_back(params: list[torch.Tensor]) -> Iterator[None]:
    """Copy the values of ``params`` to host memory and write them back on exit: an optimizer step run to measure it
    moves the weights."""
    values = [p.detach().to("cpu", copy=True) for p in params]
    try:
        yield
    finally:
        with torch.no_grad():
            for param, value in zip(params, values):
                param.copy_(value)
