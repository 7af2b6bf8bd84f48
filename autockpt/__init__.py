"""autockpt: fit PyTorch training into a memory budget by choosing what to recompute.

    model = autockpt.optimize(model, budget_gb=20, example_inputs=(batch,))

Budgets are in GB = 10^9 bytes (``budget_gb``) or bytes (``budget_bytes``).
"""

from __future__ import annotations

from autockpt.planning.api import Planner, apply_plan, baseline_plan, get_plan, optimize, plan
from autockpt.planning.batch_size import BatchSizeResult, ExampleBatch, max_batch_size, max_batch_sizes
from autockpt.errors import (
    AutockptError,
    CaptureError,
    InfeasibleBudgetError,
    LossFunctionError,
    PlanFileError,
    PlanMismatchError,
    ProfileError,
    UnplannedStepError,
)
from autockpt.planning.estimate import MemoryEstimate, estimate
from autockpt.measure.loss import default_loss
from autockpt.measure.step import measure_step
from autockpt.pipeline.plan import PipelinePlan, compare_pipeline_splits, load_pipeline_plan, plan_pipeline
from autockpt.pipeline.run import pipeline_schedule
from autockpt.records.plan import Plan, load_plan
from autockpt.runtime.rewrite import OptimizedModule
from autockpt.core.solve.base import SolverOptions
from autockpt.core.solve.baselines import BASELINE_STRATEGIES, baseline_regions
from autockpt.record_types import ParetoPoint
from autockpt.types import (
    Action,
    CaptureKind,
    CheckpointKind,
    Decision,
    MemoryCurve,
    PipelineSchedule,
    Placement,
    PlanStatus,
    Policy,
    Region,
    RegionAction,
    SolverStats,
    Stage,
)

__all__ = [
    "BASELINE_STRATEGIES",
    "Action",
    "AutockptError",
    "BatchSizeResult",
    "CaptureError",
    "CaptureKind",
    "CheckpointKind",
    "Decision",
    "ExampleBatch",
    "InfeasibleBudgetError",
    "LossFunctionError",
    "MemoryCurve",
    "MemoryEstimate",
    "OptimizedModule",
    "ParetoPoint",
    "PipelinePlan",
    "PipelineSchedule",
    "Placement",
    "Plan",
    "PlanFileError",
    "PlanMismatchError",
    "PlanStatus",
    "Planner",
    "Policy",
    "ProfileError",
    "Region",
    "RegionAction",
    "SolverOptions",
    "SolverStats",
    "Stage",
    "UnplannedStepError",
    "apply_plan",
    "baseline_plan",
    "baseline_regions",
    "compare_pipeline_splits",
    "default_loss",
    "estimate",
    "get_plan",
    "load_pipeline_plan",
    "load_plan",
    "max_batch_size",
    "max_batch_sizes",
    "measure_step",
    "optimize",
    "pipeline_schedule",
    "plan",
    "plan_pipeline",
]
