"""FLOPs per unit, as torch's FLOP counter (``torch.utils.flop_counter``) counts them: ``ForwardFlops`` counts them in
the tracked step's forward (``trace.py``) without the counter's module tracker, and ``flop_counter`` is the counter
with attention over grouped-query keys and values counted where torch's own formula refuses them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode, flop_registry

if TYPE_CHECKING:
    from typing_extensions import Self  # a dependency of torch's


class ForwardFlops:
    """FLOPs per unit of the tracked step's forward, counted as it runs (no forward of their own): torch's counter
    (``flop_counter``) without its module tracker, whose hooks on module outputs' gradients would be part of the step
    the tracker measures. Entered before (under) the tracker, so that the tracker sees each op as the step runs it;
    ``stop`` ends the count where the forward ends (the loss and backward are not a unit's)."""

    def __init__(self) -> None:
        self.counter = flop_counter()
        self.counter.mod_tracker = _NoModules()
        self.mode = _CountUntilStopped(self.counter)
        self.marks: list[tuple[int, int]] = []
        self.end: int | None = None

    def __enter__(self) -> Self:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)

    def mark(self, unit: int) -> None:
        if self.end is None:
            self.marks.append((unit, self.counter.get_total_flops()))

    def stop(self) -> None:
        self.end = self.counter.get_total_flops()
        self.mode.stopped = True

    def per_unit(self, num_units: int) -> list[int]:
        flops = [0] * num_units
        ends = [total for _, total in self.marks[1:]] + [self.end if self.end is not None else 0]
        for (unit, began), ended in zip(self.marks, ends):
            flops[unit] += ended - began
        return flops


class _CountUntilStopped(_FlopCounterMode):
    """torch's counting mode, which lets every op through untouched once stopped (backward: no decompositions tried,
    no formulas run)."""

    def __init__(self, counter: FlopCounterMode) -> None:
        super().__init__(counter)
        self.stopped = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.stopped:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _NoModules:
    """What ``FlopCounterMode`` reads of its module tracker: every count goes to "Global" (its total)."""

    def __init__(self) -> None:
        self.parents = {"Global"}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def flop_counter() -> FlopCounterMode:
    """torch's FLOP counter, with attention over grouped-query keys and values counted where torch's own formula
    refuses them (torch 2.11: "query/key/value shapes are incompatible" for SDPA with ``enable_gqa``, which fails the
    trace of every GQA decoder on CUDA): the keys and values are counted as repeated to the query's heads, as the
    kernel computes them (torch 2.13's formula counts them so)."""
    mapping = {op: _grouped_query_tolerant(formula) for op, formula in flop_registry.items()
               if "attention" in str(op) and "flex" not in str(op)}
    return FlopCounterMode(display=False, custom_mapping=mapping)


def _grouped_query_tolerant(formula: Callable[..., int]) -> Callable[..., int]:
    def counted(*args: Any, **kwargs: Any) -> int:
        try:
            return formula(*args, **kwargs)
        except AssertionError:
            # the first query, key, value: 4-D tensors in a row (forward: args 0-2; backward: after the gradient)
            start = next((i for i in range(len(args) - 2) if all(
                isinstance(a, torch.Tensor) and a.dim() == 4 for a in args[i:i + 3])), None)
            if start is None:
                raise
            query, key, value = args[start:start + 3]
            heads = query.shape[1]
            if key.shape[1] == 0 or heads % key.shape[1]:
                raise
            repeated = [torch.Size((t.shape[0], heads, *t.shape[2:])) for t in (key, value)]
            return formula(*args[:start + 1], *repeated, *args[start + 3:], **kwargs)  # shapes stand for tensors

    counted._get_raw = True  # type: ignore[attr-defined]  # the registry's formula takes the raw call already
    return counted
