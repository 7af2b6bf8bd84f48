"""Pipeline plans (issue 22): split, per-stage plans, and runs on torch.distributed.pipelining under gloo.

PyTorch is the reference: the single-process model's loss and gradients on the same batch. Ranks are spawned with a
timeout and destroy their process groups (``experiments/common/pipeline_worker.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import random

import pytest
import torch
from pipeline_planners import CONFIG, MICROBATCHES, batch, shared_planner
from spawned_ranks import RANKS_GROUP, run_ranks
from support import TEST_TIMING

import autockpt
from autockpt.core.solve.split import SplitProblem, StageOption, exhaustive_split, solve_split
from autockpt.errors import InfeasibleBudgetError, PlanMismatchError
from autockpt.pipeline.run import stage_module_for
from autockpt.pipeline.stage_table import spread
from autockpt.record_types import PipelineRecord, PipelineStageRecord
from experiments.common.pipeline_worker import build, lm_loss, run_rank

# one worker for the module, the pipeline report's and the FSDP tests: the planners (``pipeline_planners``) are traced
# once, and the ranks of both kinds fork from one fork server
pytestmark = RANKS_GROUP


def _plan(config: dict, num_stages: int = 2, **kwargs) -> autockpt.PipelinePlan:
    ids, target = batch(config)
    return autockpt.plan_pipeline(
        build(config), num_stages, microbatches=MICROBATCHES, example_inputs=(ids,), example_target=target,
        loss_fn=lm_loss, **kwargs,
    )


def _run(config: dict, pplan: autockpt.PipelinePlan, tmp_path) -> list[dict]:
    """Every rank's losses, gradients and measured peaks (two steps)."""
    ids, target = batch(config)
    pplan.save(tmp_path / "plan.json")
    torch.save({"ids": ids, "target": target}, tmp_path / "batch.pt")
    run_ranks(
        run_rank, (pplan.num_stages, config, str(tmp_path / "plan.json"), str(tmp_path), str(tmp_path / "init")),
        pplan.num_stages, 180, "pipeline ranks",
    )
    return [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(pplan.num_stages)]


def _reference(config: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model = build(config)
    ids, target = batch(config)
    loss = lm_loss(model(ids), target)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.fixture(scope="module")
def tight_budget() -> int:
    """A budget about 30 % of the way from the tightest split's floor to what the plain even split needs, so
    that recomputation and the split both matter."""
    roomy = shared_planner(CONFIG).compare(budget_bytes=10**9)["even-layers"]
    with pytest.raises(InfeasibleBudgetError) as refused:
        shared_planner(CONFIG).plan(budget_bytes=100_000)
    floor = refused.value.min_feasible_bytes
    return int(floor + 0.3 * (max(s.predicted_peak_bytes for s in roomy.stages) - floor))


@pytest.mark.slow
def test_a_planner_that_answered_other_budgets_plans_as_plan_pipeline_does(tight_budget) -> None:
    """Three stages run on spawned ranks in the test below (at the stated minimum): the same end-to-end fact is not
    run again here for two (issue 46's suite time)."""
    pplan = shared_planner(CONFIG).plan(budget_bytes=tight_budget)
    assert len(pplan.stages) == 2 and pplan.cuts
    # sends between stages priced at the copy bandwidth of the tests' fixed CPU, whose roofline gives the times: not
    # at a copy measured by each planner, which could choose other cuts on a busy machine (issue 46)
    assert shared_planner(CONFIG).link_gb_per_s == TEST_TIMING.spec.hbm_gb_per_s / 2
    # a planner that answered other budgets first plans as plan_pipeline does from scratch (the same cuts, bytes
    # and regions; times are measured again by each)
    fresh = _plan(CONFIG, budget_bytes=tight_budget)

    def decided(plan: autockpt.PipelinePlan) -> tuple:
        return plan.cuts, [(s.first_unit, s.last_unit, s.predicted_peak_bytes, s.retained_bytes,
                            s.schedule_buffer_bytes) for s in plan.stages], [p.regions for p in plan.stage_plans]

    assert decided(fresh) == decided(pplan)


def _assert_single_process_step_under_budget(config: dict, pplan: autockpt.PipelinePlan, results: list[dict]) -> None:
    """Mean microbatch loss and every gradient equal the single-process model's; each rank kept its budget."""
    loss, grads = _reference(config)
    assert abs(sum(results[-1]["losses"]) / MICROBATCHES - loss) < 1e-5
    seen = set()
    for stage, result in zip(pplan.stages, results):
        assert result["same_objects"], "a stage module must hold the model's own Parameter objects"
        assert set(result["grads"]) <= set(grads), "stage parameters keep the model's names"
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, grads[name], rtol=1e-5, atol=1e-6)
            seen.add(name)
        _assert_peaks_kept(stage, result)
    assert {n for n, _ in build(config).named_parameters()} <= seen  # tied: the head's name on the last rank too


def _assert_peaks_kept(stage: PipelineStageRecord, result: dict) -> None:
    """Each rank's measured peaks: the first two steps by autockpt's StorageTracker (the first step makes the
    receive buffers), a later one by torch's MemTracker (``pipeline_worker._memtracker_step`` says why not the first)."""
    for peak in (*result["peaks"], result["memtracker_peak"]):
        assert peak <= stage.budget_bytes, (stage.index, peak, stage.budget_bytes)
        assert abs(peak - stage.predicted_peak_bytes) <= 0.05 * peak, (stage.index, peak, stage.predicted_peak_bytes)


@pytest.mark.slow
def test_three_stages_with_tied_weights_give_the_single_process_step_at_the_minimum_with_the_loss_in_chunks(
    tmp_path,
) -> None:
    """Three stages run at the smallest budget the refusal states: the ranks' step is the single process's (mean
    microbatch loss, every gradient), each rank keeps its budget, 1F1B keeps min(S - k, microbatches) microbatches in
    flight. The embedding and the head are one tied weight, held by the first and the last stage. The last rank is
    stepped as PyTorch documents it (``losses=``: that list holds every microbatch's loss while the schedule
    concatenates the outputs, the last stage's peak; 16 B over the stated minimum before they were counted). 256
    tokens a microbatch, a vocabulary of 4096: the logits (4 MB a microbatch) set the last stage's floor, which it
    lowers by computing the loss in chunks (issue 48): the last stage is planned with ``loss_fn`` and the schedule's
    loss function runs it. Two cut candidates for the two cuts: what is checked holds at any split (the split program
    is tested against the exhaustive search below). One run of ranks for all of it (issue 46: two tests spawned a
    two-stage and a three-stage run for these facts)."""
    config = {**CONFIG, "model": {**CONFIG["model"], "tied": True, "vocab": 4096}, "seq": 128}
    planner = shared_planner(config, num_stages=3, max_cut_candidates=2)
    with pytest.raises(InfeasibleBudgetError) as refused:
        planner.plan(budget_bytes=100_000)
    pplan = planner.plan(budget_bytes=refused.value.min_feasible_bytes)
    assert len(pplan.cuts) == 2
    assert [s.microbatches_in_flight for s in pplan.stages] == [3, 2, 1]  # 1F1B: min(S - k, microbatches)
    assert [s.stages for s in pplan.shared_parameters] == [(0, 2)]
    assert [s.with_loss for s in pplan.stages] == [False, False, True] and pplan.stage_plans[-1].loss_chunk_tokens > 0
    logits_bytes = 2 * 128 * 4096 * 4  # one microbatch's: the floor is far under what holding them needs
    assert pplan.stages[-1].predicted_peak_bytes < pplan.stages[-1].parameter_bytes * 2 + 2 * logits_bytes
    assert any("the tensors the last rank receives" in note for note in pplan.notes)
    assert f"the loss in chunks of {pplan.stage_plans[-1].loss_chunk_tokens} tokens" in pplan.summary()
    results = _run(config, pplan, tmp_path)
    assert len(results[-1]["losses"]) == MICROBATCHES  # the step filled the list it was given
    _assert_single_process_step_under_budget(config, pplan, results)
    assert "embed.weight" in results[0]["grads"] and "head.weight" in results[2]["grads"]
    assert "head.weight" in results[2]["state_dict_keys"]  # the stage module's keys are the model's own
    assert set(results[2]["state_dict_keys"]) <= set(build(config).state_dict())


@pytest.mark.slow
def test_the_chosen_split_keeps_a_budget_the_even_split_cannot(tight_budget) -> None:
    answers = shared_planner(CONFIG).compare(budget_bytes=tight_budget)
    assert isinstance(answers["even-layers"], InfeasibleBudgetError)
    pplan = answers["autockpt"]
    assert all(s.predicted_peak_bytes <= tight_budget for s in pplan.stages)
    assert pplan.cuts != shared_planner(CONFIG).compare(budget_bytes=10**9)["even-layers"].cuts


@pytest.mark.slow
def test_an_infeasible_budget_names_the_smallest_one_and_that_one_plans(tmp_path) -> None:
    with pytest.raises(InfeasibleBudgetError) as refused:
        shared_planner(CONFIG).plan(budget_bytes=100_000)
    smallest = refused.value.min_feasible_bytes
    assert "smallest budget a split keeps" in str(refused.value)
    pplan = shared_planner(CONFIG).plan(budget_bytes=smallest)
    assert max(s.predicted_peak_bytes for s in pplan.stages) <= smallest
    pplan.save(tmp_path / "p.json")
    again = autockpt.load_pipeline_plan(tmp_path / "p.json")
    assert again == pplan
    assert "stage 1" in again.summary()
    # a record with its methods, like Plan: the stages' plans come back as Plans, the placement is one stage per rank
    assert isinstance(again, PipelineRecord) and all(isinstance(p, autockpt.Plan) for p in again.stage_plans)
    placed = again.placement.stages
    assert [(s.first_unit, s.last_unit) for s in placed] == [(s.first_unit, s.last_unit) for s in pplan.stages]
    assert placed[0].first_unit == 0 and [s.device for s in placed] == [f"rank {i}" for i in range(len(placed))]


def test_a_pipeline_plan_says_how_its_stages_were_traced(tmp_path) -> None:
    pplan = shared_planner(CONFIG).compare(budget_bytes=10**9)["even-layers"]
    provenance = pplan.provenance
    # the tests' timing (``support.TEST_TIMING``): a roofline of a fixed CPU, on the CPU the step ran on
    assert (provenance.trace, provenance.timing, provenance.device) == ("measured", "roofline", "cpu")
    # every stage traced and timed alike (a stage captured by export also states its self-check's peaks: its own)
    assert all(dataclasses.replace(the_plan.provenance, eager_peak_bytes=None, captured_peak_bytes=None) == provenance
               for the_plan in pplan.stage_plans)
    assert f"made from: {provenance.describe()} (every stage alike)" in pplan.summary()
    pplan.save(tmp_path / "plan.json")
    assert autockpt.load_pipeline_plan(tmp_path / "plan.json").provenance == provenance


def test_the_split_program_finds_the_exhaustive_best() -> None:
    rng = random.Random(0)
    for trial in range(20):
        num_units, num_stages = rng.randint(4, 9), rng.randint(2, 4)
        cuts = sorted(rng.sample(range(num_units - 1), rng.randint(num_stages - 1, num_units - 1)))
        starts, ends = [0, *(c + 1 for c in cuts)], [*cuts, num_units - 1]
        options = [
            StageOption(stage=s, first_unit=a, last_unit=b, microbatch_ms=rng.uniform(1, 10) * (b - a + 1))
            for (a, b), s in itertools.product([(a, b) for a in starts for b in ends if a <= b], range(num_stages))
            if (s == 0) == (a == 0) and (s == num_stages - 1) == (b == num_units - 1) and rng.random() < 0.8
        ]
        problem = SplitProblem(
            num_units=num_units, num_stages=num_stages, microbatches=rng.randint(num_stages, 8),
            options=tuple(options), transfer_ms={c: rng.uniform(0, 2) for c in range(num_units)},
        )
        best, solved = exhaustive_split(problem), solve_split(problem)
        assert (best is None) == (solved is None), trial
        if best is not None:
            assert solved.predicted_step_ms == pytest.approx(best.predicted_step_ms, rel=1e-6), trial


def test_bad_requests_say_what_to_do() -> None:
    ids, target = batch()
    model = build(CONFIG)
    with pytest.raises(ValueError, match="at least as many microbatches as stages"):
        autockpt.plan_pipeline(model, 4, budget_bytes=10**9, microbatches=2, example_inputs=(ids,),
                               example_target=target, loss_fn=lm_loss)
    with pytest.raises(ValueError, match="one budget per stage"):
        autockpt.plan_pipeline(model, 2, budget_bytes=[10**9], example_inputs=(ids,), example_target=target,
                               loss_fn=lm_loss)
    with pytest.raises(ValueError, match="multiple of microbatches"):
        autockpt.plan_pipeline(model, 2, budget_bytes=10**9, microbatches=3, example_inputs=(ids,),
                               example_target=target, loss_fn=lm_loss)
    with pytest.raises(TypeError, match="loss_fn must be given"):
        autockpt.plan_pipeline(model, 2, budget_bytes=10**9, example_inputs=(ids,), example_target=target)
    for candidates in (0, 2.0, True):  # three stages are cut at two candidates at least (1 divided by zero)
        with pytest.raises(ValueError, match="max_cut_candidates must be an integer >= 2"):
            autockpt.plan_pipeline(model, 3, budget_bytes=10**9, microbatches=3, example_inputs=(ids[:3],),
                                   example_target=target[:3], loss_fn=lm_loss, max_cut_candidates=candidates)


def test_one_cut_candidate_is_the_middle_boundary() -> None:
    assert spread([3, 7, 11, 15, 19], 1) == [11]
    assert spread([3, 7, 11, 15, 19], 2) == [3, 19] and spread([3, 7], 5) == [3, 7]


def test_a_last_stage_whose_loss_cannot_be_chunked_is_planned_alone_and_says_why() -> None:
    ids, target = batch()

    def smoothed(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), label_smoothing=0.1)

    pplan = autockpt.plan_pipeline(
        build(CONFIG), 2, budget_bytes=10**9, microbatches=MICROBATCHES, example_inputs=(ids,),
        example_target=target, loss_fn=smoothed, split=(10,), max_cut_candidates=1,
    )
    assert not pplan.stages[-1].with_loss and pplan.stage_plans[-1].loss_chunk_tokens == 0
    assert [n for n in pplan.stage_plans[-1].notes if n.startswith("loss:")] == [
        "loss: not computed in chunks: the cross-entropy smooths its labels"
    ]
    assert not any("the tensors the last rank receives" in note for note in pplan.notes)


@pytest.mark.slow
def test_a_plan_for_another_model_is_refused_by_every_rank() -> None:
    pplan = shared_planner(CONFIG).compare(budget_bytes=10**9)["even-layers"]  # any split of the shared planner's
    other = build({**CONFIG, "model": {**CONFIG["model"], "layers": 3}})
    with pytest.raises(PlanMismatchError, match="another model"):
        stage_module_for(other, pplan, 0)
    # the last stage was planned with its loss function: without it, no stage module is made
    assert pplan.stages[-1].with_loss
    with pytest.raises(TypeError, match="give the loss_fn the plan was made with"):
        stage_module_for(build(CONFIG), pplan, 1)
    last = stage_module_for(build(CONFIG), pplan, 1, loss_fn=lm_loss)
    _, target = batch()
    received = torch.randn(2, 16, 32, requires_grad=True)
    assert last(received) == (received,)  # it passes on what it receives; its loss runs the stage and the loss
    assert last.loss((received,), target[:2]).shape == ()
    assert os.environ.get("WORLD_SIZE") is None  # nothing here started a process group


@pytest.mark.slow
def test_even_layers_splits_the_layer_stack_and_given_cuts_are_checked() -> None:
    """Blocks are the outermost children of a ModuleList/Sequential (the MLP Sequential inside a GPT-2 layer is
    part of the layer): even-layers puts as many layers on each stage, the embeddings with the first and the norm
    and head with the last."""
    config = {"seed": 0, "kind": "gpt2", "model": {"vocab": 1024, "width": 32, "layers": 4}}
    pplan = _plan(config, budget_bytes=10**9, split="even-layers")
    layers = [sorted({p.split(".")[1] for p in stage.module_paths if p.startswith("h.")}) for stage in pplan.stages]
    assert layers == [["0", "1"], ["2", "3"]]
    assert "wte" in pplan.stages[0].module_paths and "lm_head" in pplan.stages[1].module_paths
    inside_a_layer = next(u for u in range(pplan.cuts[0] - 3, pplan.cuts[0]) if u not in pplan.candidate_cuts)
    with pytest.raises(ValueError, match="ascending unit indices"):
        _plan(config, budget_bytes=10**9, split=(10**6,))
    # a cut inside a layer is allowed when only tensors cross it; the stages then split that layer
    inside = _plan(config, budget_bytes=10**9, split=(inside_a_layer,))
    assert inside.cuts == (inside_a_layer,)
