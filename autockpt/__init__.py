"""autockpt: fit PyTorch training into a memory budget by choosing what to recompute.

    model = autockpt.optimize(model, budget_gb=20, example_inputs=(batch,))

Budgets are in GB = 10^9 bytes (``budget_gb``) or bytes (``budget_bytes``).
"""

from __future__ import annotations

from autockpt.api import default_loss, get_plan, optimize, plan
from autockpt.errors import AutockptError, CaptureError, InfeasibleBudgetError, ProfileError
from autockpt.measure import measure_step
from autockpt.rewrite import OptimizedModule
from autockpt.solve.ilp import SolverOptions
from autockpt.types import CaptureKind, Decision, Plan, PlanStatus, Region

__all__ = [
    "AutockptError",
    "CaptureError",
    "CaptureKind",
    "Decision",
    "InfeasibleBudgetError",
    "OptimizedModule",
    "Plan",
    "PlanStatus",
    "ProfileError",
    "Region",
    "SolverOptions",
    "default_loss",
    "get_plan",
    "measure_step",
    "optimize",
    "plan",
]
