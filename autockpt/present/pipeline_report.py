"""Pipeline report: a pipeline plan -> a report file (self-contained HTML with one memory timeline per stage and a
chart of the schedule, or markdown). The presentation layer, beside ``report.py`` whose tables, categories and page
style it uses: the library never imports it; ``PipelinePlan.report`` does, inside the method.

This module reads a ``PipelinePlan`` by its fields (``PipelineRecord``) instead of importing ``pipeline/plan.py``,
which imports this module when asked for a report: no import circle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from html import escape as html_escape

from autockpt.present.page import (
    MEMORY_CATEGORIES,
    REPORT_CSS,
    axis_scale,
    figure_svg,
    html_table,
    md_table,
    plot_notices,
    write_page,
)
from autockpt.record_types import PipelineRecord, PipelineStageRecord, PlanRecord
from autockpt.records.summary import decisions_line, recomputing_regions
from autockpt.types import Phase, PipelineSchedule
from autockpt.units import format_bytes

_OTHERS_COLOUR = "#937860"  # what the other microbatches in flight keep
_BUFFERS_COLOUR = "#da8bc3"  # the schedule's buffers
_FORWARD_COLOUR = "#4c72b0"
_BACKWARD_COLOUR = "#dd8452"


def write_pipeline_report(pplan: PipelineRecord, path: str | os.PathLike[str]) -> None:
    """HTML (self-contained, plots inline as SVG) when ``path`` ends in .html/.htm, else markdown (no plots, no
    matplotlib)."""
    write_page(path, lambda: pipeline_report_html(pplan), lambda: pipeline_report_markdown(pplan))


# ------------------------------------------------------------------------------------------------ what is drawn


@dataclass(frozen=True, kw_only=True, slots=True)
class StageMemory:
    """How a stage's predicted peak is formed (``pipeline._StageTable._solve``): the stage plan's peak for one
    microbatch, plus what the other microbatches in flight keep for their backward, plus the schedule's buffers; and
    on the last stage, when the step returns the outputs, the larger of that and the bytes at the end of the step."""

    one_microbatch_bytes: int
    others_bytes: int  # (microbatches in flight - 1) x retained bytes
    buffer_bytes: int
    predicted_peak_bytes: int

    @property
    def stacked_bytes(self) -> int:
        return self.one_microbatch_bytes + self.others_bytes + self.buffer_bytes

    @property
    def end_of_step_dominates(self) -> bool:
        return self.predicted_peak_bytes > self.stacked_bytes


def stage_memory(record: PipelineStageRecord, plan: PlanRecord) -> StageMemory:
    return StageMemory(
        one_microbatch_bytes=plan.predicted_peak_bytes,
        others_bytes=(record.microbatches_in_flight - 1) * record.retained_bytes,
        buffer_bytes=record.schedule_buffer_bytes,
        predicted_peak_bytes=record.predicted_peak_bytes,
    )


def _others(record: PipelineStageRecord) -> str:
    others = record.microbatches_in_flight - 1
    return f"{others} other microbatch{'' if others == 1 else 'es'}"


def _peak_text(pplan: PipelineRecord, record: PipelineStageRecord, memory: StageMemory) -> str:
    """The stage's predicted peak as the planner formed it, in words, with its numbers."""
    text = (
        f"predicted peak {format_bytes(memory.predicted_peak_bytes)} = one microbatch's step under the stage plan "
        f"{format_bytes(memory.one_microbatch_bytes)} + {_others(record)} in flight x "
        f"{format_bytes(record.retained_bytes)} kept for their backward + the schedule's buffers "
        f"{format_bytes(memory.buffer_bytes)}"
    )
    last = record.index == pplan.num_stages - 1
    if memory.end_of_step_dominates:
        what = ("the bytes at the end of the step, when the schedule concatenates every microbatch's output into the "
                "batch's while it still holds them (parameters, gradients, inputs, the target, the microbatches' losses "
                "and twice the outputs)"
                if last and pplan.return_outputs else "another term of the planner")
        return (
            f"predicted peak {format_bytes(memory.predicted_peak_bytes)}: the larger of {what}, "
            f"{format_bytes(memory.predicted_peak_bytes)}, and one microbatch's step under the stage plan "
            f"{format_bytes(memory.one_microbatch_bytes)} + {_others(record)} in flight x "
            f"{format_bytes(record.retained_bytes)} + the schedule's buffers "
            f"{format_bytes(memory.buffer_bytes)} = {format_bytes(memory.stacked_bytes)}"
        )
    if memory.predicted_peak_bytes < memory.stacked_bytes:  # not how the planner forms it: say so, do not hide it
        return text + (f" = {format_bytes(memory.stacked_bytes)}, which is more than the peak the plan records "
                       f"({format_bytes(memory.predicted_peak_bytes)})")
    if last and pplan.return_outputs:
        text += ("; the planner takes the larger of this and the bytes at the end of the step, when the schedule "
                 "concatenates the outputs (lower here; not kept in the plan)")
    return text


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleBox:
    """One forward or backward of one microbatch on one stage in the schedule chart, in ms from the step's start."""

    stage: int
    forward: bool
    microbatch: int
    start_ms: float
    end_ms: float


def schedule_order(schedule: PipelineSchedule, stage: int, num_stages: int, microbatches: int) -> list[tuple[bool, int]]:
    """The (forward?, microbatch) a stage runs, in the order ``torch.distributed.pipelining`` runs them. GPipe: every
    forward, then every backward. 1F1B (``Schedule1F1B``): min(stages - stage, microbatches) forwards, then a
    backward and a forward in turn while forwards are left, then the backwards left."""
    if schedule is PipelineSchedule.GPIPE:
        return [(True, i) for i in range(microbatches)] + [(False, i) for i in range(microbatches)]
    warmup = min(num_stages - stage, microbatches)
    order = [(True, i) for i in range(warmup)]
    forward = warmup
    for backward in range(microbatches):
        order.append((False, backward))
        if forward < microbatches:
            order.append((True, forward))
            forward += 1
    return order


def forward_backward_ms(record: PipelineStageRecord, plan: PlanRecord) -> tuple[float, float]:
    """The chart's forward and backward box of one microbatch on a stage. The plan keeps one time per microbatch
    (forward, backward and recomputation together), not the split: the forward is drawn as a third of it less the
    stage plan's recomputation and checkpoint machinery (backward = twice the forward, the usual ratio), the backward
    as the rest, so that the two add up to the plan's time."""
    total = record.predicted_microbatch_ms
    forward = max(total - plan.recompute_ms - plan.machinery_ms, 0.0) / 3
    return forward, total - forward


def send_ms(pplan: PipelineRecord, stage: int) -> float:
    """One microbatch's send over the cut after ``stage`` (activations forward, or their gradients backward) at the
    link price the plan was made with (GB = 10^9 bytes)."""
    return pplan.stages[stage].sent_bytes / (pplan.link_gb_per_s * 1e6) if pplan.link_gb_per_s > 0 else 0.0


def schedule_boxes(pplan: PipelineRecord) -> list[ScheduleBox]:
    """Every stage runs its forwards and backwards in the schedule's order (``schedule_order``); each starts when the
    stage is free and its input is there: the previous stage's forward of that microbatch, or the next stage's
    backward, plus the send at the plan's link price."""
    num_stages, m = pplan.num_stages, pplan.microbatches
    orders = [schedule_order(pplan.schedule, k, num_stages, m) for k in range(num_stages)]
    times = [forward_backward_ms(record, plan) for record, plan in zip(pplan.stages, pplan.stage_plans)]
    done: dict[tuple[bool, int, int], float] = {}  # (forward?, stage, microbatch) -> end, ms
    boxes: list[ScheduleBox] = []
    position, free = [0] * num_stages, [0.0] * num_stages
    while any(position[k] < len(orders[k]) for k in range(num_stages)):
        placed = False
        for k in range(num_stages):
            while position[k] < len(orders[k]):
                forward, i = orders[k][position[k]]
                if forward:
                    ready = 0.0 if k == 0 else _after(done.get((True, k - 1, i)), send_ms(pplan, k - 1))
                elif k == num_stages - 1:
                    ready = done.get((True, k, i))
                else:
                    ready = _after(done.get((False, k + 1, i)), send_ms(pplan, k))
                if ready is None:
                    break
                start = max(free[k], ready)
                end = start + times[k][0 if forward else 1]
                boxes.append(ScheduleBox(stage=k, forward=forward, microbatch=i, start_ms=start, end_ms=end))
                done[(forward, k, i)] = free[k] = end
                position[k] += 1
                placed = True
        if not placed:  # the schedule orders above never wait on each other in a circle
            raise AssertionError(f"schedule {pplan.schedule.value} cannot be drawn: stages wait on each other")
    return boxes


def _after(end_ms: float | None, send: float) -> float | None:
    return None if end_ms is None else end_ms + send


_SCHEDULE_TEXT = (
    "How the chart is drawn: every stage runs its forwards (F) and backwards (B) in the order torch.distributed."
    "pipelining's {schedule} runs them; each starts when the stage is free and its input is there (the previous "
    "stage's forward of that microbatch, or the next stage's backward, plus the send at the plan's link price). The "
    "plan keeps one predicted time per microbatch per stage (forward, backward and recomputation together), not the "
    "split, so the forward box is drawn as a third of it less the stage's recomputation and checkpoint machinery "
    "(backward = twice the forward, the usual ratio) and the backward box as the rest. Torch's pairing of sends with "
    "receives is not drawn. The chart ends at {end:.2f} ms; the plan's predicted step, {step:.2f} ms, is the formula "
    "the split was chosen by: (microbatches + stages - 1) x the slowest stage's ms per microbatch + microbatches x "
    "the sends, both ways."
)


# ------------------------------------------------------------------------------------------------ plots


def _stage_timeline_svg(pplan: PipelineRecord, record: PipelineStageRecord, plan: PlanRecord) -> str:
    from matplotlib.figure import Figure

    curve = plan.memory_after
    assert curve is not None
    memory = stage_memory(record, plan)
    data_top = max(memory.predicted_peak_bytes, memory.stacked_bytes, max(curve.total_bytes, default=0))
    budget_drawn = record.budget_bytes <= 3 * data_top  # a budget far above the step would flatten the curve
    size, unit = axis_scale(max(data_top, record.budget_bytes if budget_drawn else 0))
    figure = Figure(figsize=(11, 3.8), layout="constrained")
    ax = figure.subplots()
    x = range(len(curve.phases))
    stacks = [[value / size for value in getattr(curve, name)] for name, _, _ in MEMORY_CATEGORIES]
    stacks.append([memory.others_bytes / size] * len(x))
    stacks.append([memory.buffer_bytes / size] * len(x))
    labels = [f"one microbatch: {label}" for _, label, _ in MEMORY_CATEGORIES] + [
        f"{_others(record)} in flight x {format_bytes(record.retained_bytes)}",
        "schedule buffers",
    ]
    colours = [colour for _, _, colour in MEMORY_CATEGORIES] + [_OTHERS_COLOUR, _BUFFERS_COLOUR]
    ax.stackplot(x, *stacks, labels=labels, colors=colours, step="post", linewidth=0)
    if budget_drawn:
        ax.axhline(record.budget_bytes / size, color="black", linestyle="--", linewidth=1.2,
                   label=f"budget {format_bytes(record.budget_bytes)}")
    if memory.end_of_step_dominates:
        ax.axhline(memory.predicted_peak_bytes / size, color="#c44e52", linestyle=":", linewidth=1.4,
                   label=f"end of step (outputs concatenated): {format_bytes(memory.predicted_peak_bytes)}")
    backward = next((i for i, phase in enumerate(curve.phases) if phase is Phase.BACKWARD), None)
    if backward is not None:
        ax.axvline(backward, color="#444444", linewidth=0.8, linestyle=":")
        ax.text(backward, ax.get_ylim()[1] * 0.02, "  backward", fontsize=8, color="#444444")
    budget = "" if budget_drawn else f" (budget {format_bytes(record.budget_bytes)}: far above, not drawn)"
    ax.set_title(f"stage {record.index}: units {record.first_unit}-{record.last_unit}, predicted peak "
                 f"{format_bytes(record.predicted_peak_bytes)}{budget}", fontsize=10, loc="left")
    ax.set_ylabel(unit)
    ax.set_xlabel("event of one microbatch's step on this stage (forward units, then backward)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    return figure_svg(figure)


def _schedule_svg(pplan: PipelineRecord, boxes: list[ScheduleBox]) -> str:
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    figure = Figure(figsize=(10, 0.8 + 0.7 * pplan.num_stages), layout="constrained")
    ax = figure.subplots()
    end = max((box.end_ms for box in boxes), default=0.0)
    for box in boxes:
        row = pplan.num_stages - 1 - box.stage  # stage 0 on top
        ax.broken_barh([(box.start_ms, box.end_ms - box.start_ms)], (row - 0.4, 0.8),
                       facecolors=_FORWARD_COLOUR if box.forward else _BACKWARD_COLOUR, edgecolors="white")
        ax.text((box.start_ms + box.end_ms) / 2, row, f"{'F' if box.forward else 'B'}{box.microbatch}",
                ha="center", va="center", fontsize=7, color="white")
    ax.axvline(pplan.predicted_step_ms, color="black", linestyle="--", linewidth=1.0)
    ax.set_yticks(range(pplan.num_stages), [f"stage {k}" for k in reversed(range(pplan.num_stages))])
    ax.set_xlabel("ms from the start of the step (predicted)")
    ax.set_title(f"schedule {pplan.schedule.value}, {pplan.microbatches} microbatches: the chart ends at {end:.2f} ms; "
                 f"dashed: the plan's predicted step {pplan.predicted_step_ms:.2f} ms", fontsize=10, loc="left")
    ax.legend(handles=[Patch(color=_FORWARD_COLOUR, label="forward"), Patch(color=_BACKWARD_COLOUR,
                                                                          label="backward (with recomputation)")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return figure_svg(figure)


# ------------------------------------------------------------------------------------------------ tables


def _headline(pplan: PipelineRecord) -> list[tuple[str, str]]:
    return [
        ("strategy", pplan.strategy),
        ("model", pplan.fingerprint.model_class),
        ("stages", str(pplan.num_stages)),
        ("microbatches", str(pplan.microbatches)),
        ("schedule", pplan.schedule.value),
        ("cut after units", ", ".join(map(str, pplan.cuts))),
        ("predicted step", (f"{pplan.predicted_step_ms:.2f} ms ((microbatches + stages - 1) x the slowest stage's "
                            "ms per microbatch + microbatches x the sends, both ways)")),
        ("link priced at", f"{pplan.link_gb_per_s:.2f} GB/s (GB = 10^9 bytes)"),
        ("outputs returned by the step", "yes" if pplan.return_outputs else "no"),
        *([("made from (trace, timing, device)", pplan.provenance.describe())] if pplan.provenance is not None else []),
    ]


def _stage_rows(pplan: PipelineRecord) -> list[tuple[str, ...]]:
    rows = []
    for record, plan in zip(pplan.stages, pplan.stage_plans):
        rows.append((
            str(record.index), f"{record.first_unit}-{record.last_unit}", ", ".join(record.module_paths),
            format_bytes(record.parameter_bytes), format_bytes(record.budget_bytes),
            format_bytes(record.predicted_peak_bytes),
            f"{record.microbatches_in_flight} x {format_bytes(record.retained_bytes)}",
            format_bytes(record.schedule_buffer_bytes), str(recomputing_regions(plan)),
            f"{record.predicted_microbatch_ms:.2f}",
            format_bytes(record.sent_bytes) if record.index < pplan.num_stages - 1 else "(last stage)",
        ))
    return rows


_STAGE_COLUMNS = [
    "stage", "units", "modules", "parameters", "budget", "predicted peak", "in flight x kept for backward",
    "schedule buffers", "regions recomputed", "ms per microbatch", "sent per microbatch",
]


def _shared_rows(pplan: PipelineRecord) -> list[tuple[str, ...]]:
    return [(shared.name, format_bytes(shared.nbytes), ", ".join(map(str, shared.stages)))
            for shared in pplan.shared_parameters]


def _order_rows(pplan: PipelineRecord) -> list[tuple[str, ...]]:
    return [
        (str(k), " ".join(f"{'F' if forward else 'B'}{i}" for forward, i in
                          schedule_order(pplan.schedule, k, pplan.num_stages, pplan.microbatches)))
        for k in range(pplan.num_stages)
    ]


_SHARED_TEXT = "held by every stage that reads it; their gradients are summed across them after each step"
_UNITS_TEXT = "GB = 10^9 bytes, GiB = 2^30 bytes (MB = 10^6, kB = 10^3). Everything below is predicted by autockpt."
_BAND_TEXT = (
    "Each stage's timeline is its plan's predicted memory for one microbatch's step, by category, with a band on top "
    "for what the stage holds beside it through the step: the other microbatches in flight, each keeping what its "
    "forward leaves for its backward under the stage plan, and the schedule's buffers (receive buffers for inputs "
    "and output gradients; on stage 0 the rest of the batch; on the last stage the target and the outputs it keeps "
    "to return). The planner adds that band to the one-microbatch step as a constant, the most the schedule holds "
    "at once, not as it changes over the step."
)


# ------------------------------------------------------------------------------------------------ pages


def pipeline_report_html(pplan: PipelineRecord) -> str:
    """A self-contained HTML page (no external files or scripts). Without an importable matplotlib the page is
    written without plots and says why at the top and in place of each plot (and a warning is logged)."""
    e = html_escape
    notice, no_plot = plot_notices()
    boxes = schedule_boxes(pplan)
    end = max((box.end_ms for box in boxes), default=0.0)
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>autockpt pipeline plan: {e(pplan.fingerprint.model_class)}</title>",
        f"<style>{REPORT_CSS}</style></head><body>",
        "<h1>autockpt pipeline plan</h1>",
        f"<p class='units'>{e(_UNITS_TEXT)}</p>",
        *notice,
        html_table(["", ""], _headline(pplan), show_header=False, css="summary"),
        "<h2>Stages</h2>",
        html_table(_STAGE_COLUMNS, _stage_rows(pplan)),
        "<h2>Shared parameters</h2>",
    ]
    shared = _shared_rows(pplan)
    if shared:
        parts.append(f"<p>Each is {e(_SHARED_TEXT)}.</p>")
        parts.append(html_table(["parameter", "bytes", "stages"], shared))
    else:
        parts.append("<p>None: no parameter is read by more than one stage.</p>")
    parts.append("<h2>Memory per stage</h2>")
    parts.append(f"<p>{e(_BAND_TEXT)}</p>")
    for record, plan in zip(pplan.stages, pplan.stage_plans):
        memory = stage_memory(record, plan)
        parts.append(f"<h3 id='stage-{record.index}'>Stage {record.index}: units {record.first_unit}-"
                     f"{record.last_unit} ({e(', '.join(record.module_paths))})</h3>")
        parts.append(f"<p>Budget {e(format_bytes(record.budget_bytes))}; {e(_peak_text(pplan, record, memory))}. "
                     f"Recomputed: {e(decisions_line(plan))}.</p>")
        if plan.memory_after is None:
            parts.append("<p>No timeline in this stage's plan (it was not made by autockpt's planner).</p>")
        else:
            parts.append(no_plot or f"<figure>{_stage_timeline_svg(pplan, record, plan)}</figure>")
    parts.append("<h2>Schedule</h2>")
    parts.append(no_plot or f"<figure>{_schedule_svg(pplan, boxes)}</figure>")
    parts.append(f"<p>{e(_SCHEDULE_TEXT.format(schedule=_schedule_class(pplan), end=end, step=pplan.predicted_step_ms))}"
                 "</p>")
    parts.append(html_table(["stage", "order"], _order_rows(pplan)))
    if pplan.notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(note)}</li>" for note in pplan.notes) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _schedule_class(pplan: PipelineRecord) -> str:
    return "Schedule1F1B" if pplan.schedule is PipelineSchedule.ONE_F_ONE_B else "ScheduleGPipe"


def pipeline_report_markdown(pplan: PipelineRecord) -> str:
    """The report's tables in markdown (the timelines and the schedule chart are in the HTML report)."""
    lines = ["# autockpt pipeline plan", "", _UNITS_TEXT, ""]
    lines += md_table(["", ""], _headline(pplan))
    lines += ["", "## Stages", ""]
    lines += md_table(_STAGE_COLUMNS, _stage_rows(pplan))
    lines += ["", "## Shared parameters", ""]
    shared = _shared_rows(pplan)
    lines += ([f"Each is {_SHARED_TEXT}.", ""] + md_table(["parameter", "bytes", "stages"], shared) if shared
              else ["None: no parameter is read by more than one stage."])
    lines += ["", "## Memory per stage", "", _BAND_TEXT + " The timelines are plotted in the HTML report."]
    for record, plan in zip(pplan.stages, pplan.stage_plans):
        memory = stage_memory(record, plan)
        heading = f"### Stage {record.index}: units {record.first_unit}-{record.last_unit} ({', '.join(record.module_paths)})"
        lines += ["", heading, ""]
        lines.append(f"Budget {format_bytes(record.budget_bytes)}; {_peak_text(pplan, record, memory)}. "
                     f"Recomputed: {decisions_line(plan)}.")
        curve = plan.memory_after
        if curve is not None and curve.phases:
            event = max(range(len(curve.phases)), key=curve.total_bytes.__getitem__)
            lines += ["", f"At the one-microbatch peak (event {event}):", ""]
            lines += md_table(["category", "bytes"], [
                (f"one microbatch: {label}", format_bytes(getattr(curve, name)[event]))
                for name, label, _ in MEMORY_CATEGORIES
            ] + [
                (f"{_others(record)} in flight", format_bytes(memory.others_bytes)),
                ("schedule buffers", format_bytes(memory.buffer_bytes)),
                ("total", format_bytes(curve.total_bytes[event] + memory.others_bytes + memory.buffer_bytes)),
            ])
    end = max((box.end_ms for box in schedule_boxes(pplan)), default=0.0)
    lines += ["", "## Schedule", "", _SCHEDULE_TEXT.format(schedule=_schedule_class(pplan), end=end,
                                                           step=pplan.predicted_step_ms), ""]
    lines += md_table(["stage", "order"], _order_rows(pplan))
    if pplan.notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in pplan.notes]
    return "\n".join(lines) + "\n"
