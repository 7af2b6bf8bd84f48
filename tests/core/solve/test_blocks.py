"""Structure-aware solving: repeated blocks found from the graph, the block program and its chain solver."""

from __future__ import annotations

import itertools

import pulp
import pytest
from support import assert_same_step, needs_transformers, twin, with_times_from_flops

import autockpt
from autockpt.core.solve.base import Scorer, SolverOptions
from autockpt.core.solve.baselines import baseline_seed_plans
from autockpt.core.solve.block_chain import solve_block_chain
from autockpt.core.solve.blocks import build_block_program, prepare_blocks
from autockpt.core.solve.candidates import candidate_regions
from autockpt.core.solve.default import solve_prepared
from autockpt.core.solve.prepare import prepare
from autockpt.core.structure import find_repeated_blocks
from autockpt.present import zoo
from autockpt.types import Action, ActionPrice, CostModel

pytestmark = needs_transformers  # the repeated blocks here are Hugging Face layers

FRACTIONS = (0.3, 0.5, 0.7)


@pytest.fixture(scope="module")
def gpt2_case() -> zoo.ZooCase:
    return zoo.build("gpt2")  # 4 layers


@pytest.fixture(scope="module")
def gpt2_planner(gpt2_case: zoo.ZooCase) -> autockpt.Planner:
    # the loss as captured (``loss_chunk_tokens=0``): the default's trace, but a plan does not also trace and solve
    # the loss's chunked programs (0.9 s); chunked plans are tests/planning/test_loss_chunks.py's, and a chunked GPT-2
    # plan applied from a file tests/records/test_saved_plans_from_specs.py's
    case = gpt2_case
    return autockpt.Planner.from_model(
        case.model, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn, loss_chunk_tokens=0
    )


def _budget(planner: autockpt.Planner, fraction: float) -> int:
    profile = planner.trace
    return int(profile.static_bytes + fraction * (profile.baseline_peak_bytes - profile.static_bytes))


def test_the_layers_of_a_transformer_are_found_as_one_family(gpt2_planner: autockpt.Planner) -> None:
    structure = find_repeated_blocks(gpt2_planner.graph, gpt2_planner.trace)
    layers = gpt2_planner.model.config.n_layer
    family = max(structure.families, key=lambda f: f.block_units * len(f.instances))
    assert len(family.instances) == layers
    # consecutive, equally long, and each instance runs the same ops
    units = gpt2_planner.graph.units
    first = family.instances[0]
    for instance in family.instances[1:]:
        assert instance.last_unit - instance.first_unit == first.last_unit - first.first_unit
        assert [units[u].op for u in range(instance.first_unit, instance.last_unit + 1)] == [
            units[u].op for u in range(first.first_unit, first.last_unit + 1)
        ]
    assert all(a.last_unit + 1 == b.first_unit for a, b in zip(family.instances, family.instances[1:]))
    # the cut between layers is where the fewest bytes cross: no activation of a layer is read by the next
    # except through the residual stream, so the first unit of a layer reads nothing made inside the layer before
    profile = gpt2_planner.trace
    for a, b in zip(family.instances, family.instances[1:]):
        crossing = [s for s in profile.storages if a.first_unit <= s.producer_unit <= a.last_unit and any(u > a.last_unit for u in s.user_units)]
        assert len({s.producer_unit for s in crossing}) <= 2, crossing


def test_layers_of_different_widths_are_not_a_family() -> None:
    import torch
    from torch import nn

    widths = [24, 40, 56, 72, 88, 104]
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.GELU(), nn.Linear(b, b), nn.LayerNorm(b)]
    model = nn.Sequential(*layers)
    planner = autockpt.Planner.from_model(model, example_inputs=(torch.randn(8, widths[0]),))
    assert find_repeated_blocks(planner.graph, planner.trace).families == ()
    # the same layers repeated at one width are (the first may differ: its input is not made in forward)
    same = nn.Sequential(*[m for _ in range(5) for m in (nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32))])
    planner = autockpt.Planner.from_model(same, example_inputs=(torch.randn(8, 32),))
    families = find_repeated_blocks(planner.graph, planner.trace).families
    assert len(families) == 1 and len(families[0].instances) >= 4 and families[0].block_units == 4


def test_the_chain_solver_matches_the_block_milp(gpt2_planner: autockpt.Planner) -> None:
    """Two solvers of one outer problem: the dynamic program (rounding gains down) and HiGHS/CBC on the MILP."""
    profile = gpt2_planner.trace
    scorer = Scorer(profile, gpt2_planner.costs, Action.RECOMPUTE_TORCH)  # the machinery priced as in planning
    _segments, candidates = candidate_regions(gpt2_planner.graph, profile)
    structure = find_repeated_blocks(gpt2_planner.graph, profile)
    problem = prepare_blocks(scorer, structure, candidates, scorer.simulate(()))
    assert problem is not None
    for fraction in FRACTIONS:
        budget = _budget(gpt2_planner, fraction)
        chain = solve_block_chain(problem, budget)
        prob, chosen = build_block_program(problem, budget)
        prob.solve(pulp.PULP_CBC_CMD(msg=False, gapRel=0))
        if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            assert chain is None
            continue
        assert chain is not None and chain is not NotImplemented
        milp_ms, chain_ms = scorer.simulate(chosen()).overhead_ms, scorer.simulate(chain).overhead_ms
        # the outer problem prices a plan as the simulator does (recompute + each region's fixed cost): the menus
        # once left the fixed cost out, so tied plans with different region counts simulated up to 9 % apart
        assert pulp.value(prob.objective) == pytest.approx(milp_ms, rel=1e-3)
        # the chain rounds retained gains down (pessimistic by < instances / STATES of the range): it may pay a
        # little more, never less than the proven optimum by more than rounding
        assert 0.99 * milp_ms <= chain_ms <= 1.01 * milp_ms + 1e-6, (fraction, milp_ms, chain_ms)


def test_block_plans_fit_and_cost_about_what_the_flat_program_costs() -> None:
    """On ViT's encoder layers. GPT-2's block plans against its flat program's are ``bench_scale.py``'s figures (6 to
    48 layers, ``recompute_vs_flat``), and its block plans are run end to end below: here its flat programs took 8 of
    the suite's seconds (issue 46). The size's 4 layers (``support.tiny`` gives 2): the budgets are fractions of the
    way to the floor, where a block program of 2 layers has little to choose."""
    case = zoo.build("vit", "tiny")
    planner = autockpt.Planner.from_model(
        case.model, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn)
    # the checkpoint machinery counts on both sides (the block menus once left the fixed cost per region out: block
    # plans came out 9-18 % above the flat program's on these tiny models, where a region's fixed cost is ~1.5 % of
    # the step). Times and prices injected, not measured (issue 46: on a loaded machine the measured ones put the
    # ViT's block plan 18 % above the flat one): each unit's from its FLOPs and output bytes (``with_times_from_flops``),
    # and the machinery at what calibration measures here unloaded
    profile = with_times_from_flops(planner.trace)
    costs = CostModel(device="cpu", prices=(ActionPrice(action=Action.RECOMPUTE_TORCH, region_ms=0.7,
                                                        saved_tensor_ms=0.07),))
    segments, candidates = candidate_regions(planner.graph, profile)
    seeds = baseline_seed_plans(planner.graph, profile)
    structure = find_repeated_blocks(planner.graph, profile)
    by_blocks = prepare(profile, costs, Action.RECOMPUTE_TORCH, segments, candidates, seeds, structure)
    flat = prepare(profile, costs, Action.RECOMPUTE_TORCH, segments, candidates, seeds)
    assert by_blocks.blocks is not None
    options = SolverOptions(solver="highs" if pulp.HiGHS(msg=False).available() else "cbc")
    # near the floor, where the block program's constraint (whole blocks across block boundaries) binds most; near
    # the peak a block program has little to choose (issue 46: its flat program was a second of the suite)
    budget = _budget(planner, FRACTIONS[0])
    blocks_result, flat_result = solve_prepared(by_blocks, budget, options), solve_prepared(flat, budget, options)
    assert blocks_result.timeline.peak_bytes <= budget
    assert blocks_result.min_feasible_bytes <= flat_result.min_feasible_bytes
    # the block program cannot cross block boundaries except with whole blocks; measured on the zoo and GPT-2 up to
    # 48 layers it stays within 2 % of the flat program (often below it)
    assert blocks_result.timeline.overhead_ms <= 1.05 * flat_result.timeline.overhead_ms


def test_an_optimized_model_solved_by_blocks_keeps_its_budget_and_trains_like_the_original(
    gpt2_case: zoo.ZooCase, gpt2_planner: autockpt.Planner
) -> None:
    case, planner = gpt2_case, gpt2_planner  # the module's planner: no capture and trace of a model of its own
    reference = twin(case)  # a copy: the step below leaves gradients on the planner's model
    budget = _budget(planner, 0.4)
    plan = planner.plan(budget_bytes=budget)
    assert "block chain" in plan.solver_stats.status  # the plan came from the block program
    module = planner.apply(plan)
    assert_same_step(module, reference, case)
    measured = autockpt.measure_step(module, case.args, case.kwargs, case.loss_fn).peak_bytes
    assert measured <= budget
    assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * measured
