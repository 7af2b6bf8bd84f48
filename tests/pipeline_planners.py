"""Pipeline planners the pipeline test modules share: the same model, batch and stage count give the same planner,
captured and profiled once per worker. The modules that use it are in the xdist group of the tests that spawn ranks
(``spawned_ranks.RANKS_GROUP``), so each planner is made once in the suite."""

from __future__ import annotations

import torch

from autockpt.pipeline import PipelinePlanner
from experiments.common.pipeline_worker import build, lm_loss

CONFIG = {"seed": 0, "model": {"vocab": 1024, "width": 32, "layers": 4, "tied": False}}
MICROBATCHES = 4

_PLANNERS: dict[str, PipelinePlanner] = {}


def batch(config: dict = CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    shape, vocab = (8, config.get("seq", 16)), config["model"]["vocab"]
    return torch.randint(0, vocab, shape, generator=generator), torch.randint(0, vocab, shape, generator=generator)


def shared_planner(config: dict, num_stages: int = 2, max_cut_candidates: int = 16) -> PipelinePlanner:
    """One capture and profile per model, stage count and number of cut candidates in this worker, for every budget
    a test asks: the autockpt split first (``plan``), the even split beside it (``compare``)."""
    key = repr((config, num_stages, max_cut_candidates))
    if key not in _PLANNERS:
        ids, target = batch(config)
        _PLANNERS[key] = PipelinePlanner.from_model(
            build(config), num_stages, microbatches=MICROBATCHES, example_inputs=(ids,), example_target=target,
            loss_fn=lm_loss, splits=("autockpt", "even-layers"), max_cut_candidates=max_cut_candidates,
        )
    return _PLANNERS[key]
