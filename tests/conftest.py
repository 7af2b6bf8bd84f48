"""pytest's hooks and fixtures for the suite: its settings, its time budget, its garbage collection and its xdist
groups. The helpers tests import (models, budgets, PyTorch as the reference) are in support.py."""

from __future__ import annotations

import os

# One OpenMP thread in every process the tests start, set before torch is first imported (here: conftest is imported
# before any test module): pytest-xdist runs two workers on this project's 2-core machines. ``torch.set_num_threads``
# (support.py) sets torch's intra-op threads of a process only; with the variable unset a worker that planned GPT-2
# had two native threads more (4 against 2), and each fork server and Inductor compile worker starts torch with a
# thread per core (the spawned ranks set one thread themselves, once they run). Whole-suite runs on fresh clones,
# alternating: 4-9 % quicker with it in three pairs, 3 % slower in one (the machine's own spread is about 5 %;
# issue 46). A value the user sets is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import gc
import time
from typing import Any

import pytest

# The helpers the tests share are in support.py, which imports torch and autockpt. This file imports neither: pytest-
# xdist's controller imports it too and runs no test, and it started the workers only once torch and autockpt were
# imported (2.6 s into each run; 0.4 s without them, 2026-11-29; issue 46).

# issue 20: the default run (`python -m pytest -q`, tests marked slow included) takes at most 6 minutes on 2 cores.
# Said at the end of every such run, so that a test which makes the suite slow shows where it is added.
SUITE_BUDGET_S = 360
_session_started = time.monotonic()


def pytest_sessionstart(session: pytest.Session) -> None:
    """In every process that runs tests (an xdist worker, or the one process of ``-n 0``), the settings every test
    runs under (``support``: one intra-op thread, the fixed timing and checkpoint kind plans are made with) before
    any test module is imported: a module that imports nothing from ``support`` gets them too."""
    global _session_started
    _session_started = time.monotonic()
    if not session.config.pluginmanager.hasplugin("dsession"):  # xdist's controller: runs no test
        import support  # noqa: F401


@pytest.fixture(autouse=True)
def _threads() -> None:
    import torch
    from support import THREADS

    torch.set_num_threads(THREADS)


# Python's full (generation 2) collections scan every object alive, and the tests' processes keep growing (torch's
# and transformers' caches, module-scoped planners): 82 full collections took 29 s of the suite's ~320 s of test time
# (measured with gc.callbacks, 2026-11-29). After a test during which one ran, the objects that survived it are set
# aside (``gc.freeze``), so the next ones scan what later tests made. The cost: cycles among the set-aside objects
# are never collected (reference counting still frees the rest): peak RSS per worker 1229 and 1355 MB against 1026
# and 1040 MB. Whole suite: 145.1 s against 158.5 s, one run each, one after the other (issue 46).
_full_collections = {"seen": 0, "set_aside_after": 0}


def _count_full_collections(phase: str, info: dict[str, int]) -> None:
    if phase == "stop" and info["generation"] == 2:
        _full_collections["seen"] += 1


gc.callbacks.append(_count_full_collections)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _full_collections["seen"] > _full_collections["set_aside_after"]:
        _full_collections["set_aside_after"] = _full_collections["seen"]
        gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The heap the tests built set aside from the collector (``gc.freeze``) as the process ends: pytest's unraisable
    exception check then collects five times over it (``gc_collect_harder``), 0.5 s and more each here, in each
    xdist worker. Measured on tests/planning and tests/records, two runs each way: 60.0 and 60.0 s against 63.9 and
    62.7 s (issue 46). What that last sweep would report (a ``__del__`` raising in a cycle the last tests left) is
    lost; unraisable exceptions raised while the tests run are still reported."""
    gc.freeze()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    whole_suite = config.args_source is pytest.Config.ArgsSource.TESTPATHS
    if not whole_suite or config.option.keyword or config.option.markexpr or config.option.collectonly:
        return
    elapsed = time.monotonic() - _session_started
    line = f"autockpt test suite: {elapsed:.0f} s of its {SUITE_BUDGET_S} s budget on 2 cores (issue 20)"
    if elapsed <= SUITE_BUDGET_S:
        terminalreporter.write_line(line)
    else:
        terminalreporter.write_line(
            f"{line}: OVER; make the slowest tests cheaper (python -m pytest --durations=15)", yellow=True, bold=True
        )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that share a module-scoped fixture run on one xdist worker (``--dist loadgroup``, pyproject's addopts), so
    the fixture (a planned model, a spawned run) is built once, not once per worker that gets one of them."""
    for item in items:
        definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if item.get_closest_marker("xdist_group") is None and any(
            defs and defs[-1].scope == "module" for defs in definitions.values()
        ):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
