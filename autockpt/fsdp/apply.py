"""``apply_fsdp``: run an ``FSDPPlan`` on every rank: checkpoint the plan's units, whole or selectively, and its
checkpointed parts (modules inside units), run the
offloaded ones in a host pool (their ``forward`` patched, names unchanged: ``offload.py``) and call torch's own
``fully_shard`` on the units, then the root. Works on a
model on the meta device (meta -> ``apply_fsdp`` -> ``to_empty`` -> the user's initialisation, torchtitan's order)."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from autockpt.errors import PlanMismatchError
from autockpt.fsdp.shard import ROOT, check_unsharded_module, parameter_digest, shard
from autockpt.records.fingerprint import check_parameters
from autockpt.records.fsdp_plan import FSDPPlan
from autockpt.types import describe_value

logger = logging.getLogger(__name__)


def apply_fsdp(model: nn.Module, fplan: FSDPPlan, mesh: Any = None) -> nn.Module:
    """Shard ``model`` as ``fplan`` says, in place, and return it (the same object, now an ``FSDPModule``).

    ``mesh``: a 1-D ``DeviceMesh`` of the plan's world size (default: ``init_device_mesh(device_type,
    (world_size,))`` over the initialised default process group, the device type that of the model's parameters,
    "cuda" for a model on the meta device when CUDA is available). HSDP and 2-D meshes are later work."""
    import torch
    import torch.distributed as dist

    if not isinstance(fplan, FSDPPlan):
        raise TypeError(
            f"fplan must be an autockpt FSDPPlan (autockpt.plan_fsdp or autockpt.load_fsdp_plan), got "
            f"{describe_value(fplan)}"
        )
    check_unsharded_module(model, "apply the plan to the model as built, before any fully_shard")
    modules = dict(model.named_modules())
    unknown = [u for u in (*fplan.units, *fplan.checkpointed, *fplan.selective, *fplan.offloaded,
                            *fplan.checkpointed_parts, fplan.loss_projection) if u != ROOT and u not in modules]
    if unknown:
        raise PlanMismatchError(
            f"the plan's unit(s) or part(s) {unknown} are not modules of {type(model).__name__}: apply the plan to "
            "the model it was made for, or plan this model (autockpt.plan_fsdp)"
        )
    remedy = "plan this model (autockpt.plan_fsdp) or apply the plan to the one it was made for"
    if fplan.fingerprint is not None:
        check_parameters(fplan.fingerprint, model, remedy)
    elif fplan.parameter_digest is not None and parameter_digest(model, fplan.units) != fplan.parameter_digest:
        raise PlanMismatchError(  # a plan of 0.2: its digest says only that something differs
            f"the plan was made for another model: {type(model).__name__}'s parameter names, shapes or dtypes differ "
            f"from the planned model's; {remedy}"
        )
    if mesh is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "apply_fsdp needs the default process group (dist.init_process_group, e.g. under torchrun) or "
                "mesh=init_device_mesh(device_type, (world_size,))"
            )
        if dist.get_world_size() != fplan.world_size:
            raise ValueError(
                f"the plan is for world size {fplan.world_size}, this process group has {dist.get_world_size()} "
                f"ranks: run with {fplan.world_size} ranks or plan for {dist.get_world_size()}"
            )
        from torch.distributed.device_mesh import init_device_mesh

        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        device_type = ("cuda" if torch.cuda.is_available() else "cpu") if device.type == "meta" else device.type
        mesh = init_device_mesh(device_type, (fplan.world_size,))
    if mesh.ndim != 1:
        raise ValueError(
            f"apply_fsdp takes a 1-D mesh (plain FSDP), got a mesh of {mesh.ndim} dimensions {tuple(mesh.shape)}: "
            "HSDP and 2-D meshes are later work"
        )
    if mesh.size() != fplan.world_size:
        raise ValueError(
            f"the plan is for world size {fplan.world_size}, the mesh has {mesh.size()} ranks: run with "
            f"{fplan.world_size} ranks or plan for {mesh.size()}"
        )
    mp_policy = _mp_policy(fplan.mixed_precision)
    shard(model, fplan.units, fplan.checkpointed, mesh, reshard_after_forward=fplan.reshard_after_forward,
          mp_policy=mp_policy, selective=fplan.selective, offloaded=fplan.offloaded,
          host_pool_bytes=fplan.host_pool_bytes, checkpointed_parts=fplan.checkpointed_parts,
          loss_chunk=(fplan.loss_projection, fplan.loss_chunk_tokens) if fplan.loss_chunk_tokens else None)
    logger.info("applied FSDP plan: %d units sharded, %d checkpointed whole, %d selectively, %d offloaded, %d parts "
                "checkpointed", len(fplan.units), len(fplan.checkpointed), len(fplan.selective), len(fplan.offloaded),
                len(fplan.checkpointed_parts))
    return model


def _mp_policy(described: str) -> Any:
    """The ``MixedPrecisionPolicy`` a plan's ``mixed_precision`` text describes (``shard.describe_mp_policy``)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if described == "none":
        return None
    fields = dict(part.strip().split(" ", 1) for part in described.split(",") if part.strip()
                  and not part.strip().startswith("cast"))

    def dtype(name: str) -> Any:
        return None if name == "-" else getattr(torch, name)

    return MixedPrecisionPolicy(
        param_dtype=dtype(fields["param"]), reduce_dtype=dtype(fields["reduce"]), output_dtype=dtype(fields["output"]),
        cast_forward_inputs="cast forward inputs" in described,
    )
