"""The checked request of a pipeline plan: model, stages, budgets, schedule, and the first microbatch of the example
batch (what is captured and measured)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.utils import _pytree as pytree

from autockpt.measure.trace import unique_storage_bytes
from autockpt.planning.options import budget_to_bytes
from autockpt.types import (
    PipelineSchedule,
)

SPLIT_STRATEGIES = ("autockpt", "exhaustive", "even-layers", "parameter-balanced")


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineRequest:
    model: nn.Module
    num_stages: int
    budgets_bytes: tuple[int, ...]  # one per stage
    microbatches: int
    schedule: PipelineSchedule
    microbatch_args: tuple  # the first microbatch: what is captured and measured
    microbatch_kwargs: dict
    microbatch_target: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]
    splits: tuple[str | tuple[int, ...], ...]
    return_outputs: bool
    batch_input_bytes: int  # the whole batch's tensors (stage 0 holds them) and target (the last stage)
    batch_target_bytes: int

    @staticmethod
    def check(
        model: Any, num_stages: Any, budget_gb: Any, budget_bytes: Any, microbatches: Any, schedule: Any,
        example_inputs: Any, example_kwargs: Any, example_target: Any, loss_fn: Any, splits: Any, return_outputs: bool,
    ) -> PipelineRequest:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 2:
            raise ValueError(f"num_stages must be an int >= 2 (one stage per device), got {num_stages!r}")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
        try:
            schedule = PipelineSchedule(schedule)
        except ValueError:
            raise ValueError(
                f"schedule must be one of {[s.value for s in PipelineSchedule]}, got {schedule!r}"
            ) from None
        if schedule is PipelineSchedule.ONE_F_ONE_B and microbatches < num_stages:
            raise ValueError(
                f"schedule 1F1B needs at least as many microbatches as stages; got {microbatches} microbatches for "
                f"{num_stages} stages: raise microbatches or use schedule='GPipe'"
            )
        if loss_fn is None or not callable(loss_fn):
            raise TypeError(
                "loss_fn must be given: a callable (output, target) -> scalar loss of one microbatch, as "
                "torch.distributed.pipelining calls it"
            )
        budgets = stage_budgets(budget_gb, budget_bytes, num_stages)
        checked_splits = []
        for split in splits:
            if isinstance(split, str):
                if split not in SPLIT_STRATEGIES:
                    raise ValueError(
                        f"split must be one of {SPLIT_STRATEGIES} or the units to cut after, got {split!r}"
                    )
            else:
                split = tuple(int(u) for u in split)
                if len(split) != num_stages - 1:
                    raise ValueError(
                        f"a given split needs {num_stages - 1} cuts for {num_stages} stages, got {list(split)}"
                    )
            checked_splits.append(split)
        args, kwargs = as_call(example_inputs, example_kwargs)
        arg_chunks, kwarg_chunks = split_batch(args, kwargs, microbatches, "example inputs")
        target_chunks = (
            [None] * microbatches if example_target is None
            else [chunk[0] for chunk in split_batch((example_target,), {}, microbatches, "example_target")[0]]
        )
        return PipelineRequest(
            model=model, num_stages=num_stages, budgets_bytes=budgets, microbatches=microbatches,
            schedule=schedule, microbatch_args=arg_chunks[0], microbatch_kwargs=kwarg_chunks[0],
            microbatch_target=target_chunks[0], loss_fn=loss_fn, splits=tuple(checked_splits), return_outputs=bool(return_outputs),
            batch_input_bytes=unique_storage_bytes(tensors_in((args, kwargs))),
            batch_target_bytes=unique_storage_bytes(tensors_in(example_target)),
        )


def stage_budgets(budget_gb: Any, budget_bytes: Any, num_stages: int) -> tuple[int, ...]:
    given = budget_gb if budget_gb is not None else budget_bytes
    if isinstance(given, (list, tuple)):
        if len(given) != num_stages:
            raise ValueError(f"give one budget per stage: {num_stages} stages, {len(given)} budgets ({list(given)})")
        return tuple(
            budget_to_bytes(b, None) if budget_gb is not None else budget_to_bytes(None, b) for b in given
        )
    return (budget_to_bytes(budget_gb, budget_bytes),) * num_stages


def as_call(example_inputs: Any, example_kwargs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError(f"example_inputs must be a tuple of positional arguments, got {type(example_inputs).__name__}")
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise TypeError(f"example_kwargs must be a dict, got {type(example_kwargs).__name__}")
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    if not args and not kwargs:
        raise ValueError("give example_inputs and/or example_kwargs: the whole batch the schedule will be stepped on")
    return args, kwargs


def split_batch(args: tuple, kwargs: dict, microbatches: int, what: str) -> tuple[list[tuple], list[dict]]:
    """Microbatches as ``torch.distributed.pipelining`` makes them (dim 0 of every tensor); equal sizes required."""
    try:
        arg_chunks, kwarg_chunks = split_args_kwargs_into_chunks(args, kwargs, microbatches)
    except Exception as error:
        raise ValueError(f"the {what} do not split into {microbatches} microbatches: {error}") from error
    first_shapes = [tuple(t.shape) for t in tensors_in((arg_chunks[0], kwarg_chunks[0]))]
    for index, chunk in enumerate(zip(arg_chunks, kwarg_chunks)):
        shapes = [tuple(t.shape) for t in tensors_in(chunk)]
        if shapes != first_shapes:
            raise ValueError(
                f"the {what} split into microbatches of different shapes (microbatch 0: {first_shapes}, microbatch "
                f"{index}: {shapes}); give a batch whose dim 0 is a multiple of microbatches={microbatches}"
            )
    return list(arg_chunks), list(kwarg_chunks)


def tensors_in(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
