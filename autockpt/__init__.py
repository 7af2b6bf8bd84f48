"""autockpt: fit PyTorch training into a memory budget by choosing what to recompute, offload, and where it runs.

    model = autockpt.optimize(model, budget_gb=20, example_inputs=(batch,))

Budgets are in GB = 10^9 bytes (``budget_gb``) or bytes (``budget_bytes``). The names below are the public facade;
everything else lives in the subpackages (``autockpt.core``, ``measure``, ``runtime``, ``planning``, ``records``,
``pipeline``, ``present``). Names that left the facade in 0.2 still work from ``autockpt`` in 0.2.x with a
``DeprecationWarning`` that names their new home (CHANGELOG.md lists them).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from autockpt.core.devices import DeviceSpec
from autockpt.core.solve.base import SolverOptions
from autockpt.errors import AutockptError, InfeasibleBudgetError, PlanMismatchError
from autockpt.fsdp import apply_fsdp, load_fsdp_plan, plan_fsdp
from autockpt.measure.step import measure_step
from autockpt.pipeline.plan import PipelinePlan, compare_pipeline_splits, load_pipeline_plan, plan_pipeline
from autockpt.pipeline.run import pipeline_schedule
from autockpt.planning.api import apply_plan, get_plan, optimize, plan
from autockpt.planning.batch_size import max_batch_size
from autockpt.planning.estimate import estimate
from autockpt.planning.options import PlanOptions
from autockpt.planning.planner import Planner
from autockpt.records.plan import Plan, load_plan
from autockpt.types import Action

__version__ = "0.2.0"

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

# The names that were in the facade in 0.1, and where they live now (``autockpt.X`` warns and returns them in 0.2.x).
MOVED_NAMES = {
    "BASELINE_STRATEGIES": "autockpt.core.solve.baselines",
    "baseline_regions": "autockpt.core.solve.baselines",
    "BatchSizeResult": "autockpt.planning.batch_size",
    "ExampleBatch": "autockpt.planning.batch_size",
    "max_batch_sizes": "autockpt.planning.batch_size",
    "MemoryEstimate": "autockpt.planning.estimate",
    "baseline_plan": "autockpt.planning.planner",
    "default_loss": "autockpt.measure.loss",
    "OptimizedModule": "autockpt.runtime.rewrite",
    "CaptureError": "autockpt.errors",
    "LossFunctionError": "autockpt.errors",
    "PlanFileError": "autockpt.errors",
    "ProfileError": "autockpt.errors",
    "UnplannedStepError": "autockpt.errors",
    "CaptureKind": "autockpt.types",
    "Decision": "autockpt.types",
    "MemoryCurve": "autockpt.types",
    "ParetoPoint": "autockpt.record_types",
    "PipelineSchedule": "autockpt.types",
    "Placement": "autockpt.types",
    "PlanStatus": "autockpt.types",
    "Policy": "autockpt.types",
    "Region": "autockpt.types",
    "RegionAction": "autockpt.types",
    "SolverStats": "autockpt.types",
    "Stage": "autockpt.types",
}


# Names of 0.1 that were renamed: the old name warns and returns the new one's value.
RENAMED_NAMES = {"CheckpointKind": "autockpt.types"}  # autockpt.types.CheckpointKind -> Action (it warns as well)


def __getattr__(name: str) -> Any:
    if name in RENAMED_NAMES:
        warnings.warn(
            f"autockpt.{name} is renamed autockpt.Action (autockpt.{name} is removed in 0.3)",
            DeprecationWarning, stacklevel=2,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return getattr(importlib.import_module(RENAMED_NAMES[name]), name)
    if name in MOVED_NAMES:
        home = MOVED_NAMES[name]
        warnings.warn(
            f"autockpt.{name} left the facade in 0.2: import it from {home} (autockpt.{name} is removed in 0.3)",
            DeprecationWarning, stacklevel=2,
        )
        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module 'autockpt' has no attribute {name!r}")
