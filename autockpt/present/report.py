"""Report: a plan -> a full report file (self-contained HTML with plots, or markdown). The presentation layer: the
library never imports it; ``Plan.report`` and the CLI do."""

from __future__ import annotations

import logging
import os
from html import escape as html_escape

from autockpt.present.page import (
    MEMORY_CATEGORIES,
    REPORT_CSS,
    figure_svg,
    html_table,
    md_table,
    plot_notices,
    write_page,
)
from autockpt.record_types import PlanRecord
from autockpt.records.summary import (
    breakdown_rows,
    decisions_line,
    floor_note,
    module_rows,
    overhead_breakdown,
    pool_line,
    region_rows,
)
from autockpt.units import GB, format_bytes

_LOG = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------------- full reports

def write_report(plan: PlanRecord, path: str | os.PathLike[str], *, depth: int = 2) -> None:
    """HTML (self-contained, plots inline as SVG) when ``path`` ends in .html/.htm, else markdown (no plots, no
    matplotlib)."""
    write_page(path, lambda: report_html(plan, depth=depth), lambda: report_markdown(plan, depth=depth))


def _headline(plan: PlanRecord) -> list[tuple[str, str]]:
    rows = [
        ("strategy / status", f"{plan.strategy} / {plan.status.value}"),
        ("capture", plan.capture.value),
        ("budget", format_bytes(plan.budget_bytes)),
        ("predicted peak", format_bytes(plan.predicted_peak_bytes)),
        ("unmodified peak (predicted = profiled)", format_bytes(plan.baseline_peak_bytes)),
        ("smallest feasible peak", format_bytes(plan.min_feasible_bytes) + floor_note(plan)),
        ("static (parameters, buffers, gradients, inputs)", format_bytes(plan.static_bytes)),
        ("predicted overhead", f"+{100 * plan.predicted_overhead:.1f}% of the step ({overhead_breakdown(plan)})"),
        ("recomputed", decisions_line(plan)),
    ]
    if plan.provenance is not None:
        rows.append(("made from (trace, timing, device)", plan.provenance.describe()))
    if plan.host_pool_bytes:
        rows.append(("host pool", pool_line(plan)))
    if plan.measured_peak_bytes is not None:
        rows.append(("measured peak (one real step)", format_bytes(plan.measured_peak_bytes)))
    if plan.measured_reserved_bytes is not None:
        rows.append(("reserved by the CUDA caching allocator at that step", format_bytes(plan.measured_reserved_bytes)))
    if plan.foreign_bytes:
        rows.append(("device bytes the step does not own (counted in every prediction)", format_bytes(plan.foreign_bytes)))
    if plan.fingerprint is not None:
        rows.append(("model", plan.fingerprint.model_class))
        rows.append(("inputs", ", ".join(f"{s.name}: {s.dtype.removeprefix('torch.')}{list(s.shape)}"
                                         for s in plan.fingerprint.inputs)))
    return rows


def _solver_rows(plan: PlanRecord) -> list[tuple[str, str]]:
    rows = [("solver", plan.solver), ("checkpoint", plan.planned_action.value), ("solve time", f"{plan.solve_time_s:.2f} s"),
            ("capture / profile time", f"{plan.capture_time_s:.2f} s / {plan.profile_time_s:.2f} s")]
    stats = plan.solver_stats
    if stats is not None:
        gap = "not reported by this solver" if stats.relative_gap is None else f"{100 * stats.relative_gap:.2f}%"
        rows += [
            ("last program's status", stats.status),
            ("last program's relative gap", gap),
            ("variables / constraints", f"{stats.variables} / {stats.constraints}"),
            ("programs solved", str(stats.programs)),
        ]
    return rows


def _timeline_svg(plan: PlanRecord) -> str:
    from matplotlib.figure import Figure

    curves = [("unmodified step", plan.memory_before), ("under this plan", plan.memory_after)]
    figure = Figure(figsize=(10, 6.4), layout="constrained")
    axes = figure.subplots(2, 1, sharex=True, sharey=True)
    for ax, (title, curve) in zip(axes, curves):
        assert curve is not None
        x = range(len(curve.phases))
        stacks = [[value / GB for value in getattr(curve, name)] for name, _, _ in MEMORY_CATEGORIES]
        ax.stackplot(x, *stacks, labels=[label for _, label, _ in MEMORY_CATEGORIES],
                     colors=[colour for _, _, colour in MEMORY_CATEGORIES], step="post", linewidth=0)
        ax.axhline(plan.budget_bytes / GB, color="black", linestyle="--", linewidth=1.2, label="budget")
        backward = next((i for i, phase in enumerate(curve.phases) if phase.value == "backward"), None)
        if backward is not None:
            ax.axvline(backward, color="#444444", linewidth=0.8, linestyle=":")
            ax.text(backward, ax.get_ylim()[1] * 0.02, "  backward", fontsize=8, color="#444444")
        peak = max(curve.total_bytes)
        if curve.host_pool_bytes:  # host memory: drawn as a line beside the device's stack, not in it
            ax.step(x, [value / GB for value in curve.host_pool_bytes], where="post", color="#8172b3",
                    linewidth=1.4, label="host pool occupancy (host memory)")
        ax.set_title(f"{title}: peak {format_bytes(peak)}", fontsize=10, loc="left")
        ax.set_ylabel("GB (10^9 bytes)")
    axes[1].set_xlabel("event of the training step (forward units, then backward)")
    axes[0].legend(loc="upper left", fontsize=8, ncols=3)
    if plan.memory_after is not None and plan.memory_after.host_pool_bytes:
        axes[1].legend(loc="upper left", fontsize=8, ncols=3)
    return figure_svg(figure)


def _pareto_svg(plan: PlanRecord) -> str:
    from matplotlib.figure import Figure

    points = [p for p in plan.pareto if p.predicted_peak_bytes is not None and p.predicted_overhead is not None]
    figure = Figure(figsize=(6.5, 4), layout="constrained")
    ax = figure.subplots()
    ax.plot([p.predicted_peak_bytes / GB for p in points], [100 * p.predicted_overhead for p in points],
            marker="o", color="#4c72b0", label="plans at other budgets")
    ax.plot([plan.predicted_peak_bytes / GB], [100 * plan.predicted_overhead], marker="*", markersize=14,
            color="#c44e52", linestyle="none", label="this plan")
    ax.set_xlabel("predicted peak, GB (10^9 bytes)")
    ax.set_ylabel("predicted overhead, % of the step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return figure_svg(figure)


def report_html(plan: PlanRecord, *, depth: int = 2) -> str:
    """A self-contained HTML page (no external files or scripts). Without an importable matplotlib the page is
    written without plots and says why at the top and in place of each plot (and a warning is logged)."""
    e = html_escape
    notice, no_plot = plot_notices()
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>autockpt plan: {e(plan.fingerprint.model_class if plan.fingerprint else 'model')}</title>",
        f"<style>{REPORT_CSS}</style></head><body>",
        "<h1>autockpt memory plan</h1>",
        ("<p class='units'>GB = 10<sup>9</sup> bytes, GiB = 2<sup>30</sup> bytes. Everything below is predicted by "
         "autockpt's simulator from one profiled step, except a measured peak, which is said.</p>"),
        *notice,
        html_table(["", ""], _headline(plan), show_header=False, css="summary"),
        "<h2>Memory of one training step</h2>",
    ]
    if plan.memory_before is not None and plan.memory_after is not None:
        parts.append(no_plot or f"<figure>{_timeline_svg(plan)}</figure>")
    else:
        parts.append("<p>No timeline in this plan (it was not made by autockpt's planner).</p>")
    if breakdown_rows(plan):
        parts.append("<h3>At the peak, by category</h3>")
        parts.append(html_table(_breakdown_header(plan), _breakdown_table(plan)))
    parts.append(f"<h2>Per module (depth {depth})</h2>")
    parts.append(html_table(
        ["module", "activation bytes not kept", "recompute ms", "recomputed units"],
        [("&nbsp;" * 4 * (r.path.count(".") + 1 if r.path else 0) + e(r.path or "(model)"), format_bytes(r.saved_bytes),
          f"{r.recompute_ms:.2f}", f"{r.recomputed_units} / {r.units}") for r in module_rows(plan, depth)],
        escape=False,
    ))
    parts.append(f"<h2>Decisions: {len(plan.regions)} regions</h2>")
    if plan.regions:
        parts.append(html_table(
            ["#", "first unit", "last unit", "units", "module", "saved bytes (unmodified)", "recompute ms", "action"],
            [(str(r.index), e(r.first), e(r.last), str(r.units), e(r.module_path or "(model)"),
              format_bytes(r.saved_bytes), f"{r.recompute_ms:.2f}", e(r.action)) for r in region_rows(plan)],
            escape=False,
        ))
    else:
        parts.append("<p>Nothing is recomputed or offloaded: the unmodified step fits the budget.</p>")
    parts.append("<h2>Solver</h2>")
    parts.append(html_table(["", ""], _solver_rows(plan), show_header=False, css="summary"))
    parts.append("<h2>Pareto curve: predicted peak vs predicted overhead</h2>")
    if plan.pareto:
        parts.append(no_plot or f"<figure>{_pareto_svg(plan)}</figure>")
        parts.append(html_table(["budget", "predicted peak", "predicted overhead", "regions"], _pareto_rows(plan)))
    else:
        parts.append("<p>Not computed for this plan (<code>autockpt plan --pareto N</code> or "
                     "<code>Planner.plan(..., pareto_points=N)</code>).</p>")
    if plan.notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(note)}</li>" for note in plan.notes) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _breakdown_header(plan: PlanRecord) -> list[str]:
    after, before = plan.breakdown, plan.baseline_breakdown
    assert after is not None and before is not None
    return ["category", f"this plan, at its predicted peak ({after.phase.value})",
            f"unmodified step, at its peak ({before.phase.value})"]


def _breakdown_table(plan: PlanRecord) -> list[tuple[str, ...]]:
    """The summary's rows, and the host pool's occupancy at each peak (host memory, not in the totals)."""
    rows: list[tuple[str, ...]] = list(breakdown_rows(plan))
    after, before = plan.memory_after, plan.memory_before
    if after is not None and after.host_pool_bytes and plan.breakdown is not None:
        pool_before = before.host_pool_bytes[plan.baseline_breakdown.event] if before and before.host_pool_bytes else 0
        rows.append(("host pool occupancy (host memory, not in the total)",
                     format_bytes(after.host_pool_bytes[plan.breakdown.event]), format_bytes(pool_before)))
    return rows


def _pareto_rows(plan: PlanRecord) -> list[tuple[str, ...]]:
    return [
        (format_bytes(p.budget_bytes),
         "infeasible" if p.predicted_peak_bytes is None else format_bytes(p.predicted_peak_bytes),
         "" if p.predicted_overhead is None else f"+{100 * p.predicted_overhead:.1f}%", str(p.regions))
        for p in plan.pareto
    ]


def report_markdown(plan: PlanRecord, *, depth: int = 2) -> str:
    """The report's tables in markdown (plots are in the HTML report)."""
    lines = ["# autockpt memory plan", "", "GB = 10^9 bytes, GiB = 2^30 bytes; figures are predicted unless said.", ""]
    lines += md_table(["", ""], _headline(plan))
    if breakdown_rows(plan):
        lines += ["", "## At the peak, by category", ""]
        lines += md_table(_breakdown_header(plan), _breakdown_table(plan))
    elif plan.memory_after is not None:
        after = plan.memory_after
        peak_event = max(range(len(after.phases)), key=after.total_bytes.__getitem__)
        lines += ["", "## At the predicted peak", ""]
        lines += md_table(["category", "bytes"], [
            (label, format_bytes(getattr(after, name)[peak_event])) for name, label, _ in MEMORY_CATEGORIES
        ] + [("total", format_bytes(after.total_bytes[peak_event]))]
          + ([("host pool occupancy (host memory, not in the total)", format_bytes(after.host_pool_bytes[peak_event]))]
             if after.host_pool_bytes else []))
    lines += ["", f"## Per module (depth {depth})", ""]
    lines += md_table(
        ["module", "activation bytes not kept", "recompute ms", "recomputed units"],
        [(r.path or "(model)", format_bytes(r.saved_bytes), f"{r.recompute_ms:.2f}", f"{r.recomputed_units} / {r.units}")
         for r in module_rows(plan, depth)],
    )
    lines += ["", f"## Decisions: {len(plan.regions)} regions", ""]
    lines += md_table(
        ["#", "first unit", "last unit", "units", "module", "saved bytes (unmodified)", "recompute ms", "action"],
        [(str(r.index), r.first, r.last, str(r.units), r.module_path or "(model)", format_bytes(r.saved_bytes),
          f"{r.recompute_ms:.2f}", r.action) for r in region_rows(plan)],
    )
    lines += ["", "## Solver", ""]
    lines += md_table(["", ""], _solver_rows(plan))
    if plan.pareto:
        lines += ["", "## Pareto curve", ""]
        lines += md_table(["budget", "predicted peak", "predicted overhead", "regions"], _pareto_rows(plan))
    if plan.notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in plan.notes]
    return "\n".join(lines) + "\n"


