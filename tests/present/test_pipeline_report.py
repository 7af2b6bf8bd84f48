"""The pipeline report (issue 22, item 5): one memory timeline per stage, the schedule's chart, the stage table; the
page is still written, and says why, without matplotlib."""

from __future__ import annotations

import dataclasses
import html
import itertools
import re
import sys
from pathlib import Path

import pytest
from pipeline_planners import CONFIG, shared_planner
from spawned_ranks import RANKS_GROUP

import autockpt
from autockpt.present.pipeline_report import schedule_boxes, schedule_order, stage_memory
from autockpt.record_types import SharedParameter
from autockpt.types import PipelineSchedule
from autockpt.units import format_bytes

_BUDGET = 1_500_000  # the smallest a split of this model keeps is about 1.33 MB: tight enough to draw the budget
MISSING = "No plots: matplotlib could not be imported"
# with the pipeline tests: their planner of the same model (``pipeline_planners``) captured once
pytestmark = RANKS_GROUP


@pytest.fixture(scope="module")
def pplan() -> autockpt.PipelinePlan:
    return shared_planner(CONFIG).plan(budget_bytes=_BUDGET)


@pytest.fixture(scope="module")
def html_report(pplan: autockpt.PipelinePlan, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The plan's HTML page, drawn once for the tests that read it."""
    path = tmp_path_factory.mktemp("pipeline_report") / "pipeline.html"
    pplan.report(path)
    return path.read_text()


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in test_report_dependency: None in sys.modules makes every `import matplotlib...` fail."""
    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError):
        import matplotlib.figure  # noqa: F401


def _sections(text: str, start: str, stop: str) -> dict[int, str]:
    """Each stage's section: from its heading to the next heading of the same or a higher level."""
    found = {}
    for match in re.finditer(start, text):
        end = text.find(stop, match.end())
        found[int(match.group(1))] = text[match.start():end if end >= 0 else len(text)]
    return found


def _html_stage_sections(text: str) -> dict[int, str]:
    return {k: html.unescape(v) for k, v in _sections(text, r"<h3 id='stage-(\d+)'>", "<h").items()}


def _check_stage_sections(pplan: autockpt.PipelinePlan, sections: dict[int, str]) -> None:
    assert sorted(sections) == list(range(pplan.num_stages))
    for record in pplan.stages:
        section = sections[record.index]
        assert f"units {record.first_unit}-{record.last_unit}" in section
        assert f"predicted peak {format_bytes(record.predicted_peak_bytes)}" in section
        assert f"Budget {format_bytes(record.budget_bytes)}" in section
        assert format_bytes(record.retained_bytes) in section and format_bytes(record.schedule_buffer_bytes) in section


def test_html_has_one_timeline_per_stage_and_the_schedule(pplan: autockpt.PipelinePlan, html_report: str) -> None:
    text = html_report
    assert MISSING not in text
    assert "GB = 10<sup>9</sup>" in text or "GB = 10^9" in text
    assert f"{pplan.predicted_step_ms:.2f} ms" in text and f"{pplan.link_gb_per_s:.2f} GB/s" in text
    sections = _html_stage_sections(text)
    _check_stage_sections(pplan, sections)
    for index, section in sections.items():
        assert section.count("<svg") == 1, f"stage {index} has no memory timeline of its own"
    schedule = text[text.index("<h2>Schedule</h2>"):]
    assert schedule.count("<svg") == 1
    assert text.count("<svg") == pplan.num_stages + 1
    assert text.count("</svg>") == pplan.num_stages + 1
    # the stage table: one row per stage with its peak, budget and time
    table = text[text.index("<h2>Stages</h2>"):text.index("<h2>Shared parameters</h2>")]
    for record in pplan.stages:
        row = f"<tr><td>{record.index}</td><td>{record.first_unit}-{record.last_unit}</td>"
        assert row in table
        assert f"<td>{record.predicted_microbatch_ms:.2f}</td>" in table
    assert "None: no parameter is read by more than one stage" in text
    # the order drawn is the schedule's: 1F1B, stage 0 of 2 keeps two forwards in flight
    assert "<td>0</td><td>F0 F1 B0 F2 B1 F3 B2 B3</td>" in schedule
    assert "<td>1</td><td>F0 B0 F1 B1 F2 B2 F3 B3</td>" in schedule


def test_peak_is_said_as_the_planner_forms_it(pplan: autockpt.PipelinePlan, html_report: str) -> None:
    sections = _html_stage_sections(html_report)
    for record, plan in zip(pplan.stages, pplan.stage_plans):
        memory = stage_memory(record, plan)
        assert plan.memory_after is not None and max(plan.memory_after.total_bytes) == plan.predicted_peak_bytes
        last = record.index == pplan.num_stages - 1
        # the stacked band reaches the predicted peak, except where the last stage's end of step is larger
        assert memory.stacked_bytes == record.predicted_peak_bytes or (last and memory.end_of_step_dominates)
        section = sections[record.index]
        assert ("the larger of the bytes at the end of the step" in section) == memory.end_of_step_dominates
        assert f"one microbatch's step under the stage plan {format_bytes(plan.predicted_peak_bytes)}" in section


def test_markdown_has_every_stage_and_no_plots(pplan: autockpt.PipelinePlan, tmp_path: Path) -> None:
    path = tmp_path / "pipeline.md"
    pplan.report(path)
    text = path.read_text()
    assert text.startswith("# autockpt pipeline plan")
    assert "<svg" not in text
    _check_stage_sections(pplan, _sections(text, r"### Stage (\d+):", "\n#"))
    assert "| 0 | F0 F1 B0 F2 B1 F3 B2 B3 |" in text


def test_shared_parameters_are_listed(pplan: autockpt.PipelinePlan, tmp_path: Path) -> None:
    tied = dataclasses.replace(
        pplan, shared_parameters=(SharedParameter(name="head.weight", stages=(0, 1), nbytes=131_072),)
    )
    path = tmp_path / "pipeline.md"
    tied.report(path)
    assert f"| head.weight | {format_bytes(131_072)} | 0, 1 |" in path.read_text()


def test_without_matplotlib_the_page_says_why(pplan: autockpt.PipelinePlan, tmp_path: Path, no_matplotlib: None) -> None:
    path = tmp_path / "pipeline.html"
    pplan.report(path)
    text = path.read_text()
    assert MISSING in text and "pip install matplotlib" in text
    assert "<svg" not in text
    assert text.count("Plot left out") == pplan.num_stages + 1
    _check_stage_sections(pplan, _html_stage_sections(text))


def test_schedule_order_keeps_the_schedules_microbatches_in_flight() -> None:
    assert schedule_order(PipelineSchedule.GPIPE, 1, 2, 3) == [(True, 0), (True, 1), (True, 2), (False, 0),
                                                                (False, 1), (False, 2)]
    for schedule in PipelineSchedule:
        for num_stages, microbatches in ((2, 4), (3, 5), (4, 4), (3, 8)):
            for stage in range(num_stages):
                order = schedule_order(schedule, stage, num_stages, microbatches)
                assert sorted(order) == sorted((f, i) for f in (True, False) for i in range(microbatches))
                held, most = 0, 0
                for forward, _ in order:
                    held += 1 if forward else -1
                    most = max(most, held)
                assert most == schedule.in_flight(stage, num_stages, microbatches), (schedule, stage, num_stages)


@pytest.mark.parametrize("schedule", list(PipelineSchedule))
def test_schedule_boxes_follow_the_dependencies(pplan: autockpt.PipelinePlan, schedule: PipelineSchedule) -> None:
    pplan = dataclasses.replace(pplan, schedule=schedule)  # the same stage times drawn under either schedule
    boxes = schedule_boxes(pplan)
    at = {(box.forward, box.stage, box.microbatch): box for box in boxes}
    assert len(at) == len(boxes) == 2 * pplan.num_stages * pplan.microbatches
    for record in pplan.stages:
        own = sorted((b for b in boxes if b.stage == record.index), key=lambda b: b.start_ms)
        assert all(a.end_ms <= b.start_ms + 1e-9 for a, b in itertools.pairwise(own))  # one thing at a time per stage
        for i in range(pplan.microbatches):
            forward, backward = at[(True, record.index, i)], at[(False, record.index, i)]
            width = (forward.end_ms - forward.start_ms) + (backward.end_ms - backward.start_ms)
            assert width == pytest.approx(record.predicted_microbatch_ms)
            assert backward.start_ms >= forward.end_ms
            if record.index > 0:
                assert forward.start_ms > at[(True, record.index - 1, i)].end_ms
            if record.index < pplan.num_stages - 1:
                assert backward.start_ms > at[(False, record.index + 1, i)].end_ms
