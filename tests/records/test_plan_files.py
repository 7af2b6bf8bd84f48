"""One codec for every plan file (issue 47, ``records/codec.py``): the files 0.2 wrote (``tests/data``, written at
f97202d by 0.2's two serialisers) load, save again as schema version 6 and read back equal; a file of one kind
given to another kind's loader names the right loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import assert_same_step, twin

import autockpt
from autockpt.errors import PlanFileError
from autockpt.present import zoo
from autockpt.records import codec
from autockpt.records.fsdp_plan import FSDPPlan

DATA = Path(__file__).parents[1] / "data"
FILES_OF_0_2 = {  # file: (loader, the version key and value 0.2 wrote)
    "plan_v5_transformer_tiny.json": (autockpt.load_plan, ("schema_version", 5)),
    "pipeline_plan_v5.json": (autockpt.load_pipeline_plan, ("schema_version", 5)),
    "fsdp_plan_v4.json": (autockpt.load_fsdp_plan, ("version", 4)),
}


@pytest.mark.parametrize("name", FILES_OF_0_2)
def test_a_plan_file_of_0_2_loads_and_saves_as_the_one_layout(name: str, tmp_path: Path) -> None:
    load, (key, version) = FILES_OF_0_2[name]
    assert json.loads((DATA / name).read_text())[key] == version
    loaded = load(DATA / name)
    loaded.save(tmp_path / "again.json")
    document = json.loads((tmp_path / "again.json").read_text())
    assert set(document) == {"schema", "schema_version", "plan"} and document["schema_version"] == codec.SCHEMA_VERSION
    assert load(tmp_path / "again.json") == loaded
    others = [other for other in FILES_OF_0_2 if other != name]
    for other in others:  # another kind's file names its own loader
        with pytest.raises(PlanFileError, match=f"{FILES_OF_0_2[other][0].__name__} reads it"):
            load(DATA / other)


def test_the_plan_of_0_2_applies_and_trains_like_the_model() -> None:
    case = zoo.build("transformer", "tiny")
    reference = twin(case)
    plan = autockpt.load_plan(DATA / "plan_v5_transformer_tiny.json")
    assert plan.regions and plan.provenance is not None
    module = autockpt.apply_plan(case.model, plan, example_inputs=case.args, example_kwargs=case.kwargs)
    assert_same_step(module, reference, case)


def test_an_fsdp_plan_of_0_2_keeps_its_digest_and_one_of_0_3_a_model_fingerprint() -> None:
    legacy = autockpt.load_fsdp_plan(DATA / "fsdp_plan_v4.json")
    assert isinstance(legacy, FSDPPlan) and legacy.fingerprint is None and len(legacy.parameter_digest) == 32
    assert legacy.ranks[0].breakdown[0] == ("Sharded Param", legacy.ranks[0].breakdown[0][1])
    assert sum(nbytes for _, nbytes in legacy.ranks[0].breakdown) == legacy.ranks[0].peak_bytes


def test_a_file_of_a_version_this_autockpt_does_not_read_is_refused(tmp_path: Path) -> None:
    document = json.loads((DATA / "pipeline_plan_v5.json").read_text())
    (tmp_path / "v3.json").write_text(json.dumps({**document, "schema_version": 3}))
    with pytest.raises(PlanFileError, match="reads a pipeline plan of versions 4, 5, 6"):
        autockpt.load_pipeline_plan(tmp_path / "v3.json")
    (tmp_path / "no_plan.json").write_text(json.dumps({"schema": "autockpt.fsdp_plan", "schema_version": 6}))
    with pytest.raises(PlanFileError, match='it has no "plan" field'):
        autockpt.load_fsdp_plan(tmp_path / "no_plan.json")
