"""Candidate regions (``autockpt.core.solve.candidates``), what every solver chooses among: none whose input a later op
writes in place, and the hazard that rule avoids is real."""

from __future__ import annotations

import pytest
import torch
from edge_models import WritesIntoAnEarlierTensor
from support import rewritten, with_regions

import autockpt
from autockpt.core.solve.candidates import candidate_regions
from autockpt.measure.capture import capture
from autockpt.measure.trace import trace_step
from autockpt.types import Region


def test_candidates_exclude_regions_whose_input_is_written_later() -> None:
    torch.manual_seed(0)
    model, x = WritesIntoAnEarlierTensor(depth=2), torch.randn(64, 128)
    measured = trace_step(capture(model, (x,), {}), (x,), {}, lambda out: out.sum())
    _, candidates = candidate_regions(capture(model, (x,), {}), measured)
    written = [s for s in measured.storages if any(m > s.producer_unit for m in s.mutator_units)]
    assert written
    for storage in written:
        for region in candidates:
            reads = any(region.first_unit <= u <= region.last_unit for u in storage.user_units)
            if storage.producer_unit < region.first_unit and reads:
                assert not any(m > region.last_unit for m in storage.mutator_units), region

    # the hazard is real: checkpointing the first reader of such a tensor breaks backward
    storage = written[0]
    reader = min(u for u in storage.user_units if u > storage.producer_unit and u not in storage.mutator_units)
    plan = autockpt.plan(model, budget_bytes=10**15, example_inputs=(x,))
    module = rewritten(with_regions(plan, (Region(first_unit=reader, last_unit=reader),)), model, (x,))
    with pytest.raises(RuntimeError, match="inplace"):
        module(x).sum().backward()
