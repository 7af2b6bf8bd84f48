"""FSDP2: per-rank checkpointing plans for a model sharded by torch's ``fully_shard`` over N ranks, planned in one
process on torch's fake process group (``plan.py``; ``FSDPPlanner`` for several budgets from one trace), run on every rank by ``apply_fsdp`` (``apply.py``);
``unit_pool(model)`` is the host pool of a model whose plan offloads units."""

from __future__ import annotations

from autockpt.fsdp.apply import apply_fsdp
from autockpt.fsdp.offload import unit_pool
from autockpt.fsdp.plan import FSDPPlanner, plan_fsdp
from autockpt.records.fsdp_plan import FSDPPlan, UnitDecision, load_fsdp_plan

__all__ = ["FSDPPlan", "FSDPPlanner", "UnitDecision", "apply_fsdp", "load_fsdp_plan", "plan_fsdp", "unit_pool"]
