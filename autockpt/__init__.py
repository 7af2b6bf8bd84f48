"""autockpt: fit PyTorch training into a memory budget by choosing what to recompute, offload, and where it runs.

    model = autockpt.optimize(model, budget_gb=20, example_inputs=(batch,))

Budgets are in GB = 10^9 bytes (``budget_gb``) or bytes (``budget_bytes``). The names below are the public facade;
everything else lives in the subpackages (``autockpt.core``, ``measure``, ``runtime``, ``planning``, ``records``,
``pipeline``, ``present``). Names that left the facade in 0.2 were removed in 0.3; asking ``autockpt`` for one
says where it lives (CHANGELOG.md lists them).
"""

from __future__ import annotations

from typing import Any

from autockpt.core.devices import DeviceSpec
from autockpt.core.solve.base import SolverOptions
from autockpt.errors import AutockptError, InfeasibleBudgetError, PlanMismatchError
from autockpt.fsdp import apply_fsdp, load_fsdp_plan, plan_fsdp
from autockpt.measure.step import measure_step
from autockpt.pipeline.plan import compare_pipeline_splits, plan_pipeline
from autockpt.pipeline.run import pipeline_schedule
from autockpt.planning.api import apply_plan, get_plan, optimize, plan
from autockpt.planning.batch_size import max_batch_size
from autockpt.planning.estimate import estimate
from autockpt.planning.options import PlanOptions
from autockpt.planning.planner import Planner
from autockpt.records.pipeline_plan import PipelinePlan, load_pipeline_plan
from autockpt.records.plan import Plan, load_plan
from autockpt.types import Action

__version__ = "0.3.0.dev0"

__all__ = [
    "Action",
    "AutockptError",
    "DeviceSpec",
    "InfeasibleBudgetError",
    "PipelinePlan",
    "Plan",
    "PlanMismatchError",
    "PlanOptions",
    "Planner",
    "SolverOptions",
    "apply_fsdp",
    "apply_plan",
    "compare_pipeline_splits",
    "estimate",
    "get_plan",
    "load_fsdp_plan",
    "load_pipeline_plan",
    "load_plan",
    "max_batch_size",
    "measure_step",
    "optimize",
    "pipeline_schedule",
    "plan",
    "plan_fsdp",
    "plan_pipeline",
]

# The names that were in the facade in 0.1 and left it in 0.2 (with a warning) were removed in 0.3: asking for one
# says where it lives now, rather than a bare AttributeError.
REMOVED_NAMES = {
    **dict.fromkeys(("BASELINE_STRATEGIES", "baseline_regions"), "autockpt.core.solve.baselines"),
    **dict.fromkeys(("BatchSizeResult", "ExampleBatch", "max_batch_sizes"), "autockpt.planning.batch_size"),
    "MemoryEstimate": "autockpt.planning.estimate",
    "baseline_plan": "autockpt.planning.planner",
    "default_loss": "autockpt.measure.loss",
    "OptimizedModule": "autockpt.runtime.rewrite",
    **dict.fromkeys(
        ("CaptureError", "LossFunctionError", "PlanFileError", "ProfileError", "UnplannedStepError"), "autockpt.errors"
    ),
    **dict.fromkeys(
        ("CaptureKind", "Decision", "MemoryCurve", "PipelineSchedule", "Placement", "PlanStatus", "Policy", "Region",
         "RegionAction", "SolverStats", "Stage"),
        "autockpt.types",
    ),
    "ParetoPoint": "autockpt.record_types",
    "CheckpointKind": "autockpt (renamed Action)",
}


def __getattr__(name: str) -> Any:
    if name in REMOVED_NAMES:
        raise AttributeError(
            f"autockpt.{name} was removed from the facade in 0.3: import it from {REMOVED_NAMES[name]} "
            "(CHANGELOG.md, 0.3.0)"
        )
    raise AttributeError(f"module 'autockpt' has no attribute {name!r}")
