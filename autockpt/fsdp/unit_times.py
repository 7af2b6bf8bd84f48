"""What the traced single-device step says about each FSDP unit (``plan.py`` step 1): the default units (the
modules holding the repeated blocks, else a module list of identical blocks), each unit's forward time, the share of it
selective checkpointing recomputes (not matmuls or attention), its saved bytes and those of its parts, and which parts
are worth one fake-process-group measurement."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from autockpt.core.structure import find_repeated_blocks
from autockpt.fsdp.choose import UnitPart, UnitTimes
from autockpt.fsdp.shard import ROOT, check_units, container_blocks, unit_parameter_bytes
from autockpt.types import Graph, StepTrace


def default_units(model: nn.Module, graph: Graph, trace: StepTrace) -> tuple[str, ...]:
    """The modules that hold the repeated blocks found in the traced step (each instance's units' deepest common
    module), then the root; refused when no block is found."""
    modules = dict(model.named_modules())
    found: list[str] = []
    for family in find_repeated_blocks(graph, trace).families:
        names = []
        for instance in family.instances:
            paths = [graph.units[i].module_path.split(".") for i in range(instance.first_unit, instance.last_unit + 1)]
            common: list[str] = []
            for parts in zip(*paths):
                if len(set(parts)) != 1:
                    break
                common.append(parts[0])
            names.append(".".join(common))
        if all(n and n in modules for n in names) and len(set(names)) == len(names):
            found += names
    if not found:  # e.g. an fx capture keeps torch's nn.TransformerEncoderLayer whole: one unit per block
        found = container_blocks(model, [unit.module_path for unit in graph.units])
    if not found:
        raise ValueError(
            f"no repeated blocks were found in {type(model).__name__}'s step to shard as FSDP units: give "
            "units=[...] (module names from model.named_modules(), e.g. ['layers.0', 'layers.1', ...]); no "
            "nn.ModuleList, nn.ModuleDict or nn.Sequential of identical blocks ran in it either"
        )
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return check_units(model, sorted(set(found), key=order.__getitem__))


def unit_times(
    model: nn.Module, units: Sequence[str], graph: Graph, trace: StepTrace, mp_policy: Any,
) -> dict[str, UnitTimes]:
    """Each unit's forward time, the part of it that is not matmuls or attention (``_is_saved_op``), its saved bytes
    (the traced units under its module path; the root has the rest), the same for its parts (``_part_name``) and
    the bytes of its all-gather and reduce-scatter."""
    inner = [u for u in units if u != ROOT]
    forward = dict.fromkeys((*inner, ROOT), 0.0)
    recomputed = dict.fromkeys((*inner, ROOT), 0.0)
    saved = dict.fromkeys((*inner, ROOT), 0)
    parts: dict[str, dict[str, list]] = {u: {} for u in (*inner, ROOT)}  # unit -> part -> [forward ms, saved B]
    modules = dict(model.named_modules())
    for unit, cost in zip(graph.units, trace.units):
        path = unit.module_path or ""
        owner = next((u for u in inner if path == u or path.startswith(u + ".")), ROOT)
        forward[owner] += cost.forward_ms
        saved[owner] += cost.saved_bytes
        if not _is_saved_op(unit.op, modules.get(path)):
            recomputed[owner] += cost.forward_ms
        part = part_name(owner, path, modules) if owner != ROOT else None
        if part is not None and not isinstance(modules.get(f"{owner}.{part}"), _ONE_OP_MODULES):
            figures = parts[owner].setdefault(part, [0.0, 0])
            figures[0] += cost.forward_ms
            figures[1] += cost.saved_bytes
    param_dtype = getattr(mp_policy, "param_dtype", None)
    reduce_dtype = getattr(mp_policy, "reduce_dtype", None) or param_dtype
    owned = unit_parameter_bytes(model, units)

    def in_dtype(numel: int, nbytes: int, dtype: torch.dtype | None) -> int:
        return nbytes if dtype is None else numel * torch.empty((), dtype=dtype).element_size()

    return {
        name: UnitTimes(
            name=name, forward_ms=forward[name], saved_bytes=saved[name], selective_recompute_ms=recomputed[name],
            parts=tuple(UnitPart(name=part, forward_ms=ms, saved_bytes=nbytes)
                        for part, (ms, nbytes) in parts[name].items()),
            all_gather_bytes=in_dtype(*owned[name], param_dtype), reduce_scatter_bytes=in_dtype(*owned[name],
                                                                                               reduce_dtype),
        )
        for name in (*inner, ROOT)
    }


def part_name(unit: str, path: str, modules: Mapping[str, nn.Module]) -> str | None:
    """The part of ``unit`` that the traced op at module ``path`` runs in, relative to the unit: the unit's child
    that holds it, or the grandchild when that child is a ModuleList or ModuleDict (never called itself); None for
    an op of the unit's own forward."""
    if not path.startswith(unit + "."):
        return None
    pieces = path[len(unit) + 1:].split(".")
    name = pieces.pop(0)
    while pieces and isinstance(modules.get(f"{unit}.{name}"), (nn.ModuleList, nn.ModuleDict)):
        name += "." + pieces.pop(0)
    return name


# modules that run one op saving its input: checkpointed alone they save that input all the same and free nothing
_ONE_OP_MODULES = (nn.Linear, nn.Bilinear, nn.Embedding, nn.modules.conv._ConvNd)

# parts tried as regions (one fake-process-group measurement each): those holding between 5 % and 90 % of a unit's
# saved bytes (less frees little; more is nearly the whole unit, which full checkpointing already offers), the 3
# holding the most over all units
_PART_SAVED_SHARE = (0.05, 0.9)
_MAX_PART_CANDIDATES = 3


def part_candidates(blocks: Sequence[UnitTimes]) -> list[str]:
    """The parts (names relative to their units) worth measuring with every unit holding them checkpointed."""
    totals: dict[str, int] = {}
    low, high = _PART_SAVED_SHARE
    for unit in blocks:
        for part in unit.parts:
            if unit.saved_bytes and low <= part.saved_bytes / unit.saved_bytes <= high:
                totals[part.name] = totals.get(part.name, 0) + part.saved_bytes
    return sorted(totals, key=lambda name: -totals[name])[:_MAX_PART_CANDIDATES]


# traced units whose outputs selective checkpointing keeps (shard.SAVED_OPS at the aten level): by the name of a
# function unit, or a leaf module that is one matmul (nn.Linear) or attention
_SAVED_UNIT_OPS = frozenset({
    "linear", "matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm", "einsum", "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
})


def _is_saved_op(op: str, module: nn.Module | None) -> bool:
    """True for a traced unit that is a matmul or attention: its forward is not recomputed under selective
    checkpointing. ``op``: "module:<path>" for a leaf module (then ``module`` decides), else a function's name
    ("gelu", "aten.mm.default", "torch.matmul")."""
    if op.startswith("module:"):
        return isinstance(module, (nn.Linear, nn.MultiheadAttention))
    name = op.removeprefix("aten.").removeprefix("torch.").removeprefix("nn.functional.").removeprefix("F.")
    return name.split(".")[0] in _SAVED_UNIT_OPS
