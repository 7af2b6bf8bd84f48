"""FSDP2 plans run on two gloo ranks (issue 38): planned in this process on the fake process group, applied by
``apply_fsdp`` on every rank (a meta model, then ``to_empty``), trained two AdamW steps on each rank's half of the
global batch. PyTorch is the reference: the single-process model on the global batch. Every case runs on one pair of
ranks, spawned once with a timeout; they destroy their process group (``experiments/common/fsdp_worker.py``)."""

from __future__ import annotations

import importlib.util
import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from fsdp_planners import WORLD, shared_planner
from spawned_ranks import RANKS_GROUP, run_ranks
from support import needs_transformers

from experiments.common.fsdp_worker import CONFIG, build, reference, run_rank

logger = logging.getLogger(__name__)
pytestmark = RANKS_GROUP  # with test_fsdp_plan.py: the planners both trace are shared


# budgets halfway between two of the measured peaks: nothing checkpointed ("baseline"), every unit selective
# ("selective"), every unit whole ("floor"), a fifth of the way from the baseline to the floor ("tenth": the budget is
# then a tenth of the way); and the decisions a budget gives, where the case fixes them. Hugging Face's Llama is
# planned on an H100's roofline times (one planner for its two cases: the parts case's choice is made on them), the
# other cases on the tests' fixed times (``support.TEST_TIMING``)
CASES = {
    "selective-baseline": ("decoder", 256, ("selective", "baseline"), {"keep", "selective"}),
    # torch's nn.TransformerEncoderLayer in an nn.ModuleList, default units (issue 46: read from the module list)
    "floor-baseline-uneven": ("torch-encoder", 257, ("floor", "baseline"), None),
    # Hugging Face's Llama with grouped-query attention (RMSNorm, rotary causal attention, SwiGLU): the fake trace
    # takes the eager course the ranks take (issue 45: no T x T mask, keys and values not repeated across heads;
    # its packed-sequence check's value replayed from the real model). Between the floor and every unit selective:
    # both decoder layers whole (a unit whose forward takes keyword arguments: the rotary embeddings, the mask)
    "hf-llama-floor-selective": ("hf-llama", 256, ("floor", "selective"), {"full"}),
    # a tenth of the way from nothing checkpointed to the floor: a block keeps all but one part (its MLP)
    # checkpointed (issue 46: a Llama-style model of the workers' own had the parts case; one planner for both)
    "hf-llama-parts": ("hf-llama", 256, ("tenth", "baseline"), None),
    # with a host pool: under what every unit checkpointed whole reaches (full checkpointing per block), above what
    # every unit whole with its inputs in the pool reaches. Which units are offloaded is not fixed: at this budget a
    # plan with one unit whole and not offloaded predicts the same peak as all four offloaded, and the planner's answer
    # flips within a byte of it (all four at the budget, one whole a byte under it; 2026-11-29), and one suite run in
    # about 15 planned {full, full_offload} here. That some unit is offloaded is asserted (the plan's host pool bytes)
    "offloaded-under-the-floor": ("decoder", 256, ("pool floor", "floor"), None),
    # a vocabulary of 8192 (8 MB of logits a rank) at the floor, far under what every unit checkpointed whole
    # reaches with the loss as the model computes it: the root's head and cross-entropy run in chunks (issue 48),
    # and the peak is the root's gradient reduce-scatter, with gloo's copy of its input (``gloo_reduce_scatter_copies``)
    "loss-in-chunks": ("decoder", 8192, ("floor", "floor"), None),
}


@dataclass(frozen=True)
class PlannedCase:
    """One case planned in this process: its model config, budget and plan, or why planning it failed."""

    config: dict[str, Any]
    budget: int = 0
    fplan: Any = None
    peaks: dict[str, int] | None = None  # the roomy plan's figures the budget was set between
    failure: BaseException | None = None


def _plan_case(case: str, folder: Path) -> PlannedCase:
    """The case's planner is shared with the cases and tests that plan the same model alike (``fsdp_planners``):
    traced once, the ranks' loop (AdamW steps, ``fsdp_worker``) covered."""
    kind, vocab, (low, high), _ = CASES[case]
    config = {**CONFIG, "kind": kind, "model": {**CONFIG["model"], "vocab": vocab}}
    if kind == "hf-llama":
        config["model"]["heads"] = 4
    # two blocks (issue 46: each fake-world measurement runs every block's ops) but for the decoder's cases of the
    # pool and of the budgets that give its four blocks decisions (with fewer, the pool no longer lowers the floor)
    if kind != "decoder" or case == "loss-in-chunks":
        config["model"]["layers"] = 2
    try:
        chunks = "auto" if case == "loss-in-chunks" else 0
        planner = shared_planner(config, roofline=kind == "hf-llama", loss_chunk_tokens=chunks)
        roomy = planner.plan(budget_bytes=10**9)
        peaks = {"baseline": roomy.baseline_peak_bytes, "selective": roomy.selective_peak_bytes,
                 "floor": roomy.min_feasible_bytes}
        peaks["tenth"] = roomy.baseline_peak_bytes - (roomy.baseline_peak_bytes - roomy.min_feasible_bytes) // 5
        if low == "pool floor":
            planner = shared_planner(config, host_pool_gb=1.0)
            peaks[low] = planner.plan(budget_bytes=10**9).min_feasible_bytes
            assert peaks[low] < peaks["floor"]
        if case == "loss-in-chunks":  # the floor without chunks, from the measurements the planner keeps
            every, decision = planner._every_whole(0)
            peaks["unchunked floor"] = every[decision].peak_bytes
        budget = (peaks[low] + peaks[high]) // 2
        fplan = planner.plan(budget_bytes=budget)
        fplan.save(folder / f"{case}.json")
        return PlannedCase(config, budget, fplan, peaks)
    except Exception as failure:  # noqa: BLE001  said by this case's test; the other cases still run
        return PlannedCase(config, failure=failure)


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PlannedCase, list[dict]]]:
    """Every case planned here, then run on one pair of spawned ranks, case after case: one spawn, one set of imports
    and one process group for all (issue 46: the spawns were most of these tests' time)."""
    folder = tmp_path_factory.mktemp("fsdp_gloo")
    cases = [c for c in CASES if CASES[c][0] != "hf-llama" or importlib.util.find_spec("transformers") is not None]
    planned = {case: _plan_case(case, folder) for case in cases}
    runnable = [case for case in cases if planned[case].failure is None]
    jobs = [(planned[c].config, str(folder / f"{c}.json"), str(folder / f"{c}.rank{{rank}}.pkl")) for c in runnable]
    run_ranks(run_rank, (WORLD, jobs, str(folder / "init")), WORLD, 120 + 60 * len(runnable),
              f"FSDP ranks running {len(runnable)} cases")
    return {
        case: (planned[case], [pickle.loads((folder / f"{case}.rank{r}.pkl").read_bytes()) for r in range(WORLD)]
               if case in runnable else [])
        for case in cases
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=needs_transformers) if CASES[c][0] == "hf-llama" else c for c in CASES]
)
def test_two_ranks_give_the_single_process_losses_and_gradients_under_the_budget(case, gloo_runs) -> None:
    """Plans with units kept, selective and full. With a vocabulary of 257 the embedding and head shard 129 / 128
    rows: FSDP2 pads rank 1's parameters to rank 0's size, but its optimizer states follow its 128 rows, so rank 1
    holds a little less than the plan's figure."""
    planned, ranks = gloo_runs[case]
    if planned.failure is not None:
        raise planned.failure
    config, budget, fplan = planned.config, planned.budget, planned.fplan
    kind, _, (low, _), decisions = CASES[case]
    if kind == "torch-encoder":  # default units: the module list's entries, then the root
        assert fplan.units == (*(f"layers.{i}" for i in range(config["model"]["layers"])), "")
    if kind == "hf-llama":  # its decoder layers are the units; parts are their children
        assert fplan.units == (*(f"model.layers.{i}" for i in range(config["model"]["layers"])), "")
        assert {p.rsplit(".", 1)[1] for p in fplan.checkpointed_parts} <= {
            "self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
        assert planned.peaks["floor"] < planned.peaks["selective"] < planned.peaks["baseline"]
    made = {fplan.decision(u).value for u in fplan.units if u}
    # units the budget does not need are kept or given a part (a norm, the attention or the MLP checkpointed alone,
    # where the times make it cheapest); the loss in chunks may free enough alone
    assert (made != {"keep"} or fplan.loss_chunk_tokens) and (
        decisions is None or made - {"keep", "parts"} == decisions - {"keep"}), made
    if case == "loss-in-chunks":  # under the floor of the loss as the model computes it: its chunks are needed
        assert (fplan.loss_projection, planned.peaks["unchunked floor"] > budget) == ("head", True)
        assert fplan.loss_chunk_tokens > 0 and fplan.min_feasible_bytes < planned.peaks["unchunked floor"]
    else:
        assert fplan.loss_chunk_tokens == 0  # planned with loss_chunk_tokens=0 (``shared_planner``)
    assert low != "tenth" or "parts" in made, made
    assert (fplan.host_pool_bytes > 0) == (low == "pool floor")
    logger.warning("%s: checkpointed %s, selective %s, offloaded %s, parts %s", case, fplan.checkpointed,
                   fplan.selective, fplan.offloaded, fplan.checkpointed_parts)

    losses, grads = reference(config, WORLD)
    for result in ranks:
        assert result["names"] == [n for n, _ in build(config).named_parameters()]  # names kept
        assert result["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-4, atol=1e-6)
    race = _gloo_race_bytes(build(config), fplan.units)
    if ranks[0]["measured_twice"]:
        logger.warning("%s: a rank measured over its prediction, and the ranks measured again", case)
    for rank, result in enumerate(ranks):
        predicted = fplan.ranks[rank].peak_bytes
        for tracker, measured in (("FSDPMemTracker", result["peak_bytes"]), ("StorageTracker", result["own_peak_bytes"])):
            logger.warning("rank %d: budget %d B, predicted %d B, %s measured %d B (%+.3f %%)", rank, budget,
                           predicted, tracker, measured, 100 * (measured / predicted - 1))
            # at most 1 % under (a rank with a shorter shard holds smaller optimizer states than rank 0's view), and
            # over only by the gloo race's all-gather buffer (docs/fsdp.md), which the budget then does not cover
            assert predicted * 0.99 <= measured <= predicted + race, (tracker, measured, predicted, result["breakdown"])
            assert measured <= budget or measured - predicted <= race
    # rank 0's view is rank 0's, to the byte, in a run the race missed (a run over a rank's prediction is made
    # again once on every rank, ``fsdp_worker._rank_result``; the race was never seen in two runs)
    assert min(ranks[0]["peak_bytes"], ranks[0]["own_peak_bytes"]) == fplan.ranks[0].peak_bytes


def _gloo_race_bytes(model: torch.nn.Module, units: tuple[str, ...]) -> int:
    """The largest unit's all-gather output on a rank (its parameters' bytes; 1 % more for rows padded to the world
    size): on gloo one such buffer is sometimes still alive at a rank's peak, held past FSDP2's release until the
    collective's own thread lets go of it (2 of 24 measurements of rank 1, case floor-baseline-uneven, 2026-11-26);
    the fake process group completes collectives at once and never holds it."""
    owned: dict[str, int] = {}
    for name, param in model.named_parameters():
        owner = next((u for u in units if u and name.startswith(u + ".")), "")
        owned[owner] = owned.get(owner, 0) + param.numel() * param.element_size()
    return int(max(owned.values()) * 1.01)
