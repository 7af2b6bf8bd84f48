"""The captured graph with its loss tail computed in chunks (issue 48's action, ``Action``-free: the planner chooses the
chunk as a property of the program, ``Plan.loss_chunk_tokens``).

``with_chunked_loss(graph, tail, chunk_tokens)`` returns a copy of the captured graph in which the projection, the ops
between it and the cross-entropy (upcast, soft-capping, views) and the cross-entropy are one call of
``chunked_linear_cross_entropy`` on the projection's input, its weight (and bias) and the cross-entropy's labels.
Everything else is the captured graph's own node for node, so the trace of the result is as exact as any trace, and
the rewrite outlines regions in it as in any graph. What the loss did after the cross-entropy (Hugging Face's division
by ``num_items_in_batch``) stays as captured: the chunked loss gives the same sum or mean the cross-entropy gave.

The full logits are never made, so a model output that held them (``CausalLMOutput.logits``) holds None in a training
step: ``ChunkedTail.logits_dropped`` says so, and the plan's notes. Evaluation without gradients runs the model itself
(``OptimizedModule``), logits included.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from torch import fx, nn

from autockpt.errors import PlanMismatchError
from autockpt.measure.capture import capture, graph_units
from autockpt.measure.loss_tail import LossTail, find_loss_tail
from autockpt.runtime.chunked_loss import chunked_linear_cross_entropy
from autockpt.types import CaptureKind, Graph

_EXPORT_PREFIX = "model."  # as capture's: the export wrapper holds the user's model as `.model`


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ChunkedTail:
    graph: Graph
    chunk_tokens: int
    logits_dropped: bool  # the model's output held the full logits; the chunked program returns None there


def with_chunked_loss(graph: Graph, tail: LossTail, chunk_tokens: int) -> ChunkedTail:
    """A copy of ``graph`` whose loss tail (``measure.loss_tail.find_loss_tail``) runs in chunks of ``chunk_tokens``
    tokens; ``graph`` itself is left as it is (its executable shares the model's parameters, as the copy does)."""
    if not isinstance(graph.executable, fx.GraphModule):
        raise TypeError("a loss tail is chunked in a captured graph (fx or export), not a module-level capture")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    executable = copied_graph(graph).executable
    assert isinstance(executable, fx.GraphModule)
    nodes = {node.name: node for node in executable.graph.nodes}
    projection, loss = nodes[tail.projection], nodes[tail.loss]
    hidden = projection.args[0] if projection.args else projection.kwargs["input"]
    labels = loss.args[1] if len(loss.args) > 1 else loss.kwargs["target"]
    with executable.graph.inserting_before(loss):
        weight, bias = _weight_and_bias(executable, projection, tail)
        chunked = executable.graph.call_function(
            chunked_linear_cross_entropy, (hidden, weight, labels),
            {"bias": bias, "chunk_tokens": int(chunk_tokens), "ignore_index": tail.ignore_index,
             "reduction": tail.reduction, "softcap": tail.softcap, "upcast": tail.upcast},
        )
    chunked.meta = {key: value for key, value in loss.meta.items() if key in ("nn_module_stack", "stack_trace")}
    loss.replace_all_uses_with(chunked)
    chain = _chain(projection, loss)
    dropped = _drop_from_output(executable.graph, chain)
    executable.graph.erase_node(loss)
    for node in reversed(list(executable.graph.nodes)):  # newest first: a node's readers are gone before it
        if node in chain and not node.users:  # the old tail, and the checks of its metadata (export's)
            executable.graph.erase_node(node)
    executable.graph.lint()
    executable.recompile()
    prefix = _EXPORT_PREFIX if graph.kind is CaptureKind.EXPORT else ""
    note = (
        f"loss: the output projection and cross-entropy run in chunks of {chunk_tokens} tokens"
        + ("; the training step's output holds no logits (None), which the chunked loss never makes in full"
           if dropped else "")
    )
    program = dataclasses.replace(
        graph, executable=executable, units=graph_units(executable, module_prefix=prefix),
        notes=(*graph.notes, note),
    )
    return ChunkedTail(graph=program, chunk_tokens=int(chunk_tokens), logits_dropped=dropped)


def _weight_and_bias(executable: fx.GraphModule, projection: fx.Node, tail: LossTail) -> tuple[Any, Any]:
    """The projection's weight and bias as nodes: its own arguments (``linear``), or the attributes of the
    ``nn.Linear`` it calls (an fx capture's ``call_module``), read where the chunked call is inserted."""
    if projection.op == "call_module":
        path = str(projection.target)
        weight = executable.graph.get_attr(f"{path}.weight")
        return weight, executable.graph.get_attr(f"{path}.bias") if tail.has_bias else None
    weight = projection.args[1] if len(projection.args) > 1 else projection.kwargs["weight"]
    bias = projection.args[2] if len(projection.args) > 2 else projection.kwargs.get("bias")
    return weight, bias


def captured_program(model: nn.Module, args: tuple, kwargs: dict, loss_chunk_tokens: int) -> Graph:
    """``model`` captured on these inputs as the program a plan was made for: its loss in chunks of
    ``loss_chunk_tokens`` tokens (``Plan.loss_chunk_tokens``; 0: as captured)."""
    graph = capture(model, args, kwargs)
    return chunked_graph(graph, loss_chunk_tokens) if loss_chunk_tokens else graph


def chunked_graph(graph: Graph, chunk_tokens: int) -> Graph:
    """``graph`` with its loss in chunks of ``chunk_tokens`` tokens, as the plan that recorded that chunk was made."""
    search = find_loss_tail(graph)
    if search.tail is None:
        raise PlanMismatchError(
            f"the plan computes the loss in chunks of {chunk_tokens} tokens, but this model's captured graph has no "
            f"loss tail to chunk ({search.reason}); plan this model again"
        )
    return with_chunked_loss(graph, search.tail, chunk_tokens).graph


def copied_graph(graph: Graph) -> Graph:
    """``graph`` with an executable of its own (the fx graph copied, the parameters shared): a rewrite of one leaves
    the other as it is."""
    gm = graph.executable
    assert isinstance(gm, fx.GraphModule)
    executable = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    executable.meta.update(gm.meta)
    # fx registers every tensor attribute the graph reads as a buffer of the copy: the constants export lifted
    # (plain attributes of the exported module: a Gemma 2 attention's int64 scalars) became buffers, which
    # MemTracker counts with the module's state and a trace does not (8 bytes over the prediction); plain again
    buffers = {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    for name, tensor in list(executable.named_buffers(remove_duplicate=False)):
        if name not in buffers:
            path, _, field = name.rpartition(".")
            owner = executable.get_submodule(path) if path else executable
            del owner._buffers[field]
            setattr(owner, field, tensor)
    return dataclasses.replace(graph, executable=executable)


def _chain(projection: fx.Node, loss: fx.Node) -> set[fx.Node]:
    """The nodes from the projection to the loss's input (the projection included): what the chunked call replaces."""
    found, frontier = set(), [projection]
    while frontier:
        node = frontier.pop()
        if node in found or node is loss:
            continue
        found.add(node)
        frontier.extend(user for user in node.users if user.op != "output")
    return found


def _drop_from_output(graph: fx.Graph, chain: set[fx.Node]) -> bool:
    """None where the model's output held a node of the chain (the logits); whether any was."""
    output = next(node for node in graph.nodes if node.op == "output")
    dropped = False

    def replaced(value: Any) -> Any:
        nonlocal dropped
        if isinstance(value, fx.Node) and value in chain:
            dropped = True
            return None
        return value

    output.args = fx.node.map_aggregate(output.args, replaced)
    return dropped
