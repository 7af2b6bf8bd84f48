"""Whether the training loop still holds the optimized module's output when backward reaches it.

A plan counts the model's output either alive through backward and the optimizer step (``TrainingLoop.output_held``,
the default) or gone before backward (Hugging Face's ``Trainer``, torchtitan's ``del pred``,
``model(**batch).loss.backward()``). The loop the user runs decides which is true, so the optimized module checks
it on its first steps: a gradient hook on each output tensor fires when backward reaches it, and weak references tell
whether the caller still holds the tensor then. The hooks hold no tensor; after ``CHECKED_STEPS`` steps, or once the
difference is reported, no hook is registered any more.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autockpt.units import format_bytes

logger = logging.getLogger(__name__)

CHECKED_STEPS = 3  # a loop's first steps show its shape; later ones run without hooks
_UNWATCHED = contextvars.ContextVar("autockpt_unwatched_steps", default=False)


@contextlib.contextmanager
def unwatched_steps() -> Iterator[None]:
    """autockpt's own steps of an optimized module (verifying, timing): not the user's loop, so not checked."""
    token = _UNWATCHED.set(True)
    try:
        yield
    finally:
        _UNWATCHED.reset(token)


class OutputWatch:
    """Compares the loop's handling of the output with ``output_held`` (the plan's loop) and says so once."""

    def __init__(self, output_held: bool) -> None:
        self.output_held = output_held
        self.steps_left = CHECKED_STEPS
        self.reported: str | None = None  # the message logged, once

    def watch(self, output: Any) -> None:
        """Register the check on this step's output (nothing under ``torch.compile``, or once done)."""
        # first: under torch.compile Dynamo reads it as True and traces nothing else here (a ContextVar breaks graphs)
        if torch.compiler.is_compiling() or self.steps_left <= 0 or self.reported is not None or _UNWATCHED.get():
            return
        # a loss returned beside the output (a Hugging Face model given labels) is what the loop keeps: 0-dim
        # tensors are left out
        tensors = [
            leaf for leaf in pytree.tree_leaves(output)
            if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None and leaf.dim() > 0
        ]
        if not tensors:
            return
        self.steps_left -= 1
        references = [(weakref.ref(t), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors]
        checked = [False]

        def at_backward(_gradient: torch.Tensor | None) -> None:
            if checked[0]:
                return
            checked[0] = True
            alive = {pointer: nbytes for reference, pointer, nbytes in references if reference() is not None}
            self._compare(sum(alive.values()), sum({p: n for _, p, n in references}.values()))

        for tensor in tensors:
            tensor.register_hook(at_backward)

    def _compare(self, alive_bytes: int, output_bytes: int) -> None:
        if self.output_held and alive_bytes == 0:
            self.reported = (
                f"autockpt: the training loop drops the model's output before backward, while the plan holds it "
                f"through the step: the budget is kept with room to spare. A plan made with output_held=False "
                f"(PlanOptions, or the keyword of autockpt.optimize) counts up to {format_bytes(output_bytes)} less "
                "(the output, less what backward keeps of it) and so recomputes less."
            )
            logger.warning("%s", self.reported)
        elif not self.output_held and alive_bytes > 0:
            self.reported = (
                f"autockpt: the plan was made for a loop that drops the model's output before backward "
                f"(output_held=False), but {format_bytes(alive_bytes)} of it are still held when backward starts: "
                f"the step can go over the budget by up to {format_bytes(alive_bytes)}. Drop the output before "
                "backward (keep only the loss), or plan with output_held=True."
            )
            logger.warning("%s", self.reported)
