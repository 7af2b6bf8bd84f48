"""Report: Plan -> readable text and a pandas DataFrame."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autockpt.types import Plan

if TYPE_CHECKING:
    import pandas as pd

GB = 10**9
GIB = 2**30


def format_bytes(nbytes: float) -> str:
    """Bytes as GB (10^9) with GiB (2^30) beside, e.g. '1.500 GB (1.397 GiB)'."""
    return f"{nbytes / GB:.3f} GB ({nbytes / GIB:.3f} GiB)"


def plan_summary(plan: Plan, *, max_regions: int = 12) -> str:
    recomputed = plan.recomputed_units
    lines = [
        f"autockpt plan: capture={plan.capture.value}, status={plan.status.value}, solver={plan.solver}",
        f"  budget                 {format_bytes(plan.budget_bytes)}",
        f"  predicted peak         {format_bytes(plan.predicted_peak_bytes)}",
        f"  unmodified peak        {format_bytes(plan.baseline_peak_bytes)}",
        f"  smallest feasible      {format_bytes(plan.min_feasible_bytes)}",
        f"  static (params, buffers, grads, inputs) {format_bytes(plan.static_bytes)}",
        f"  recomputed             {len(recomputed)} of {len(plan.nodes)} units in {len(plan.regions)} checkpointed regions",
        f"  predicted overhead     +{100 * plan.predicted_overhead:.1f}% of the step "
        f"(recompute {plan.recompute_ms:.1f} ms, unmodified step {plan.baseline_step_ms:.1f} ms)",
        f"  time                   capture {plan.capture_time_s:.1f} s, profile {plan.profile_time_s:.1f} s, "
        f"solve {plan.solve_time_s:.1f} s",
    ]
    if plan.regions:
        lines.append("  checkpointed regions (first unit .. last unit, module):")
        for index, region in enumerate(plan.regions[:max_regions]):
            first, last = plan.nodes[region.first_unit], plan.nodes[region.last_unit]
            saved = sum(n.saved_bytes for n in plan.nodes[region.first_unit : region.last_unit + 1])
            lines.append(
                f"    [{index}] {first.name} .. {last.name} ({region.last_unit - region.first_unit + 1} units, "
                f"saves {saved / GB:.4f} GB unmodified) {first.module_path or ''}".rstrip()
            )
        if len(plan.regions) > max_regions:
            lines.append(f"    ... {len(plan.regions) - max_regions} more (plan.to_dataframe() lists every unit)")
    else:
        lines.append("  nothing is recomputed: the unmodified step fits the budget")
    lines += [f"  note: {note}" for note in plan.notes]
    return "\n".join(lines)


def plan_dataframe(plan: Plan) -> pd.DataFrame:
    import pandas as pd

    return pd.DataFrame(
        {
            "name": [n.name for n in plan.nodes],
            "op": [n.op for n in plan.nodes],
            "module_path": [n.module_path for n in plan.nodes],
            "saved_bytes": [n.saved_bytes for n in plan.nodes],
            "output_bytes": [n.output_bytes for n in plan.nodes],
            "forward_ms": [n.forward_ms for n in plan.nodes],
            "flops": [n.flops for n in plan.nodes],
            "decision": [n.decision.value for n in plan.nodes],
            "region": pd.array([n.region for n in plan.nodes], dtype="Int64"),
        }
    )

