"""Saved plans apply from what they record (issue 23, item 5): without example inputs they are rebuilt from the plan's
input specs (integers in the recorded range), and given inputs apply positionally or by keyword."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from support import assert_same_step, needs_transformers, tiny, twin

import autockpt
from autockpt.present import zoo
from autockpt.record_types import ModelFingerprint, TensorSpec
from autockpt.records.plan_inputs import recorded_inputs

Planned = tuple[zoo.ZooCase, autockpt.Plan]  # a zoo case and a plan made for it


@pytest.fixture(scope="module")
def keyword_plan() -> Planned:
    """GPT-2 planned with its token ids by keyword, as the CLI's ``--input input_ids=...`` passes them; the loss in
    chunks of 32 tokens, the chunk the default picks here: the tests below are where a chunked plan goes through a
    file and ``apply_plan`` and trains like PyTorch (tests/planning/test_loss_chunks.py measures such a plan's peak).
    Fixed, not weighed: the default also traces and solves the loss as captured and its other chunks (1 s)."""
    case = tiny("gpt2")
    ids = case.args[0]
    case = dataclasses.replace(case, args=(), kwargs={"input_ids": ids, "labels": ids})
    planner = autockpt.Planner.from_model(case.model, example_kwargs=case.kwargs, loss_chunk_tokens=32)
    the_plan = planner.plan(budget_bytes=_half_way(planner))
    assert the_plan.regions and the_plan.loss_chunk_tokens == 32
    return case, the_plan


@pytest.fixture(scope="module")
def positional_plan() -> Planned:
    """The MLP planned with its (floating) input positionally."""
    case = tiny("mlp")
    planner = autockpt.Planner.from_model(case.model, example_inputs=case.args)
    the_plan = planner.plan(budget_bytes=_half_way(planner))
    assert the_plan.regions
    return case, the_plan


@needs_transformers
def test_a_loaded_plan_applies_without_inputs_and_trains_like_pytorch(keyword_plan: Planned, tmp_path: Path) -> None:
    case, the_plan = keyword_plan
    document = _saved(the_plan, tmp_path / "plan.json")
    assert document["schema_version"] == 9
    ids = case.kwargs["input_ids"]
    recorded = [int(ids.min()), int(ids.max())]
    assert {s["name"]: s["value_range"] for s in document["plan"]["fingerprint"]["inputs"]} == {
        "kwargs['input_ids']": recorded, "kwargs['labels']": recorded,
    }
    assert all(s["value_range"] is None for s in document["plan"]["fingerprint"]["parameters"])
    loaded = autockpt.load_plan(tmp_path / "plan.json")
    assert loaded == the_plan

    rng = torch.get_rng_state()
    args, kwargs = recorded_inputs(case.model, loaded)
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's random stream is left as it was
    assert args == () and list(kwargs) == ["input_ids", "labels"]
    for rebuilt in kwargs.values():
        assert rebuilt.shape == ids.shape and rebuilt.dtype == ids.dtype
        assert recorded[0] <= int(rebuilt.min()) and int(rebuilt.max()) <= recorded[1]

    reference = twin(case)
    # onto a copy of the model (as on another machine; the module capture's fresh model: test_saved_plans_and_reports)
    module = autockpt.apply_plan(twin(case), loaded, strict=True)  # strict: a step off the plan raises
    assert autockpt.get_plan(module).regions == the_plan.regions
    assert_same_step(module, reference, case)  # real inputs of the recorded shape, run under the plan


def test_floating_inputs_are_rebuilt_and_a_positional_plan_applies_by_keyword(positional_plan: Planned) -> None:
    case, the_plan = positional_plan
    (x,) = case.args
    assert the_plan.fingerprint.inputs == (TensorSpec(name="args[0]", shape=tuple(x.shape), dtype="torch.float32"),)
    reference = twin(case)
    module = autockpt.apply_plan(case.model, the_plan, strict=True)
    assert_same_step(module, reference, case)
    # nn.Sequential.forward(input): the same tensor by keyword
    module = autockpt.apply_plan(case.model, the_plan, example_kwargs={"input": x}, strict=True)
    assert autockpt.get_plan(module).regions == the_plan.regions
    assert_same_step(module, reference, case)


@needs_transformers
def test_a_keyword_plan_applies_with_the_tensor_given_positionally(keyword_plan: Planned) -> None:
    case, the_plan = keyword_plan
    ids = case.kwargs["input_ids"]
    other_ids = torch.randint(0, 5, ids.shape)  # other values than the plan's range: the range need not match
    module = autockpt.apply_plan(case.model, the_plan, example_inputs=(other_ids,), example_kwargs={"labels": ids},
                                 strict=True)
    assert autockpt.get_plan(module).regions == the_plan.regions
    assert_same_step(module, twin(case), case)


@needs_transformers
def test_a_plan_file_without_ranges_asks_for_example_inputs(keyword_plan: Planned, tmp_path: Path) -> None:
    case, the_plan = keyword_plan
    document = _saved(the_plan, tmp_path / "plan.json")
    document["schema_version"] = 2
    fingerprint = document["plan"]["fingerprint"]
    for spec in fingerprint["inputs"] + fingerprint["parameters"]:
        del spec["value_range"]
    (tmp_path / "v2.json").write_text(json.dumps(document))
    loaded = autockpt.load_plan(tmp_path / "v2.json")
    assert all(spec.value_range is None for spec in loaded.fingerprint.inputs)
    with pytest.raises(ValueError, match=(
        r"(?s)kwargs\['input_ids'\] \(int64\[2, 64\]\): the plan records no range.*"
        r"kwargs\['labels'\].*autockpt.apply_plan\(model, plan, example_inputs="
    )):
        autockpt.apply_plan(case.model, loaded)


def test_values_that_do_not_read_back_are_named() -> None:
    specs = (
        TensorSpec(name="args[0]", shape=(2, 3), dtype="torch.bfloat16"),
        TensorSpec(name="args[1][0]", shape=(4,), dtype="torch.bool", value_range=(1, 1)),
        TensorSpec(name="args[1][1]", shape=(), dtype="python", value="None"),
        TensorSpec(name="kwargs['reduction']", shape=(), dtype="python", value="'mean'"),
        TensorSpec(name="kwargs['scale']", shape=(), dtype="python", value="0.5"),
    )
    fingerprint = ModelFingerprint(model_class="M", graph_digest="", num_units=0, parameters=(), inputs=specs)
    the_plan = _Recorded(fingerprint)
    args, kwargs = recorded_inputs(torch.nn.Linear(2, 2), the_plan)
    assert args[0].shape == (2, 3) and args[0].dtype == torch.bfloat16
    assert torch.equal(args[1][0], torch.ones(4, dtype=torch.bool)) and args[1][1] is None
    assert kwargs == {"reduction": "mean", "scale": 0.5}

    unreadable = TensorSpec(name="kwargs['cache']", shape=(), dtype="python", value="<Cache object at 0x7f>")
    the_plan = _Recorded(dataclasses.replace(fingerprint, inputs=(*specs, unreadable)))
    with pytest.raises(ValueError, match=r"kwargs\['cache'\] \(value <Cache object at 0x7f>\): its recorded repr is "
                                         r"not a Python literal(?s:.*)example_kwargs="):
        recorded_inputs(torch.nn.Linear(2, 2), the_plan)


@needs_transformers
def test_a_tensor_of_another_shape_is_still_refused(keyword_plan: Planned) -> None:
    case, the_plan = keyword_plan
    ids = case.kwargs["input_ids"][:1]
    # given positionally and compared by the plan's name for it
    with pytest.raises(autockpt.PlanMismatchError,
                       match=r"input kwargs\['input_ids'\]: plan int64\[2, 64\], given int64\[1, 64\]"):
        autockpt.apply_plan(case.model, the_plan, example_inputs=(ids,), example_kwargs={"labels": ids})


def _saved(the_plan: autockpt.Plan, path: Path) -> dict:
    """Save the plan and read the file back as JSON."""
    the_plan.save(path)
    return json.loads(path.read_text())


def _half_way(planner: autockpt.Planner) -> int:
    """A budget half-way from static bytes to the measured peak (read off the trace: a probe plan at no budget
    searches the floor too, seconds on the MLP)."""
    trace = planner.trace
    return trace.static_bytes + (trace.baseline_peak_bytes - trace.static_bytes) // 2


@dataclasses.dataclass(frozen=True)
class _Recorded:
    """What recorded_inputs reads of a plan."""

    fingerprint: ModelFingerprint
