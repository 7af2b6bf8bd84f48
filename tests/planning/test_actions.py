"""Decisions as actions (issue 20): the Action enum and its old names, the Policy and Placement types, a plan whose
regions have different actions (predicted to the byte and trained like PyTorch), and plan files of both versions."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from support import assert_same_step, budget_at, tiny, twin

import autockpt
from autockpt.core.simulate import simulate
from autockpt.measure.step import measure_step
from autockpt.present import zoo
from autockpt.records.summary import region_rows
from autockpt.types import Action, Placement, Policy, Region, RegionAction, Stage

V1_PLAN = Path(__file__).parents[1] / "data" / "plan_v1_transformer_tiny.json"  # written by the release before issue 20


def test_the_action_values_are_those_plan_files_and_the_cli_use() -> None:
    assert Action is autockpt.Action
    assert Action("torch_non_reentrant") is Action.RECOMPUTE_TORCH  # the values plan files and the CLI use
    assert list(Action) == [Action.RECOMPUTE_TORCH, Action.RECOMPUTE_OWN, Action.OFFLOAD]  # old names: aliases


def test_a_policy_refuses_overlapping_regions_and_a_placement_gaps() -> None:
    placement = Placement.single_device(10, "cpu")
    with pytest.raises(ValueError, match="disjoint"):
        Policy(
            region_actions=(RegionAction(region=Region(first_unit=0, last_unit=4), action=Action.RECOMPUTE_TORCH),
                            RegionAction(region=Region(first_unit=4, last_unit=6), action=Action.RECOMPUTE_OWN)),
            placement=placement,
        )
    with pytest.raises(ValueError, match="contiguous"):
        Placement(stages=(Stage(first_unit=0, last_unit=3, device="cpu"), Stage(first_unit=5, last_unit=9, device="cpu")))
    uniform = Policy.uniform([Region(first_unit=5, last_unit=6), Region(first_unit=0, last_unit=1)], Action.RECOMPUTE_OWN, placement)
    assert uniform.regions == (Region(first_unit=0, last_unit=1), Region(first_unit=5, last_unit=6))
    assert uniform.actions == (Action.RECOMPUTE_OWN, Action.RECOMPUTE_OWN)


@pytest.fixture(scope="module")
def transformer_planner() -> tuple[zoo.ZooCase, autockpt.Planner]:
    case = tiny("transformer")
    # both recompute kinds ("auto", not the tests' default): the plans here give regions either action
    return case, autockpt.Planner.from_model(case.model, example_inputs=case.args, example_kwargs=case.kwargs,
                                             loss_fn=case.loss_fn, checkpoint="auto")


def test_the_old_spelling_of_the_checkpoint_choice_still_plans_for_that_action() -> None:
    case = tiny("mlp")
    # checkpoint="auto", autockpt's default (the tests' default is torch's kind): the older spelling then decides
    old = autockpt.Planner.from_model(case.model, example_inputs=case.args, loss_fn=case.loss_fn, checkpoint="auto",
                                      solver_options=autockpt.SolverOptions(checkpoint="recompute_function"))
    new = autockpt.Planner.from_model(case.model, example_inputs=case.args, loss_fn=case.loss_fn, checkpoint=Action.RECOMPUTE_OWN)
    assert old.actions == new.actions == (Action.RECOMPUTE_OWN,)
    with pytest.raises(ValueError, match="checkpoint must be 'auto' or one of"):
        autockpt.Planner.from_model(case.model, example_inputs=case.args, loss_fn=case.loss_fn, checkpoint="offload_everything")


def test_regions_with_different_actions_are_predicted_and_train_like_pytorch(transformer_planner) -> None:
    case, planner = transformer_planner
    reference = twin(case)
    solved = planner.plan(budget_bytes=budget_at(planner, 0.35))
    assert len(solved.regions) >= 2
    mixed = tuple(
        RegionAction(region=region, action=(Action.RECOMPUTE_TORCH, Action.RECOMPUTE_OWN)[i % 2])
        for i, region in enumerate(solved.regions)
    )
    timeline = simulate(planner.trace, planner.costs, mixed)
    predicted = timeline.peak_bytes
    # each region is priced under its own action: the mixed plan and its mirror (every action swapped) add up to the
    # two uniform plans. (Not "between the uniform ones": that holds only when one action is cheaper in every region,
    # which measured CPU timings do not promise; it failed once in CI.)
    def overhead_ms(actions: list[RegionAction]) -> float:
        return simulate(planner.trace, planner.costs, actions).overhead_ms

    swap = {Action.RECOMPUTE_TORCH: Action.RECOMPUTE_OWN, Action.RECOMPUTE_OWN: Action.RECOMPUTE_TORCH}
    mirror = [dataclasses.replace(r, action=swap[r.action]) for r in mixed]
    uniform = [overhead_ms([dataclasses.replace(r, action=a) for r in mixed]) for a in swap]
    assert uniform[0] != uniform[1]
    assert timeline.overhead_ms + overhead_ms(mirror) == pytest.approx(sum(uniform), rel=1e-9)
    plan = dataclasses.replace(solved, policy=Policy(region_actions=mixed, placement=solved.policy.placement))
    module = planner.apply(plan)
    measured = measure_step(module, case.args, case.kwargs, case.loss_fn).peak_bytes
    # exact, or over by what a node allocates after torch's checkpoint let go of a recomputed copy (simulate.py: a
    # Linear's bias gradient, 256 B, where the regions the solver's ties give put the peak there; found 2026-11-29)
    assert 0 <= predicted - measured <= 0.001 * measured, (mixed, predicted, measured)
    assert_same_step(module, reference, case)
    assert [row.action for row in region_rows(plan)] == [a.action.value for a in mixed]


def test_a_plan_file_round_trips_with_its_policy(transformer_planner, tmp_path: Path) -> None:
    _, planner = transformer_planner
    plan = planner.plan(budget_bytes=budget_at(planner, 0.5))
    plan.save(tmp_path / "plan.json")
    document = json.loads((tmp_path / "plan.json").read_text())
    assert document["schema_version"] == 9  # 2: the policy; 3: value ranges; 4: the loop; 5: provenance; 6: one codec; 7: floor; 8: loss chunks; 9: a pipeline stage with its loss
    assert document["plan"]["policy"]["placement"]["stages"] == [
        {"first_unit": 0, "last_unit": len(planner.graph.units) - 1, "device": "cpu"}
    ]
    assert autockpt.load_plan(tmp_path / "plan.json") == plan


def test_a_version_1_plan_file_loads_as_a_policy_and_applies() -> None:
    v1 = json.loads(V1_PLAN.read_text())
    assert v1["schema_version"] == 1
    loaded = autockpt.load_plan(V1_PLAN)
    expected_regions = tuple(Region(**r) for r in v1["plan"]["regions"])
    assert loaded.regions == expected_regions and loaded.regions
    assert loaded.policy.actions == (Action.RECOMPUTE_OWN,) * len(expected_regions)
    assert loaded.planned_action is Action.RECOMPUTE_OWN
    assert loaded.region_overhead_ms == v1["plan"]["region_overhead_ms"]
    assert loaded.policy.placement.stages == (Stage(first_unit=0, last_unit=len(loaded.nodes) - 1, device=""),)
    case = zoo.build("transformer", "tiny")  # the model the file was recorded for: the size's 6 layers
    reference = twin(case)
    module = autockpt.apply_plan(case.model, loaded, example_inputs=case.args, example_kwargs=case.kwargs)
    assert_same_step(module, reference, case)
