"""Issue 36, items 4 and 5: a plan says which trace and timing made it and for which device (``Plan.provenance``), and
what its peak holds by category (``Plan.breakdown``, ``core/breakdown.py``), in the plan file, the summary and the
report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import needs_transformers

import autockpt
from autockpt.core.breakdown import logits_storages, memory_breakdown
from autockpt.present import zoo
from autockpt.types import OUTSIDE_GRAPH_UNIT
from autockpt.units import format_bytes

Planned = tuple[autockpt.Planner, autockpt.Plan]


@pytest.fixture(scope="module")
def gpt2_fake() -> Planned:
    """The tiny GPT-2 (its loss computed inside the model from labels), traced on fakes and timed for an H100, AdamW:
    a plan half way from its floor to its unmodified peak, of the program as captured (its events are the trace's)."""
    pytest.importorskip("transformers")
    case = zoo.build("gpt2", "tiny", blocks=1)  # one layer: the categories add up alike at any depth
    planner = autockpt.Planner.from_model(
        case.model, example_inputs=case.args, example_kwargs=case.kwargs, trace="fake", target="h100-sxm-80gb",
        optimizer=torch.optim.AdamW, loss_chunk_tokens=0,
    )
    probe = planner.plan(budget_bytes=10**15)
    return planner, planner.plan(budget_bytes=(probe.min_feasible_bytes + probe.baseline_peak_bytes) // 2)


@needs_transformers
def test_the_categories_add_up_to_the_peaks_and_static_ones_are_the_trace_s(gpt2_fake: Planned) -> None:
    planner, plan = gpt2_fake
    trace = planner.trace
    assert plan.regions and plan.breakdown is not None and plan.baseline_breakdown is not None
    assert plan.breakdown.total_bytes == plan.predicted_peak_bytes
    assert plan.baseline_breakdown.total_bytes == plan.baseline_peak_bytes
    for breakdown in (plan.breakdown, plan.baseline_breakdown):
        assert breakdown.parameter_bytes == trace.parameter_bytes
        assert breakdown.optimizer_state_bytes == trace.optimizer_state_bytes > 0
        assert breakdown.buffer_and_input_bytes == trace.buffer_bytes + trace.input_bytes
        assert breakdown.other_device_bytes == trace.foreign_bytes == 0
        assert breakdown.gradient_bytes == trace.gradient_bytes_by_event[breakdown.event]
        assert min(size for _, size in breakdown.rows()) >= 0
    # the plan frees activations, nothing else: the same logits, fewer activations than the unmodified step holds
    assert plan.breakdown.activation_bytes < plan.baseline_breakdown.activation_bytes
    assert plan.breakdown.logits_bytes == plan.baseline_breakdown.logits_bytes > 0
    # the curve at any other event adds up too
    assert memory_breakdown(trace, plan.memory_after, 3).total_bytes == plan.memory_after.total_bytes[3]


@needs_transformers
def test_the_floor_s_peak_is_broken_down_and_the_summary_says_where_it_is(gpt2_fake: Planned) -> None:
    """Issue 48, item 7: the plan records what its floor's plan holds at its peak (``Plan.floor_breakdown``, adding
    up to ``min_feasible_bytes``) and where in the step that is; the summary names it with its largest categories."""
    planner, plan = gpt2_fake
    floor = plan.floor_breakdown
    assert floor is not None and plan.floor_complete
    assert floor.total_bytes == plan.min_feasible_bytes < plan.breakdown.total_bytes
    assert floor.moment and plan.breakdown.moment and plan.baseline_breakdown.moment
    event = planner.trace.events[floor.event]
    if event.unit >= 0:  # a unit's forward or backward: named by its module and op
        unit = planner.graph.units[event.unit]
        assert floor.moment == f"{event.phase.value} of {unit.module_path or 'the model'} ({unit.op})"
    line = next(line for line in plan.summary().splitlines() if "the floor is set at" in line)
    largest = max(floor.rows(), key=lambda row: row[1])
    assert floor.moment in line and f"{largest[0]} {format_bytes(largest[1])}" in line
    # the floor's plan is one the planner itself finds at that budget
    assert planner.plan(budget_bytes=plan.min_feasible_bytes).predicted_peak_bytes <= plan.min_feasible_bytes


@needs_transformers
def test_the_logits_are_the_output_and_what_the_loss_makes_of_it(gpt2_fake: Planned) -> None:
    planner, _ = gpt2_fake
    units = planner.graph.units
    found = logits_storages(planner.trace)
    made_by = {units[s.producer_unit].module_path for s in found}
    # the lm_head's output (the logits, returned) and the cross entropy the model computes from labels
    assert "lm_head" in made_by
    assert any("cross_entropy" in units[s.producer_unit].op for s in found)
    vocab, (batch, seq) = planner.model.config.vocab_size, planner.request.args[0].shape
    assert max(s.nbytes for s in found) == batch * seq * vocab * 4  # float32 logits


def test_a_loss_outside_the_model_counts_as_logits() -> None:
    # 2 layers, not 6: where the logits are counted does not depend on them
    case = zoo.build("transformer", "tiny", blocks=2)
    planner = autockpt.Planner.from_model(case.model, example_inputs=case.args, loss_fn=case.loss_fn, trace="fake")
    plan = planner.plan_for_regions((), strategy="given")  # the unmodified step's figures: no program solved
    found = logits_storages(planner.trace)
    assert any(s.producer_unit == OUTSIDE_GRAPH_UNIT for s in found)  # the loss function's cross entropy
    assert all(s.producer_unit >= 0 or planner.trace.events[s.alloc_event].unit == OUTSIDE_GRAPH_UNIT for s in found)
    assert plan.breakdown.total_bytes == plan.predicted_peak_bytes == plan.baseline_breakdown.total_bytes
    assert plan.breakdown.optimizer_state_bytes == 0 and plan.provenance.trace == "fake"


@needs_transformers
def test_summary_report_and_plan_file_say_the_provenance_and_the_categories(gpt2_fake: Planned, tmp_path: Path) -> None:
    _, plan = gpt2_fake
    provenance = plan.provenance
    assert (provenance.trace, provenance.timing, provenance.device) == ("fake", "roofline", "h100-sxm-80gb")
    assert provenance.device_memory_bytes == 80 * 10**9
    summary = plan.summary()
    made = "made from              fake trace, roofline timing, for h100-sxm-80gb with 80.000 GB (74.506 GiB)"
    assert made in summary
    for name, size in plan.breakdown.rows():
        if size:
            assert f"{name:<21}{format_bytes(size)}" in summary
    assert f"total (the peak)     {format_bytes(plan.predicted_peak_bytes)}" in summary
    plan.save(tmp_path / "plan.json")
    assert autockpt.load_plan(tmp_path / "plan.json") == plan
    plan.report(tmp_path / "r.md")
    markdown = (tmp_path / "r.md").read_text()
    assert provenance.describe() in markdown and "## At the peak, by category" in markdown
    assert f"| logits and loss | {format_bytes(plan.breakdown.logits_bytes)} |" in markdown
    plan.report(tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "At the peak, by category" in page and "made from (trace, timing, device)" in page


@needs_transformers
def test_a_plan_file_of_version_4_loads_without_provenance_or_breakdown(gpt2_fake: Planned, tmp_path: Path) -> None:
    _, plan = gpt2_fake
    plan.save(tmp_path / "plan.json")
    document = json.loads((tmp_path / "plan.json").read_text())
    assert document["schema_version"] == 9
    document["schema_version"] = 4
    for name in ("provenance", "breakdown", "baseline_breakdown"):
        del document["plan"][name]
    (tmp_path / "v4.json").write_text(json.dumps(document))
    old = autockpt.load_plan(tmp_path / "v4.json")
    assert old.provenance is None and old.breakdown is None and old.regions == plan.regions
    summary = old.summary()
    assert "made from" not in summary and "by category" not in summary
    old.report(tmp_path / "old.md")
    assert "## At the predicted peak" in (tmp_path / "old.md").read_text()
