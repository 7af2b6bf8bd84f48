"""What ``apply_fsdp`` and the fake-world measurement both do to a model: checkpoint FSDP units, whole or selectively,
and call torch's own ``fully_shard`` on the units, then on the root (torchtitan's order).

Selective checkpointing is torch's own (``create_selective_checkpoint_contexts``): in forward the outputs of matmuls
and attention are saved (``CheckpointPolicy.MUST_SAVE``, torchtitan's op list: ``SAVED_OPS``), everything else is
recomputed in backward (``PREFER_RECOMPUTE``). torchtitan also saves every other matmul only and a few collectives
and reductions; this list saves every matmul.

Checkpointing patches the unit's ``forward`` on the instance (``torch.utils.checkpoint``, non-reentrant): parameter
names do not change (``checkpoint_wrapper`` would add ``_checkpoint_wrapped_module.`` to them), and FSDP2's hooks, which
``fully_shard`` registers on the module's ``__call__`` (all-gather before forward and, from the output's backward
hook, before backward), run around the checkpointed forward exactly as around the plain one: the recomputation in
backward runs after the unit's pre-backward all-gather.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autockpt.fsdp.offload import offload_units, start_steps
from autockpt.runtime.logits_standin import chunk_projection

logger = logging.getLogger(__name__)

ROOT = ""  # the root module's name among the units ("" as in named_modules())
_PATCHED = "_autockpt_checkpointed_forward"  # on a patched module: "full" or "selective"

# the aten ops whose outputs selective checkpointing saves: matmuls and attention (on CPU, scaled_dot_product_attention
# dispatches to _scaled_dot_product_flash_attention_for_cpu; on CUDA to the flash, efficient or cuDNN kernels)
_SAVED_OP_NAMES = (
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
)
SAVED_OPS: frozenset[Any] = frozenset(
    getattr(torch.ops.aten, name) for name in _SAVED_OP_NAMES if hasattr(torch.ops.aten, name)
)


def _selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    packet = getattr(func, "overloadpacket", func)
    return CheckpointPolicy.MUST_SAVE if packet in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_selective_policy)


def checkpoint_forward(module: nn.Module, *, selective: bool = False) -> None:
    """Make ``module``'s forward run under non-reentrant ``torch.utils.checkpoint`` (patched on the instance; the
    parameters keep their names): the whole forward recomputed, or with ``selective`` all but the outputs of
    ``SAVED_OPS``. Patching twice is a no-op; patching a module with the other kind is refused."""
    mode = "selective" if selective else "full"
    done = getattr(module, _PATCHED, None)
    if done == mode:
        return
    if done is not None:
        raise ValueError(f"{type(module).__name__} is already checkpointed ({done}); it cannot also be {mode}")
    plain = module.forward
    extra = {"context_fn": _selective_contexts} if selective else {}

    @functools.wraps(plain)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(plain, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward
    setattr(module, _PATCHED, mode)


def checkpoint_kind(module: nn.Module) -> str | None:
    """"full", "selective", or None for a module whose forward is not patched."""
    return getattr(module, _PATCHED, None)


def is_sharded(model: nn.Module) -> bool:
    """True when ``fully_shard`` was already called on ``model`` or one of its submodules."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def check_unsharded_module(model: Any, advice: str) -> None:
    """Refuse what is not an ``nn.Module``, or one ``fully_shard`` was already called on (``advice``: what to do)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if is_sharded(model):
        raise ValueError(
            f"{type(model).__name__} is already sharded (fully_shard was called on it or a submodule): {advice}"
        )


def check_units(model: nn.Module, units: Sequence[str]) -> tuple[str, ...]:
    """``units`` as module names of ``model``, the root last (added when missing); a name that is not a module, or a
    unit inside another unit, is refused with the names that exist."""
    if isinstance(units, str) or not all(isinstance(u, str) for u in units):
        raise TypeError(f"units must be a list of module names (e.g. ['layers.0', 'layers.1']), got {units!r}")
    names = dict(model.named_modules())
    missing = [u for u in units if u not in names]
    if missing:
        shown = ", ".join(repr(n) for n in list(names)[1:13])
        raise ValueError(
            f"unit(s) {missing} are not modules of {type(model).__name__}: give names from model.named_modules() "
            f"(it has {shown}, ...)"
        )
    inner = [u for u in units if u != ROOT]
    if len(set(inner)) != len(inner):
        raise ValueError(f"units name a module twice: {inner}")
    for a in inner:
        for b in inner:
            if a != b and a.startswith(b + "."):
                raise ValueError(
                    f"unit {a!r} lies inside unit {b!r}: FSDP units here do not nest (except in the root); drop one"
                )
    return (*inner, ROOT)


def container_blocks(model: nn.Module, ran: Sequence[str]) -> list[str]:
    """The entries of every ``nn.ModuleList``, ``nn.ModuleDict`` or ``nn.Sequential`` that holds at least two identical
    blocks (same class, same parameter names, shapes and dtypes, with parameters) and runs in the step (a module path
    in ``ran`` lies inside it): torchtitan's ``model.layers`` convention, read from the module tree. Only the outermost
    such container counts (a layer list, not each layer's expert list). Used where the traced step shows no repeated
    blocks: a capture that keeps torch's own layers (``nn.TransformerEncoderLayer``) as single units."""

    def shape_of(block: nn.Module) -> tuple:
        return (type(block), tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()))

    def runs(name: str) -> bool:
        return any(path == name or path.startswith(name + ".") for path in ran)

    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        if any(name == f or name.startswith(f + ".") for f in found):  # inside a block already taken
            continue
        entries = [(f"{name}.{key}" if name else key, block) for key, block in module.named_children()]
        shapes = {shape_of(block) for _, block in entries}
        if len(entries) >= 2 and len(shapes) == 1 and next(iter(shapes))[1]:
            found += [entry for entry, _ in entries if runs(entry)]
    return found


def unit_parameter_bytes(model: nn.Module, units: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Per unit (the root last): (number of parameter elements, bytes) it owns, a parameter counted in the innermost
    unit that holds it (as ``fully_shard`` groups them); shared parameters once."""
    inner = [u for u in units if u != ROOT]
    owned: dict[str, list[int]] = {u: [0, 0] for u in (*inner, ROOT)}
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        owner = next((u for u in inner if name.startswith(u + ".")), ROOT)
        owned[owner][0] += param.numel()
        owned[owner][1] += param.numel() * param.element_size()
    return {u: (n, b) for u, (n, b) in owned.items()}


def shard(
    model: nn.Module, units: Sequence[str], checkpointed: Sequence[str], mesh: Any, *,
    reshard_after_forward: bool, mp_policy: Any, selective: Sequence[str] = (), offloaded: Sequence[str] = (),
    host_pool_bytes: int = 0, fake_tensors: bool = False, checkpointed_parts: Sequence[str] = (),
    loss_chunk: tuple[str, int] | None = None,
) -> nn.Module:
    """Checkpoint the ``checkpointed`` units' forward whole and the ``selective`` units' selectively, and each of
    ``checkpointed_parts`` (modules inside kept units) alone: in backward a part's recomputation runs inside its
    unit's backward, after the unit's all-gather, like a whole unit's. Run the
    ``offloaded`` units' forward in a host pool of ``host_pool_bytes`` (``offload.py``; ``fake_tensors``: the
    planner's fake world), then ``fully_shard`` every unit and the root on ``mesh``. ``loss_chunk``: (the root's
    projection, chunk tokens) whose cross-entropy runs in chunks (``runtime/logits_standin.py``); the root then keeps
    its parameters gathered after forward, since a loss computed outside the model reads the projection's weight
    after the root's forward (resharded, its storage is freed; backward gathers it again at once anyway)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    modules = dict(model.named_modules())
    for name in checkpointed:
        checkpoint_forward(modules[name])
    for name in selective:
        checkpoint_forward(modules[name], selective=True)
    for name in checkpointed_parts:
        checkpoint_forward(modules[name])
    holder = offload_units(model, list(units), list(offloaded), host_pool_bytes, fake_tensors=fake_tensors) \
        if offloaded else None
    extra = {"mp_policy": mp_policy} if mp_policy is not None else {"mp_policy": MixedPrecisionPolicy()}
    for name in units:
        if name != ROOT:
            fully_shard(modules[name], mesh=mesh, reshard_after_forward=reshard_after_forward, **extra)
    if loss_chunk is not None:
        chunk_projection(modules[loss_chunk[0]], loss_chunk[1])
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward and loss_chunk is None, **extra)
    if holder is not None:
        start_steps(model, holder)
    logger.debug("sharded %d units (%d checkpointed, %d selective, %d offloaded, %d parts) over a mesh of %s",
                 len(units), len(checkpointed), len(selective), len(offloaded), len(checkpointed_parts), mesh)
    return model


def parameter_digest(model: nn.Module, units: Sequence[str]) -> str:
    """sha256 of the parameter names, shapes and dtypes and the unit names: what FSDP plans of 0.2 recorded to
    decide whether they fit a model (``FSDPPlan.parameter_digest``; plans of 0.3 carry a ``ModelFingerprint``)."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{str(param.dtype).removeprefix('torch.')};".encode())
    digest.update(("units:" + ",".join(units)).encode())
    return digest.hexdigest()[:32]


def describe_mp_policy(mp_policy: Any) -> str:
    """``param bfloat16, reduce float32, output -, cast forward inputs`` or ``none`` (parameters' own dtype)."""
    if mp_policy is None:
        return "none"

    def name(dtype: torch.dtype | None) -> str:
        return "-" if dtype is None else str(dtype).removeprefix("torch.")

    cast = ", cast forward inputs" if getattr(mp_policy, "cast_forward_inputs", False) else ""
    return (f"param {name(mp_policy.param_dtype)}, reduce {name(mp_policy.reduce_dtype)}, "
            f"output {name(mp_policy.output_dtype)}{cast}")
