"""The FSDP2 root unit's loss in chunks (issue 48): the output projection the root runs (the lm_head lives there) and
the chunks of tokens its cross-entropy may be computed in, found from the single-device capture of the step.

The projection is found from the graph, never from names: the projection of the loss tail inside the model
(``measure.loss_tail.find_loss_tail``: Hugging Face's ``*ForCausalLM`` given labels), else the projection whose output
the model returns (``returned_projection``: a loss in the user's ``loss_fn``, torchtitan's style). It must be an
``nn.Linear`` run by the root unit (inside no other unit), since the ranks run the root's forward eagerly: there
``runtime/logits_standin.py`` makes it return a stand-in for the logits that the cross-entropy computes in chunks.
The chunks weighed are the single-device planner's (``planning.loss_chunks.chunks_for``); the FSDP planner measures
each on the fake process group and keeps the fastest plan under the budget (``fsdp/plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import fx, nn

from autockpt.measure.loss_tail import find_loss_tail, returned_projection
from autockpt.planning.loss_chunks import NOT_CHUNKED, chunks_for, traced_logits


@dataclass(frozen=True, kw_only=True, slots=True)
class RootLoss:
    projection: str  # the projection's module path ("" where there is none to chunk)
    chunk_tokens: tuple[int, ...]  # the chunks weighed, largest first (none: not chunked)
    extra_ms: float  # the projection's forward: what a chunked loss adds (its logits made again in backward)
    note: str  # why the loss is not chunked, where one might expect it to be ("" otherwise)
    fixed: bool = False  # the chunk was given (``loss_chunk_tokens=N``): the loss as the model computes it is not weighed


NONE = RootLoss(projection="", chunk_tokens=(), extra_ms=0.0, note="")


def root_loss(model: nn.Module, planner: Any, units: tuple[str, ...], option: int | str) -> RootLoss:
    """The root's projection and the chunks weighed for its loss under ``PlanOptions.loss_chunk_tokens``
    (``option``), from ``planner`` (the single-device ``Planner`` of the step, captured with the loss)."""
    graph = planner.graph
    if option == 0 or not isinstance(graph.executable, fx.GraphModule):
        return NONE
    search = find_loss_tail(graph)
    node = returned_projection(graph.executable) if search.tail is None else None
    name = search.tail.projection if search.tail is not None else node.name if node is not None else None
    if name is None:
        return NONE  # no projection's output reaches a loss or the output: nothing to say
    index = next(i for i, unit in enumerate(graph.units) if unit.name == name)
    path = graph.units[index].module_path
    module = model.get_submodule(path) if path else None
    if not isinstance(module, nn.Linear):
        return _not_chunked(f"the output projection ({name}) is not an nn.Linear module's call")
    owner = next((u for u in units if u and (path == u or path.startswith(u + "."))), None)
    if owner is not None:
        return _not_chunked(f"the output projection {path} runs in the unit {owner}, not in the root")
    tokens, logits_bytes = traced_logits(graph, planner.trace, index, module.weight)
    chunks = chunks_for(tokens, logits_bytes, option, planner.trace.baseline_peak_bytes)
    return RootLoss(projection=path, chunk_tokens=chunks, extra_ms=planner.trace.units[index].forward_ms, note="",
                    fixed=option != "auto")


def _not_chunked(reason: str) -> RootLoss:
    return RootLoss(projection="", chunk_tokens=(), extra_ms=0.0, note=f"{NOT_CHUNKED}: {reason}")
