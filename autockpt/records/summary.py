"""Summary: a plan -> readable text, a pandas DataFrame, and its rows per region and per module.

Plain formatting of ``PlanRecord`` values (no plotting): ``Plan.summary()``, ``Plan.to_dataframe()``, the CLI and the
full reports (``report.py``) use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autockpt.record_types import PlanRecord
from autockpt.types import Decision
from autockpt.units import format_bytes

if TYPE_CHECKING:
    import pandas as pd


def floor_note(plan: PlanRecord) -> str:
    """Said after the smallest feasible peak when it comes from the quick search."""
    return "" if plan.floor_complete else " (quick search; a budget below it runs the full search)"


def eager_line(plan: PlanRecord) -> str:
    """The self-check: the user's eager model's unmodified peak beside the captured program's ('' if not measured)."""
    provenance = plan.provenance
    if provenance is None or provenance.eager_peak_bytes is None or provenance.captured_peak_bytes is None:
        return ""
    eager, captured = provenance.eager_peak_bytes, provenance.captured_peak_bytes
    return (f"unmodified peak {format_bytes(eager)}; the captured program's {format_bytes(captured)} "
            f"({100 * (captured / eager - 1):+.2f} %)")


def floor_line(plan: PlanRecord) -> str:
    """Where the floor's plan peaks and the largest categories it holds there: what a lower budget would have to
    shrink ("the end of backward, then optimizer.step(): temporaries 12.4 GB, parameters 2.5 GB")."""
    floor = plan.floor_breakdown
    assert floor is not None
    largest = sorted((row for row in floor.rows() if row[1]), key=lambda row: -row[1])[:3]
    held = ", ".join(f"{name} {format_bytes(size)}" for name, size in largest)
    return f"{floor.moment or floor.phase.value}: {held}"


def loss_line(plan: PlanRecord) -> str:
    """What the loss action does: the chunk, and what the step's output no longer holds."""
    return (
        f"the output projection and cross-entropy in chunks of {plan.loss_chunk_tokens} tokens (the full logits never "
        "made: a training step's output holds no logits; PlanOptions.loss_chunk_tokens=0 keeps them)"
    )


def plan_summary(plan: PlanRecord, *, max_regions: int = 12) -> str:
    lines = [
        (f"autockpt plan: strategy={plan.strategy}, capture={plan.capture.value}, status={plan.status.value}, "
         f"solver={plan.solver}, checkpoint={plan.planned_action.value}"),
        f"  budget                 {format_bytes(plan.budget_bytes)}",
        f"  predicted peak         {format_bytes(plan.predicted_peak_bytes)}",
        f"  unmodified peak        {format_bytes(plan.baseline_peak_bytes)}",
        f"  smallest feasible      {format_bytes(plan.min_feasible_bytes)}{floor_note(plan)}",
        *([f"  the floor is set at    {floor_line(plan)}"] if plan.floor_breakdown is not None else []),
        (f"  static (params, buffers, grads, inputs{', optimizer states' if _has_states(plan) else ''}) "
         f"{format_bytes(plan.static_bytes)}"),
        f"  training loop          {plan.loop.describe() if plan.loop else 'forward + backward (no optimizer step)'}",
        *([f"  made from              {plan.provenance.describe()}"] if plan.provenance is not None else []),
        *([f"  eager model            {eager_line(plan)}"] if eager_line(plan) else []),
        *([f"  other device memory    {foreign_line(plan)}"] if plan.foreign_bytes else []),
        *([f"  measured peak          {measured_line(plan)}"] if plan.measured_peak_bytes is not None else []),
        f"  recomputed             {decisions_line(plan)}",
        *([f"  loss                   {loss_line(plan)}"] if plan.loss_chunk_tokens else []),
        f"  predicted overhead     {100 * plan.predicted_overhead:+.1f}% of the step ({overhead_breakdown(plan)})",
        (f"  time                   capture {plan.capture_time_s:.1f} s, profile {plan.profile_time_s:.1f} s, "
         f"solve {plan.solve_time_s:.1f} s"),
    ]
    if plan.host_pool_bytes:
        lines.append(f"  host pool              {pool_line(plan)}")
    lines += breakdown_lines(plan)
    if plan.regions:
        lines.append("  regions (first unit .. last unit, module):")
        for row in region_rows(plan)[:max_regions]:
            lines.append(
                f"    [{row.index}] {row.first} .. {row.last} ({row.units} units, saves {format_bytes(row.saved_bytes)} "
                f"unmodified, {row.action}) {row.module_path}".rstrip()
            )
        if len(plan.regions) > max_regions:
            lines.append(f"    ... {len(plan.regions) - max_regions} more (plan.to_dataframe() lists every unit)")
    else:
        lines.append("  nothing is recomputed: the unmodified step fits the budget")
    lines += [f"  note: {note}" for note in plan.notes]
    return "\n".join(lines)


def breakdown_rows(plan: PlanRecord) -> list[tuple[str, str, str]]:
    """(category, bytes at the predicted peak under the plan, bytes at the unmodified step's peak), the total last;
    empty when the plan has no breakdown (plan files of schema version 4 or older)."""
    after, before = plan.breakdown, plan.baseline_breakdown
    if after is None or before is None:
        return []
    rows = [
        (name, format_bytes(size), format_bytes(unmodified))
        for (name, size), (_, unmodified) in zip(after.rows(), before.rows())
        if size or unmodified
    ]
    return rows + [("total (the peak)", format_bytes(after.total_bytes), format_bytes(before.total_bytes))]


def breakdown_lines(plan: PlanRecord) -> list[str]:
    """The summary's table of what the peak holds, by category, under the plan and in the unmodified step."""
    rows = breakdown_rows(plan)
    if not rows:
        return []
    after, before = plan.breakdown, plan.baseline_breakdown
    assert after is not None and before is not None
    width = max(26, *(len(row[1]) + 2 for row in rows))
    heading = f"this plan ({after.phase.value})"
    lines = [f"  at the peak, by category {heading:<{width}}unmodified step ({before.phase.value})"]
    lines += [f"    {name:<21}{size:<{width}}{unmodified}" for name, size, unmodified in rows]
    return lines


def foreign_line(plan: PlanRecord) -> str:
    """The device bytes the step does not own that the plan counted."""
    return (
        f"{format_bytes(plan.foreign_bytes)} on the device beyond the model's parameters, buffers, gradients and "
        "inputs when solved (other models, caches, leftovers, kernel workspaces), counted in every prediction"
    )


def measured_line(plan: PlanRecord) -> str:
    """The measured peak, and beside it on CUDA what the caching allocator reserved."""
    text = f"{format_bytes(plan.measured_peak_bytes or 0)} allocated (one real step)"
    if plan.measured_reserved_bytes is not None:
        text += f", {format_bytes(plan.measured_reserved_bytes)} reserved by the CUDA caching allocator"
    return text


def _has_states(plan: PlanRecord) -> bool:
    return plan.loop is not None and plan.loop.optimizer is not None and plan.loop.optimizer.state_bytes > 0


def recomputing_regions(plan: PlanRecord) -> int:
    return sum(1 for action in plan.policy.actions if action.recomputes)


def decisions_line(plan: PlanRecord) -> str:
    """How many units each decision covers, in how many regions."""
    recomputing = recomputing_regions(plan)
    text = f"{len(plan.recomputed_units)} of {len(plan.nodes)} units in {recomputing} checkpointed regions"
    offloading = len(plan.policy.actions) - recomputing
    if offloading:
        offloaded = sum(1 for n in plan.nodes if n.decision is Decision.OFFLOAD)
        text += f"; {offloaded} units in {offloading} regions offload what they save to the host pool"
    return text


def pool_line(plan: PlanRecord) -> str:
    """The host pool: its size, what moves through it per step, and the link time the step waits for."""
    return (
        f"{format_bytes(plan.host_pool_bytes)} of host memory, allocated once (not in the device budget); "
        f"{format_bytes(plan.offloaded_bytes)} moved each way per step, {plan.transfer_ms:.1f} ms of copies not "
        "hidden behind compute"
    )


def overhead_breakdown(plan: PlanRecord) -> str:
    """Where the predicted overhead comes from: recomputed kernels, the checkpoint machinery, offload copies."""
    recomputing = recomputing_regions(plan)
    saved_tensors = sum(n.saved_tensors for n in plan.nodes if n.decision is Decision.RECOMPUTE)
    copies = f" + offload copies waited for {plan.transfer_ms:.1f} ms" if plan.offloaded_bytes else ""
    if plan.loss_chunk_tokens:  # the chunked program's own step against the model's: the logits made again, ...
        chunked_ms = plan.baseline_step_ms * plan.predicted_overhead - plan.recompute_ms - plan.machinery_ms - (
            plan.transfer_ms)
        copies += f" + the loss in chunks of {plan.loss_chunk_tokens} tokens {chunked_ms:+.1f} ms"
    return (
        f"recompute {plan.recompute_ms:.1f} ms + checkpoint machinery {plan.machinery_ms:.1f} ms: "
        f"{recomputing} regions x {plan.region_overhead_ms:.3f} ms + {saved_tensors} saved tensors x "
        f"{plan.saved_tensor_overhead_ms:.4f} ms{copies}; unmodified step {plan.baseline_step_ms:.1f} ms"
    )


def plan_dataframe(plan: PlanRecord) -> pd.DataFrame:
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
            "saved_tensors": [n.saved_tensors for n in plan.nodes],
            "decision": [n.decision.value for n in plan.nodes],
            "action": [n.action.value if n.action is not None else "" for n in plan.nodes],
            "region": pd.array([n.region for n in plan.nodes], dtype="Int64"),
        }
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ModuleRow:
    """Per-module effect of a plan: activation bytes no longer kept, and forward time spent again."""

    path: str
    saved_bytes: int  # bytes the module's recomputed units would have saved for backward
    recompute_ms: float
    recomputed_units: int
    units: int


@dataclass(frozen=True, kw_only=True, slots=True)
class RegionRow:
    index: int
    first: str
    last: str
    units: int
    module_path: str
    saved_bytes: int
    recompute_ms: float
    action: str  # the region's action (``Action.value``)


def enclosing_modules(path: str, depth: int) -> list[str]:
    """The model ("") and the module paths enclosing ``path``, down to ``depth`` levels: per-module tables."""
    parts = path.split(".") if path else []
    return [".".join(parts[:level]) for level in range(min(depth, len(parts)) + 1)]


def module_rows(plan: PlanRecord, depth: int) -> list[ModuleRow]:
    """Modules to ``depth`` levels (the model is depth 0) in order of first appearance in the graph."""
    totals: dict[str, list[float]] = {}
    for node in plan.nodes:
        recomputed = node.decision is Decision.RECOMPUTE
        for module in enclosing_modules(node.module_path, depth):
            row = totals.setdefault(module, [0, 0.0, 0, 0])
            row[0] += node.saved_bytes if recomputed else 0
            row[1] += node.recompute_ms
            row[2] += recomputed
            row[3] += 1
    return [
        ModuleRow(path=path, saved_bytes=int(s), recompute_ms=float(ms), recomputed_units=int(r), units=int(n))
        for path, (s, ms, r, n) in totals.items()
    ]


def region_rows(plan: PlanRecord) -> list[RegionRow]:
    rows = []
    for index, (region, action) in enumerate(zip(plan.regions, plan.policy.actions)):
        nodes = plan.nodes[region.first_unit : region.last_unit + 1]
        paths = [n.module_path for n in nodes]
        rows.append(
            RegionRow(
                index=index, first=nodes[0].name, last=nodes[-1].name, units=len(nodes),
                module_path=_common_module(paths), saved_bytes=sum(n.saved_bytes for n in nodes),
                recompute_ms=sum(n.recompute_ms for n in nodes), action=action.value,
            )
        )
    return rows


def _common_module(paths: list[str]) -> str:
    split = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for parts in zip(*split):
        if any(part != parts[0] for part in parts):
            break
        common.append(parts[0])
    return ".".join(common)
