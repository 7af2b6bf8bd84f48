"""FSDP planners the FSDP test modules share: the same model, batch and options give the same planner, traced once
per worker. Both modules are in the xdist group of the tests that spawn ranks (``spawned_ranks.RANKS_GROUP``), so
each planner is made once in the suite."""

from __future__ import annotations

import functools
import json
from typing import Any

from autockpt.core.devices import device_spec
from autockpt.fsdp import FSDPPlanner
from autockpt.measure.timing import RooflineTiming
from experiments.common.fsdp_worker import batch, build, lm_loss

WORLD = 2


def shared_planner(config: dict[str, Any], *, roofline: bool = False, host_pool_gb: float = 0.0,
                   loss_chunk_tokens: int | str = 0) -> FSDPPlanner:
    """The planner of ``config``'s model (``fsdp_worker.build``) on rank 0's batch of a world of ``WORLD``, stepping
    AdamW as the ranks do; ``roofline``: an H100's roofline times (the same choice on every machine). The loss is not
    computed in chunks unless asked (``loss_chunk_tokens``): weighing its chunks measures each decision per chunk,
    and the tests that are not about it would pay for that."""
    # "decoder" is ``build``'s default kind: a config that names it is the same model as one that does not
    keyed = {key: value for key, value in config.items() if (key, value) != ("kind", "decoder")}
    return _planner(json.dumps(keyed, sort_keys=True), roofline, host_pool_gb, loss_chunk_tokens)


@functools.cache
def _planner(config_json: str, roofline: bool, host_pool_gb: float, loss_chunk_tokens: int | str) -> FSDPPlanner:
    config = json.loads(config_json)
    ids, target = batch(config, rank=0, world=WORLD)
    options: dict[str, Any] = {"host_pool_gb": host_pool_gb} if host_pool_gb else {}
    options["loss_chunk_tokens"] = loss_chunk_tokens
    if roofline:
        options["timing"] = RooflineTiming(device_spec("h100-sxm-80gb"))
    return FSDPPlanner.from_model(
        build(config), world_size=WORLD, example_inputs=(ids,), example_target=target, loss_fn=lm_loss,
        optimizer="adamw", **options,
    )
