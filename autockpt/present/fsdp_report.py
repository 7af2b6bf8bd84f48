"""FSDP2 report: an ``FSDPPlan`` -> a report file (self-contained HTML with rank 0's timeline over the step drawn
by category under the budget line, or markdown). The presentation layer, beside ``pipeline_report.py`` whose page
parts it shares: ``FSDPPlan.report`` loads it by name (``presentation_writer``); the library never imports it.
"""

from __future__ import annotations

import os
from html import escape as html_escape
from typing import TYPE_CHECKING

from autockpt.present.page import (
    REPORT_CSS,
    axis_scale,
    figure_svg,
    html_table,
    md_table,
    plot_notices,
    write_page,
)
from autockpt.units import format_bytes

if TYPE_CHECKING:
    from autockpt.records.fsdp_plan import FSDPPlan

# one colour per FSDPMemTracker category, in the order the tracker lists them
_COLOURS = ("#4c72b0", "#a1c9f4", "#dd8452", "#ffb482", "#55a868", "#8de5a1", "#c44e52", "#8172b3", "#937860",
            "#8c8c8c", "#da8bc3")
_TIMELINE_TEXT = (
    "Rank 0 over the second training step, at FSDP2's unit boundaries in the order they run: each unit's forward "
    "start, its start once its parameters are gathered, its peak and its end; the same in backward, units in "
    "reverse; then optimizer.step(). Every rank's figures are rank 0's (the fake process group's view; see "
    "RankFigures). Peaks between unit boundaries (the loss, a for-loop optimizer step) are in the table at the peak."
)


def write_fsdp_report(fplan: FSDPPlan, path: str | os.PathLike[str]) -> None:
    """HTML (self-contained, the timeline inline as SVG) when ``path`` ends in .html/.htm, else markdown."""
    write_page(path, lambda: fsdp_report_html(fplan), lambda: fsdp_report_markdown(fplan))


def _peak_table(fplan: FSDPPlan) -> tuple[list[str], list[tuple[str, ...]]]:
    categories = [k for k, _ in fplan.ranks[0].breakdown]
    rows = []
    for r in fplan.ranks:
        values = dict(r.breakdown)
        rows.append((str(r.rank), *(format_bytes(values[c]) for c in categories), format_bytes(r.peak_bytes),
                     format_bytes(fplan.budget_bytes), format_bytes(fplan.budget_bytes - r.peak_bytes)))
    return ["rank", *categories, "peak", "budget", "headroom"], rows


def _shown_categories(fplan: FSDPPlan) -> list[str]:
    timeline = fplan.ranks[0].timeline
    return [k for k, _ in fplan.ranks[0].breakdown if any(dict(t.breakdown).get(k) for t in timeline)]


def _timeline_table(fplan: FSDPPlan) -> tuple[list[str], list[tuple[str, ...]]]:
    shown = _shown_categories(fplan)
    rows = [(t.label, format_bytes(t.total_bytes), format_bytes(fplan.budget_bytes - t.total_bytes),
             *(format_bytes(dict(t.breakdown).get(c, 0)) for c in shown)) for t in fplan.ranks[0].timeline]
    return ["moment", "total", "under the budget by", *shown], rows


def fsdp_report_markdown(fplan: FSDPPlan) -> str:
    lines = ["# autockpt FSDP2 plan", "", "```", *fplan.summary().splitlines(), "```", "", "## Per rank at its peak",
             "", *md_table(*_peak_table(fplan)), ""]
    if fplan.ranks[0].timeline:
        lines += ["## Rank 0 over the second step", "", _TIMELINE_TEXT, "", *md_table(*_timeline_table(fplan)), ""]
    return "\n".join(lines)


def fsdp_report_html(fplan: FSDPPlan) -> str:
    """A self-contained HTML page; without an importable matplotlib it has no plot and says why."""
    notice, no_plot = plot_notices()
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>autockpt FSDP2 plan</title>",
        f"<style>{REPORT_CSS}</style></head><body><h1>autockpt FSDP2 plan</h1>", *notice,
        f"<pre>{html_escape(fplan.summary())}</pre>",
        "<h2>Per rank at its peak</h2>", html_table(*_peak_table(fplan)),
    ]
    if fplan.ranks[0].timeline:
        parts += ["<h2>Rank 0 over the second step</h2>", f"<p>{html_escape(_TIMELINE_TEXT)}</p>",
                  no_plot or f"<figure>{_timeline_svg(fplan)}</figure>", html_table(*_timeline_table(fplan))]
    parts.append("</body></html>")
    return "".join(parts)


def _timeline_svg(fplan: FSDPPlan) -> str:
    """Stacked bars, one per moment, by category, with the budget as a dashed line (left out when far above)."""
    from matplotlib.figure import Figure

    timeline = fplan.ranks[0].timeline
    top = max(t.total_bytes for t in timeline)
    budget_drawn = fplan.budget_bytes <= 3 * top  # a budget far above the step would flatten the bars
    size, unit = axis_scale(max(top, fplan.budget_bytes if budget_drawn else 0))
    figure = Figure(figsize=(11, 3.8), layout="constrained")
    ax = figure.subplots()
    bottoms = [0.0] * len(timeline)
    for colour, category in zip(_COLOURS * 2, _shown_categories(fplan)):
        heights = [dict(t.breakdown).get(category, 0) / size for t in timeline]
        ax.bar(range(len(timeline)), heights, bottom=bottoms, color=colour, label=category, width=0.85)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    if budget_drawn:
        ax.axhline(fplan.budget_bytes / size, color="black", linestyle="--", linewidth=1.2,
                   label=f"budget {format_bytes(fplan.budget_bytes)}")
    backward = next((i for i, t in enumerate(timeline) if "backward" in t.label), None)
    if backward is not None:
        ax.axvline(backward - 0.5, color="#444444", linewidth=0.8, linestyle=":")
        ax.text(backward - 0.5, ax.get_ylim()[1] * 0.02, "  backward", fontsize=8, color="#444444")
    budget = "" if budget_drawn else f" (budget {format_bytes(fplan.budget_bytes)}: far above, not drawn)"
    ax.set_title(f"rank 0, predicted peak {format_bytes(fplan.predicted_peak_bytes)}{budget}", fontsize=10,
                 loc="left")
    ax.set_ylabel(unit)
    ax.set_xlabel("moment of the second step (named in the table below)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    return figure_svg(figure)
