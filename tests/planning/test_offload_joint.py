"""The solver chooses keep, recompute or offload per region under a host pool (issue 21, CPU): the pool lowers the
floor, optimize keeps the budget as measured (MemTracker minus the pool's host buffer) with training equal to
PyTorch's, the pool is never exceeded, and a budget only a pool can reach says which pool would do."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support import assert_same_step, budget_at, tiny, twin
from support import mlp as seeded_mlp

import autockpt
from autockpt.core.simulate import simulate
from autockpt.planning.policy import assemble_plan
from autockpt.present import zoo
from autockpt.present.workload import UserInputError, parse_host_pool
from autockpt.types import Action, Decision, RegionAction

SLACK_BYTES = 1024  # as tests/runtime/test_offload_plans.py: exact on the conv net, 512 bytes high on the MLP


def pool_planner(case: zoo.ZooCase, host_pool_gb: float | str = 1.0, checkpoint: str | Action = Action.RECOMPUTE_TORCH
                 ) -> autockpt.Planner:
    """Offload beside one recompute kind (torch's, the tests' default) unless ``checkpoint`` says "auto": both kinds."""
    return autockpt.Planner.from_model(
        case.model, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn,
        host_pool_gb=host_pool_gb, checkpoint=checkpoint,
    )


@dataclasses.dataclass
class PoolCase:
    """The MLP planned with a 1 GB pool (one capture and trace for the tests here), its two floors, and a budget
    between them: below what recomputing alone reaches, above what the pool reaches."""

    case: zoo.ZooCase
    reference: torch.nn.Module
    planner: autockpt.Planner
    with_pool: int
    recompute_only: int

    @property
    def between(self) -> int:
        return (self.with_pool + self.recompute_only) // 2


def eight_layer_mlp() -> zoo.ZooCase:
    """The zoo's tiny MLP with 8 layers, not 16 (issue 46: its joint programs solve in a fifth of the time; at 16
    a pool of half the plan's was left unused, so the capacity test below did not limit one)."""
    return zoo.ZooCase(name="mlp", model=seeded_mlp(8, classes=10), args=(torch.randn(256, 128),))


@pytest.fixture(scope="module")
def mlp() -> PoolCase:
    case = eight_layer_mlp()
    reference = twin(case)
    planner = pool_planner(case)
    with_pool = planner.plan(budget_bytes=10**15).min_feasible_bytes
    planner.host_pool_bytes = 0
    recompute_only = planner.plan(budget_bytes=10**15).min_feasible_bytes
    planner.host_pool_bytes = 10**9
    return PoolCase(case, reference, planner, with_pool, recompute_only)


@pytest.fixture
def pooled(mlp: PoolCase) -> Iterator[PoolCase]:
    """The MLP's planner with its 1 GB pool back after the test (tests change ``Planner.host_pool_bytes``)."""
    yield mlp
    mlp.planner.host_pool_bytes = 10**9


def test_a_pool_reaches_below_the_recompute_floor_and_keeps_the_budget(pooled: PoolCase) -> None:
    case, planner, budget = pooled.case, pooled.planner, pooled.between
    assert pooled.with_pool < pooled.recompute_only
    module = planner.optimize(budget_bytes=budget)
    plan = autockpt.get_plan(module)
    assert Action.OFFLOAD in plan.policy.actions
    assert Decision.OFFLOAD in {n.decision for n in plan.nodes}
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= budget
    assert abs(plan.measured_peak_bytes - plan.predicted_peak_bytes) <= SLACK_BYTES
    assert 0 < plan.host_pool_bytes <= planner.host_pool_bytes
    assert module.host_pool_bytes == plan.host_pool_bytes
    assert_same_step(module, pooled.reference, case)  # one more step on the same pool
    stats = module.pool_stats()
    assert stats is not None and stats.allocations == 1 and stats.steps >= 2
    assert stats.peak_occupancy_bytes == plan.host_pool_bytes


def test_without_a_pool_the_error_names_the_pool_that_makes_the_budget_feasible(pooled: PoolCase) -> None:
    planner, budget = pooled.planner, pooled.between
    planner.host_pool_bytes = 0
    with pytest.raises(autockpt.InfeasibleBudgetError, match="host_pool_gb=") as caught:
        planner.plan(budget_bytes=budget)
    needed = caught.value.host_pool_bytes_needed
    assert needed is not None and needed > 0
    planner.host_pool_bytes = needed
    plan = planner.plan(budget_bytes=budget)
    assert plan.predicted_peak_bytes <= budget and plan.host_pool_bytes <= needed


def test_the_pool_never_makes_a_plan_worse_and_its_capacity_holds(pooled: PoolCase) -> None:
    planner = pooled.planner
    budget = budget_at(planner, 0.4)
    with_pool = planner.plan(budget_bytes=budget)
    planner.host_pool_bytes = 0
    recompute_only = planner.plan(budget_bytes=budget)
    planner.host_pool_bytes = 10**9
    assert with_pool.predicted_peak_bytes <= budget
    assert with_pool.predicted_overhead <= recompute_only.predicted_overhead + 1e-12
    # the capacity, where the pool must be used whatever the times say (under what recomputing alone reaches;
    # at the budget above, whether it is used is a comparison of measured times: a half-size pool was left unused
    # in one full-suite run, 2026-11-28): limited to half of what the plan used, a plan uses some and no more, or
    # the refusal says the budget needs a larger pool
    unlimited = planner.plan(budget_bytes=pooled.between)
    assert unlimited.host_pool_bytes > 0
    half = unlimited.host_pool_bytes // 2
    planner.host_pool_bytes = half
    try:
        limited = planner.plan(budget_bytes=pooled.between)
    except autockpt.InfeasibleBudgetError as refused:
        assert "host_pool" in str(refused), str(refused)
    else:
        assert 0 < limited.host_pool_bytes <= half and limited.predicted_peak_bytes <= pooled.between


def test_both_checkpoints_and_offload_in_one_plan_run_as_predicted(pooled: PoolCase) -> None:
    """Under "auto" the joint program may give each region its own recompute action; a plan with torch's checkpoint,
    autockpt's and offload side by side keeps outputs and gradients, and is measured as simulated. (The actions are
    dealt to a solved plan's regions in turn: which the solver picks depends on measured times.)"""
    case = pooled.case
    planner = pool_planner(case, checkpoint="auto")  # both kinds: the trace prices autockpt's own too
    assert set(planner.actions) == {Action.RECOMPUTE_TORCH, Action.RECOMPUTE_OWN}
    regions = planner.plan(budget_bytes=budget_at(planner, 0.4)).regions
    assert len(regions) >= 3
    actions = (Action.RECOMPUTE_TORCH, Action.RECOMPUTE_OWN, Action.OFFLOAD)
    mixed = [RegionAction(region=r, action=actions[i % 3]) for i, r in enumerate(regions)]
    timeline = simulate(planner.trace, planner.costs, mixed)
    plan = assemble_plan(planner.context, mixed, Action.RECOMPUTE_TORCH, timeline.peak_bytes, timeline)
    assert set(plan.policy.actions) == set(actions)
    module = planner.apply(plan)
    measured = planner.measured_peak_bytes(module)
    assert abs(measured - plan.predicted_peak_bytes) <= SLACK_BYTES
    assert_same_step(module, pooled.reference, case)


def test_the_plan_shows_the_pool_and_applies_from_a_file(pooled: PoolCase, tmp_path: Path) -> None:
    case = pooled.case
    plan = pooled.planner.plan(budget_bytes=pooled.between)
    occupancy = plan.memory_after.host_pool_bytes
    assert occupancy[-1] == plan.host_pool_bytes and list(occupancy) == sorted(occupancy)
    assert "host pool" in plan.summary() and "offload" in plan.summary()
    plan.report(tmp_path / "plan.md")
    assert "host pool occupancy" in (tmp_path / "plan.md").read_text()
    plan.save(tmp_path / "plan.json")
    loaded = autockpt.load_plan(tmp_path / "plan.json")
    assert loaded.policy == plan.policy and loaded.host_pool_bytes == plan.host_pool_bytes
    module = autockpt.apply_plan(case.model, loaded, example_inputs=case.args, example_kwargs=case.kwargs)
    assert module.host_pool_bytes == plan.host_pool_bytes
    assert_same_step(module, pooled.reference, case)


def test_host_pool_arguments_are_checked() -> None:
    case = tiny("mlp")
    for wrong in (-1, "lots", True, float("nan")):
        with pytest.raises(ValueError, match="host_pool_gb"):
            pool_planner(case, wrong)  # type: ignore[arg-type]
    assert pool_planner(case, "auto").host_pool_bytes > 0
    with pytest.raises(ValueError, match="graph capture"):
        pool_planner(tiny("control_flow"))  # module-level capture: offloading cannot run there


def test_the_cli_reads_the_host_pool() -> None:
    assert parse_host_pool("auto") == "auto" and parse_host_pool("0") == 0
    assert parse_host_pool("16GB") == 16.0 and parse_host_pool("1GiB") == 2**30 / 1e9
    with pytest.raises(UserInputError, match="--host-pool"):
        parse_host_pool("plenty")


def test_plans_of_both_actions_keep_one_record_per_region(pooled: PoolCase) -> None:
    """A mixed plan's nodes say each region's own action, and its prices cover every action it uses."""
    plan = pooled.planner.plan(budget_bytes=pooled.between)
    for node in plan.nodes:
        if node.region is not None:
            assert node.action is plan.policy.actions[node.region]
    assert {p.action for p in plan.prices} == {plan.planned_action, *plan.policy.actions}
