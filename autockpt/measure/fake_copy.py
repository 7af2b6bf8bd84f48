"""Fake copies of a model and its inputs: every tensor (parameters, buffers, tensor attributes, inputs) replaced by
a fake of itself under a ``FakeTensorMode``, the model itself untouched. The fake trace (``fake.py``) runs the step on
such copies; capture (``capture.py``) runs a model on the meta device this way. It imports nothing of autockpt, so
both can use it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree


def without_values(model: nn.Module, args: Any, kwargs: Any) -> bool:
    """Whether the model or any example input is on the meta device (or a fake tensor): no real step can run."""
    return model_on_meta(model) or any(
        has_no_values(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
    )


def model_on_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


def has_no_values(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "meta" or isinstance(tensor, FakeTensor)


def fake_copy(model: nn.Module, args: tuple, kwargs: dict, mode: FakeTensorMode) -> tuple[nn.Module, tuple, dict]:
    """A copy of ``model`` whose tensors (parameters, buffers, tensor attributes) are fakes of themselves, and fakes
    of the inputs, all on the meta device (a meta model's real inputs, token ids on the CPU, join it there); the model
    is not touched.

    Capture runs a model on the meta device eagerly this way: code that reads a tensor's value (``.item()``) fails on
    meta tensors, where libraries skip such checks on fake tensors (transformers' ``is_tracing``)."""
    meta = torch.device("meta")
    (copied,), inputs = fake_copies((model,), (args, kwargs), lambda t: fake_of(t, mode, meta), {}, [])
    return copied, *inputs



def fake_copies(
    roots: tuple[nn.Module, ...], inputs: Any, make: Any, fakes: dict[int, torch.Tensor], originals: list[torch.Tensor]
) -> tuple[tuple[nn.Module, ...], Any]:
    """Deep copies of ``roots`` (together: shared modules and tensors stay shared) and of the tensors in ``inputs``,
    every tensor replaced by ``make(tensor)``; ``fakes`` maps the id of each replaced tensor to its fake, and
    ``originals`` keeps those tensors alive while their ids are looked up. Copied parameters have no gradient."""

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in fakes:
            originals.append(tensor)
            fakes[id(tensor)] = make(tensor)
        return fakes[id(tensor)]

    modules = {id(m): m for root in roots for m in root.modules()}
    for module in modules.values():
        for tensor in module_tensors(module):
            fake(tensor)
    memo: dict[int, Any] = dict(fakes)  # deepcopy takes each fake for its tensor, copies everything else
    copies = copy.deepcopy(roots, memo)
    for param in copies[0].parameters():
        param.grad = None
    return copies, pytree.tree_map(lambda leaf: fake(leaf) if isinstance(leaf, torch.Tensor) else leaf, inputs)



def fake_of(tensor: torch.Tensor, mode: FakeTensorMode, device: torch.device) -> torch.Tensor:
    """A fake of ``tensor`` on ``device``. On its own device: ``from_tensor`` (views of one storage stay views of one
    fake storage). Elsewhere (meta): a fake over its meta metadata (views of one meta storage share it too), a
    parameter still a parameter, ``requires_grad`` as it was."""
    if isinstance(tensor, FakeTensor):
        if tensor.fake_mode is mode:
            return tensor
        tensor = meta_of_fake(tensor)  # the user's fake (another mode): its metadata, as a meta tensor
    if tensor.device.type == device.type and device.index in (None, tensor.device.index):
        return mode.from_tensor(tensor, static_shapes=True)
    meta = tensor.detach() if tensor.device.type == "meta" else tensor.detach().to("meta")
    made = mode.fake_tensor_converter.from_meta_and_device(mode, meta, device)
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(made, requires_grad=tensor.requires_grad)
    return made.requires_grad_(tensor.requires_grad) if tensor.requires_grad else made



def meta_of_fake(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor with a (fake) tensor's shape, strides, dtype and requires_grad, read without leaving fake mode
    (its storage's size, not its aliasing: fakes of one storage given as inputs become separate storages)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        meta = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device="meta")
    return meta.requires_grad_(tensor.requires_grad)


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The tensors a module holds itself: parameters, buffers and tensor attributes (fx's constants, a rotary
    embedding's unregistered frequencies), also inside lists, tuples and dicts."""
    tensors = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
    for name, value in vars(module).items():
        if name in ("_parameters", "_buffers", "_modules"):
            continue
        tensors += [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
    return tensors
