"""The last pipeline stage planned together with its loss, so that the loss may run in chunks (issue 48).

``torch.distributed.pipelining`` computes the loss outside the stage module (``loss_fn(output, target)`` in the
schedule), so a stage captured alone returns the full logits and no planner can chunk the loss that reads them.
autockpt builds the schedule itself (``pipeline_schedule``), so where the last stage returns a projection's output
(``measure.loss_tail.returned_projection``) it plans the stage and the user's ``loss_fn`` as one module,
``StageWithLoss(received, target) -> loss``: the single-device planner then finds the loss tail in its capture and
weighs the chunked programs beside the captured one (``planning/loss_chunks.py``), under the stage's budget.

At run time the ``PipelineStage`` on the last rank runs ``ReceivedAsOutput``: its forward returns what the rank
received, and the schedule's loss function (``ReceivedAsOutput.loss``) runs the planned stage-and-loss module on it
and the target. Backward starts from that loss (``torch.autograd.backward``: every leaf it reaches accumulates its
gradient, the head's weight included) and the gradients of the received tensors go back to the previous rank as
before. The outputs the schedule returns (``return_outputs``) are then the tensors the last rank received (the
hidden states), not the logits: the plan's notes say so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autockpt.errors import CaptureError, ProfileError
from autockpt.planning.loss_chunks import NOT_CHUNKED
from autockpt.planning.options import PlanOptions
from autockpt.planning.planner import Planner
from autockpt.runtime.model_state import share_registries

logger = logging.getLogger(__name__)

OUTPUTS_NOTE = (
    "last stage: planned with its loss_fn, so the schedule's loss function runs the stage (step(..., losses=) gives "
    "the losses as before); the outputs the schedule returns (return_outputs) are the tensors the last rank "
    "receives, not the model's output"
)


class StageWithLoss(nn.Module):
    """The last stage and the user's loss as one module: ``forward(received, target)`` is
    ``loss_fn(stage(*received), target)``."""

    def __init__(self, stage: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.stage = stage
        self.loss_fn = loss_fn

    def forward(self, received: tuple[torch.Tensor, ...], target: Any) -> torch.Tensor:
        return self.loss_fn(self.stage(*received), target)


class ReceivedAsOutput(nn.Module):
    """The module the last rank's ``PipelineStage`` runs when its plan holds the loss: the forward returns what the
    rank received; ``loss`` (the schedule's loss function) runs the planned stage and loss on it. Its parameters and
    buffers are the stage module's own registries, as an ``OptimizedModule``'s are the model's: under the model's
    names (``stage.submod.state_dict()`` keys), the ones this rank's optimizer steps."""

    def __init__(self, stage: nn.Module, with_loss: nn.Module) -> None:
        super().__init__()
        share_registries(self, stage)
        self.__dict__["with_loss"] = with_loss  # a plain attribute: the state is exactly the stage's

    def forward(self, *received: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return received

    def loss(self, received: Any, target: Any) -> torch.Tensor:
        return self.with_loss(tuple(received) if isinstance(received, (tuple, list)) else (received,), target)


def the_output(output: torch.Tensor) -> torch.Tensor:
    """The loss of a ``StageWithLoss`` step: its output is the loss."""
    return output


def planner_with_loss(
    stage: nn.Module, received: tuple[torch.Tensor, ...], target: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
    options: PlanOptions,
) -> tuple[Planner | None, str]:
    """The planner of the last stage and its loss as one program, or None and why the loss is not chunked (the two
    not captured together, no loss tail in the capture, or logits too small to matter under
    ``loss_chunk_tokens="auto"``): the stage is then planned alone, as before, and keeps returning its output."""
    try:
        planner = Planner.from_model(
            StageWithLoss(stage, loss_fn), example_inputs=(tuple(received), target), loss_fn=the_output,
            options=options,
        )
    except (CaptureError, ProfileError) as error:  # a loss_fn only eager Python runs: the stage alone, as before
        logger.info("the last stage is planned without its loss: %s", error)
        return None, f"{NOT_CHUNKED}: the last stage and loss_fn could not be captured together ({error})"
    if planner.loss_programs is None and not planner.loss_chunk_tokens:
        said = [note for note in planner.notes if note.startswith(NOT_CHUNKED)]
        return None, said[0] if said else f"{NOT_CHUNKED}: the logits are a negligible share of the stage's step"
    return planner, ""


def runs_with_loss(planner: Planner) -> bool:
    """Whether this stage planner plans the last stage together with its loss (``planner_with_loss``)."""
    return isinstance(planner.model, StageWithLoss)


def received_tensors(planner: Planner) -> list[torch.Tensor]:
    """The tensors a stage-and-loss planner's step receives (its first input): what the schedule returns as the
    last stage's output."""
    return [leaf for leaf in pytree.tree_leaves(planner.request.args[0]) if isinstance(leaf, torch.Tensor)]
