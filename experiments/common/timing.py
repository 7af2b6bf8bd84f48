"""Step-time ratios of alternating runs in one process: the only timing the experiments report.

A shared machine's absolute step times say little; the ratio of two modules timed in turn, in one process, says what
one costs against the other. ``step_time_ratio`` alternates two modules in pairs; ``round_robin_ratios`` runs every
module of a set once per round, in a rotating order (``autockpt.measure.step.alternating_step_seconds``).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from torch import nn

import autockpt
from autockpt.measure import step as measure
from autockpt.measure.step import alternating_step_seconds


def step_seconds(module: torch.nn.Module, case: Any) -> float:
    """Seconds of one training step; ``case`` has ``args``, ``kwargs`` and ``loss_fn`` (a ZooCase, an ExampleBatch)."""
    return measure.step_seconds(module, case.args, dict(case.kwargs), case.loss_fn or autockpt.measure.loss.default_loss)


def step_time_ratio(optimized: torch.nn.Module, original: torch.nn.Module, case: Any, repeats: int) -> float:
    """Median of optimized/original over alternating pairs (after one warm-up each)."""
    step_seconds(original, case)
    step_seconds(optimized, case)
    ratios = []
    for _ in range(repeats):
        base = step_seconds(original, case)
        ratios.append(step_seconds(optimized, case) / base)
    return statistics.median(ratios)


def round_robin_ratios(modules: dict[str, nn.Module], reference: str, batch: Any, repeats: int) -> dict[str, float]:
    """Median over rounds of t(module) / t(reference) in the same round; every module runs once per round, in a
    rotating order, after a warm-up round (``autockpt.measure.step.alternating_step_seconds``). ``batch`` has
    ``args``, ``kwargs`` and ``loss_fn`` (an ``ExampleBatch``)."""
    names = list(modules)
    seconds = alternating_step_seconds(
        [modules[name] for name in names], batch.args, dict(batch.kwargs), batch.loss_fn or autockpt.measure.loss.default_loss,
        rounds=repeats,
    )
    base = seconds[names.index(reference)]
    return {name: statistics.median(t / b for t, b in zip(times, base)) for name, times in zip(names, seconds)}
