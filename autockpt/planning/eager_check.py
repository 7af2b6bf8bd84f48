"""The self-check: the captured program's unmodified step against the user's eager model's, both measured.

autockpt plans the program it captured; the reference is the model as the user runs it. Where the trace is measured
(a real step ran) and the capture is an export (where libraries see traced tensors; fx runs the model's own Python
and the module level the model itself), the eager model's forward + backward is measured too, beside the captured
program's, with the same counter (``measure_step``: MemTracker on CPU, ``max_memory_allocated`` on CUDA) and the same loss. A captured
program above the eager model by more than ``TOLERANCE`` is warned about, naming the difference and its likely cause
(a library's course under tracing that ``measure/eager_paths.py`` does not reach); the plan records both peaks
(``Provenance.eager_peak_bytes``, ``captured_peak_bytes``) and its summary shows them.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from autockpt.measure.sources import StepInputs
from autockpt.measure.step import measure_step
from autockpt.runtime.model_state import cuda_devices_of
from autockpt.types import CaptureKind, Graph
from autockpt.units import format_bytes

logger = logging.getLogger(__name__)

TOLERANCE = 0.005  # the captured program may hold at most 0.5 % more than the eager model


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EagerComparison:
    eager_peak_bytes: int  # the user's model, unmodified, forward + backward
    captured_peak_bytes: int  # the captured program, unmodified, forward + backward
    warning: str | None  # set when the captured program holds more than the tolerance over the eager model


def compare_with_eager(step: StepInputs, graph: Graph, traced_peak_bytes: int | None) -> EagerComparison | None:
    """Both unmodified steps on the example inputs (gradients set to None before each; the caller keeps the model's
    state): the eager model's measured, the captured program's from the measured trace (``traced_peak_bytes``, its
    forward + backward alone) or, where the trace covers a loop around them (None), measured too. None unless the
    capture is an export: one or two more real steps per plan, spent where libraries see traced tensors."""
    if graph.kind is not CaptureKind.EXPORT:  # fx traces torch-level calls of the model's own code; module level
        return None  # runs the model itself: the export path is where libraries see traced tensors
    eager = _measured_peak(step, step.model)
    captured = traced_peak_bytes if traced_peak_bytes is not None else _measured_peak(step, graph.executable)
    warning = None
    if captured > eager * (1 + TOLERANCE):
        warning = (
            f"the captured program's unmodified step holds {format_bytes(captured - eager)} more than the eager "
            f"model's ({100 * (captured / eager - 1):+.1f} %: {format_bytes(captured)} against "
            f"{format_bytes(eager)}); every prediction starts from it. Cause: {_likely_cause(graph)}"
        )
        logger.warning("autockpt: %s", warning)
    return EagerComparison(eager_peak_bytes=eager, captured_peak_bytes=captured, warning=warning)


def _measured_peak(step: StepInputs, program: torch.nn.Module) -> int:
    for parameter in step.model.parameters():
        parameter.grad = None
    with torch.random.fork_rng(devices=cuda_devices_of(step.args, step.kwargs, list(step.model.parameters()))):
        peak = measure_step(program, step.args, step.kwargs, step.loss).peak_bytes
    for parameter in step.model.parameters():
        parameter.grad = None
    return peak


def _likely_cause(graph: Graph) -> str:
    not_eager = [note for note in graph.notes if note.startswith("export on eager library paths not used")]
    if not_eager:
        return f"the model could not be exported on its libraries' eager course ({not_eager[0]})"
    return (
        "a library takes another course when it sees a traced tensor (materialised masks, repeated heads) that "
        "autockpt does not reach (measure/eager_paths.py names the libraries it reaches)"
    )
