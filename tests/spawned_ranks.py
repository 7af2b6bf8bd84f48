"""Ranks for the distributed tests, started from a fork server that imported their worker modules once.

``start_method="spawn"`` starts each rank as a fresh interpreter that imports torch, autockpt and the worker module
again: about 2.5 s of CPU a rank on this project's 2-core machines, for 7 ranks in the suite (issue 46). A fork
server is one clean, single-threaded process per test process that imports those modules once (``PRELOADED``) and
forks each rank from itself: the ranks start with the imports made, and none is forked from the pytest process (its
threads, its models). Each rank is still its own process with its own process group; the callers join with a
timeout and kill what is left.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import time
from collections.abc import Callable

import pytest
import torch.multiprocessing as mp

# the modules every rank imports: made once in the fork server, before it forks the first rank. autockpt too: the
# workers import it inside their rank functions, which cost each rank about a second of CPU (issue 46; py-spy over
# the whole suite: 8.4 s in the pipeline tests' ranks). Hugging Face's Llama where transformers is installed: the
# FSDP ranks' cases build it (2.4 s of CPU a rank when each imports it)
PRELOADED = (
    "autockpt", "experiments.common.pipeline_worker", "experiments.common.fsdp_worker",
    *(("transformers.models.llama.modeling_llama",) if importlib.util.find_spec("transformers") else ()),
)

# the modules whose tests spawn ranks: one xdist group, so that one worker's fork server starts them all (its
# imports cost about 4.5 s of CPU, where two workers each started one; issue 46)
RANKS_GROUP = pytest.mark.xdist_group("ranks")


def run_ranks(function: Callable[..., None], args: tuple, nprocs: int, limit_s: float, what: str) -> None:
    """``function(rank, *args)`` on ``nprocs`` ranks forked from the fork server; a rank's failure is raised with its
    traceback, and ranks still running after ``limit_s`` are killed and the test fails naming ``what``."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOADED))
    context = mp.start_processes(function, args=args, nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.monotonic() + limit_s
    # join returns when one process ends (False while others run) and raises when a rank failed, with its traceback
    while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{what} did not finish within {limit_s:.0f} s")
