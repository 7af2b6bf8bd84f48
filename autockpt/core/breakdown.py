"""Breakdown: one moment of a predicted step -> its bytes by category (``record_types.MemoryBreakdown``).

It reads the simulator's memory curve (``simulate.memory_curve``: per event, parameters/buffers/inputs, gradients so
far, recomputed copies, forward tensors alive, the rest; the same columns ``planning/estimate.py`` reads at the peak)
and splits three of its columns further, from the trace alone:

* parameters | buffers and inputs: the trace's parameter bytes, the rest of that column;
* forward tensors alive -> logits and loss | activations (``logits_storages`` below says which storages are the
  logits);
* the rest -> optimizer states (the trace's, alive through the step) | other device memory (``foreign_bytes``) |
  temporaries (backward temporaries, activation gradients, ``optimizer.step()``'s own).

Each part is capped by what is left of the event's bytes, in that order, so the categories add up to the event's
predicted bytes exactly (at the peak: the plan's predicted peak).

**The logits.** The model's output and what the loss makes from it in forward, found from the storages' lives:

* the model's output: what the units of the graph make that is still alive when the step ends (the caller holds the
  output through backward; ``StorageLife.free_event`` None). For a language model the largest of these is its logits;
* what comes after it: everything the units from the largest output storage's producer on make (a loss computed
  inside the model, as Hugging Face models do when given labels: the upcast logits, the log-softmax, the loss);
* the loss function's own forward: what is made outside the graph's units in the loss's forward event (a ``loss_fn``
  given to the planner).

The gradient of the logits (made in backward) is a temporary. No plan changes when these storages live: a region
never frees the output (alive to the end) nor touches what the loss makes, so the same storages are the logits of
every plan of a trace.
"""

from __future__ import annotations

from autockpt.record_types import MemoryBreakdown
from autockpt.types import OUTSIDE_GRAPH_UNIT, MemoryCurve, Phase, StepTrace, StorageLife


def logits_storages(trace: StepTrace) -> tuple[StorageLife, ...]:
    """The storages of the model's output and of what the loss makes from it in forward (the module's docstring)."""
    outputs = [s for s in trace.storages if s.free_event is None and s.producer_unit >= 0]
    first_loss_unit = max(outputs, key=lambda s: (s.nbytes, -s.index)).producer_unit if outputs else None
    return tuple(
        s for s in trace.storages
        if (s.producer_unit >= 0 and (s.free_event is None or (
            first_loss_unit is not None and s.producer_unit >= first_loss_unit)))
        or (s.producer_unit == OUTSIDE_GRAPH_UNIT and _in_loss_forward(trace, s))
    )


def _in_loss_forward(trace: StepTrace, storage: StorageLife) -> bool:
    """Made by the loss function in forward (the forward event outside the graph), not by autocast's cache while a
    unit ran."""
    event = trace.events[storage.alloc_event]
    return event.phase is Phase.FORWARD and event.unit == OUTSIDE_GRAPH_UNIT


def logits_bytes_at(trace: StepTrace, event: int) -> int:
    """Bytes of the logits storages alive at ``event``."""
    last = len(trace.events) - 1
    return sum(
        s.nbytes for s in logits_storages(trace)
        if s.alloc_event <= event <= (s.free_event if s.free_event is not None else last)
    )


def peak_event(curve: MemoryCurve) -> int:
    """The first event at the curve's highest bytes (as ``simulate`` picks the peak event)."""
    totals = curve.total_bytes
    return max(range(len(totals)), key=totals.__getitem__)


def memory_breakdown(trace: StepTrace, curve: MemoryCurve, event: int | None = None) -> MemoryBreakdown:
    """``curve`` (``simulate.memory_curve`` of ``trace`` under some plan) at ``event`` (default: its peak) by category;
    the categories add up to ``curve.total_bytes[event]``."""
    event = peak_event(curve) if event is None else event
    static = curve.parameter_bytes[event]  # parameters, buffers and inputs, as the curve capped them
    parameters = min(trace.parameter_bytes, static)
    forward = curve.activation_bytes[event]
    logits = min(logits_bytes_at(trace, event), forward)
    rest = curve.temporary_bytes[event]
    states = max(0, min(trace.optimizer_state_bytes, rest))
    other = max(0, min(trace.foreign_bytes, rest - states))
    return MemoryBreakdown(
        event=event,
        phase=curve.phases[event],
        parameter_bytes=parameters,
        gradient_bytes=curve.gradient_bytes[event],
        optimizer_state_bytes=states,
        buffer_and_input_bytes=static - parameters,
        activation_bytes=forward - logits,
        logits_bytes=logits,
        recomputed_bytes=curve.recomputed_bytes[event],
        other_device_bytes=other,
        temporary_bytes=rest - states - other,
    )
