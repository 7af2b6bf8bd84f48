"""The loss tail of a captured step, found from the graph alone (issue 48, item 2; no plan acts on it yet): a projection
(``linear`` or a call of an ``nn.Linear``; tied or not; with or without bias) whose output reaches one cross-entropy
through ops that act on each logit alone (a float upcast, Gemma's soft-capping ``tanh(x / c) * c``, views), with the
reduction, ``ignore_index`` and a Hugging Face ``num_items_in_batch`` divisor read from the graph. That tail is what
``runtime/chunked_loss.py`` computes in chunks; where the graph has none, or one that cannot be chunked exactly (the
logits read by anything but the loss, a per-token loss, class weights or label smoothing, a loss outside the model),
``LossTailSearch.reason`` says why.

Never from model names: the ops and their arguments decide. The model's output may hold the full logits too (Hugging
Face's ``CausalLMOutput.logits``): ``LossTail.logits_returned`` says so, since chunking then saves only what the loss
makes from them.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from autockpt.types import Graph

# readers of a value's metadata only (export's checks, shape queries): not readers of its values
_IGNORED_USERS = ("_assert_tensor_metadata", "size", "dim", "sym_size")
_VIEWS = ("view", "reshape", "_unsafe_view", "contiguous", "alias", "clone", "flatten")
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


@dataclass(frozen=True, kw_only=True, slots=True)
class LossTail:
    """One projection and the cross-entropy of its output, chunkable exactly. Node names are the captured graph's."""

    projection: str  # the projection's node
    weight: str  # the projection weight's path in the captured module ("model.lm_head.weight")
    has_bias: bool
    loss: str  # the cross-entropy's node
    vocabulary: int
    tokens: int  # rows of the logits the loss reads (0 where the capture records no shapes: fx)
    softcap: float | None  # tanh(z / c) * c between the projection and the loss
    upcast: bool  # the logits reach the loss in float32 from a lower precision (Hugging Face's loss upcasts)
    reduction: str  # "mean" or "sum"
    ignore_index: int
    divisor: str | None  # the node the summed loss is divided by (Hugging Face's num_items_in_batch), if any
    logits_returned: bool  # the model's output also holds the logits (full size, whatever the loss does)
    logits_bytes: int  # the logits as the loss reads them, after the upcast (0 where the capture records no shapes)


@dataclass(frozen=True, kw_only=True, slots=True)
class LossTailSearch:
    tail: LossTail | None
    reason: str  # why there is no chunkable tail ("" when there is one)


def find_loss_tail(graph: Graph) -> LossTailSearch:
    """The loss tail of ``graph`` (a capture of the model's forward), or why there is none."""
    executable = graph.executable
    if not isinstance(executable, fx.GraphModule):
        return LossTailSearch(tail=None, reason="captured at module level: no graph to read the loss from")
    losses = [n for n in executable.graph.nodes if _is_cross_entropy(executable, n)]
    if not losses:
        return LossTailSearch(tail=None, reason=(
            "no cross-entropy in the captured graph: the loss is outside the model (loss_fn), or not a cross-entropy"
        ))
    if len(losses) > 1:
        return LossTailSearch(tail=None, reason=f"{len(losses)} cross-entropies in the graph: which to chunk is not clear")
    return _tail_of(executable, losses[0])


def returned_projection(executable: fx.GraphModule) -> fx.Node | None:
    """The projection whose output the graph returns as it is or through ops on each logit alone (upcast,
    soft-capping, views): the logits a loss outside the graph may read, so a loss that could be chunked once the two
    are captured together (the last pipeline stage and its loss function); None where the output holds none."""
    output = next(node for node in executable.graph.nodes if node.op == "output")
    returned: list[fx.Node] = []
    fx.node.map_arg(output.args, returned.append)
    for node in returned:
        while node is not None and not _is_projection(executable, node):
            step = _step_back(node)
            node = step[0] if step is not None else None
        if node is not None and _weight_of(executable, node)[0] is not None:
            return node
    return None


def _tail_of(executable: fx.GraphModule, loss: fx.Node) -> LossTailSearch:
    logits, reduction, ignore_index, refused = _cross_entropy_arguments(loss)
    if refused:
        return LossTailSearch(tail=None, reason=refused)
    softcap, upcast, returned = None, False, False
    node = logits
    while not _is_projection(executable, node):
        readers = _readers(node)
        if any(r.op == "output" for r in readers):
            returned = True
        others = [r for r in readers if r.op != "output"]
        if len(others) != 1:
            return LossTailSearch(tail=None, reason=(
                f"the logits ({node.name}) are read by {len(others)} ops besides the model's output: a loss that reads "
                "the full logits (an auxiliary term) cannot be chunked exactly"
            ))
        step = _step_back(node)
        if step is None:
            return LossTailSearch(tail=None, reason=(
                f"{node.name} ({_op_name(node)}) lies between the projection and the loss and does not act on each "
                "logit alone"
            ))
        node, kind, value = step
        if kind == "upcast":
            upcast = True
        elif kind == "softcap":
            softcap = value
    projection = node
    readers = [r for r in _readers(projection) if r.op != "output"]
    returned = returned or any(r.op == "output" for r in _readers(projection))
    if len(readers) != 1:
        return LossTailSearch(tail=None, reason=f"the projection's output ({projection.name}) is read besides the loss")
    weight, has_bias = _weight_of(executable, projection)
    if weight is None:
        return LossTailSearch(tail=None, reason=f"the projection {projection.name} does not read a parameter as weight")
    vocabulary = int(executable.get_parameter(weight).shape[0])
    value = logits.meta.get("val")  # an fx capture records no values: its tokens and bytes are not known here (0)
    tokens = int(value.numel() // vocabulary) if isinstance(value, torch.Tensor) else 0
    divisor = _divisor(loss) if reduction == "sum" else None
    return LossTailSearch(tail=LossTail(
        projection=projection.name, weight=weight, has_bias=has_bias, loss=loss.name, vocabulary=vocabulary,
        tokens=tokens, softcap=softcap, upcast=upcast, reduction=reduction, ignore_index=ignore_index,
        divisor=divisor, logits_returned=returned,
        logits_bytes=int(value.numel() * value.element_size()) if isinstance(value, torch.Tensor) else 0,
    ), reason="")


def _cross_entropy_arguments(loss: fx.Node) -> tuple[fx.Node, str, int, str]:
    """(logits, reduction, ignore_index, why it cannot be chunked or "") of a cross-entropy node."""
    names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    given = dict(zip(names, loss.args)) | dict(loss.kwargs)
    logits = given["input"]
    reduction = given.get("reduction", 1)
    reduction = _REDUCTIONS.get(reduction, reduction) if isinstance(reduction, int) else reduction or "mean"
    if given.get("size_average") is not None or given.get("reduce") is not None:
        return logits, reduction, -100, "the cross-entropy uses the deprecated size_average / reduce arguments"
    if reduction not in ("mean", "sum"):
        return logits, reduction, -100, f"the cross-entropy's reduction is {reduction!r}: a per-token loss"
    if given.get("weight") is not None:
        return logits, reduction, -100, "the cross-entropy weighs its classes"
    if given.get("label_smoothing", 0.0):
        return logits, reduction, -100, "the cross-entropy smooths its labels"
    return logits, reduction, int(given.get("ignore_index", -100)), ""


def _is_cross_entropy(executable: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "call_function" and (
        node.target is torch.ops.aten.cross_entropy_loss.default or node.target is nn.functional.cross_entropy
    ) or node.op == "call_module" and isinstance(executable.get_submodule(str(node.target)), nn.CrossEntropyLoss)


def _is_projection(executable: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in (torch.ops.aten.linear.default, nn.functional.linear)
    return node.op == "call_module" and isinstance(executable.get_submodule(str(node.target)), nn.Linear)


def _weight_of(executable: fx.GraphModule, projection: fx.Node) -> tuple[str | None, bool]:
    if projection.op == "call_module":
        module = executable.get_submodule(str(projection.target))
        return f"{projection.target}.weight", module.bias is not None
    weight = projection.args[1] if len(projection.args) > 1 else projection.kwargs.get("weight")
    bias = projection.args[2] if len(projection.args) > 2 else projection.kwargs.get("bias")
    if not isinstance(weight, fx.Node) or weight.op != "get_attr":
        return None, False
    return str(weight.target), bias is not None


def _step_back(node: fx.Node) -> tuple[fx.Node, str, float | None] | None:
    """The node ``node`` was made from, and how: a view ("view"), a float32 upcast ("upcast"), Gemma's soft-capping
    (``tanh(x / c) * c``, "softcap" with c); None for any other op."""
    name = _op_name(node)
    source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if source is None:
        return None
    if name in _VIEWS:
        return source, "view", None
    if name == "float" or name in ("to", "_to_copy") and _converts_to_float32(node):
        # an upcast; where the source's dtype is known to be float32 already, a no-op
        return source, "view" if _value_dtype(source) == torch.float32 else "upcast", None
    if name == "mul" and _is_tanh(source):
        scale = _scalar(node)
        divided = source.args[0]
        if (
            scale is not None and isinstance(divided, fx.Node) and _op_name(divided) == "div"
            and _scalar(divided) == scale and len(_readers(source)) == 1 and len(_readers(divided)) == 1
        ):
            return divided.args[0], "softcap", scale
    return None


def _converts_to_float32(node: fx.Node) -> bool:
    wanted = node.kwargs.get("dtype", node.args[1] if len(node.args) > 1 else None)
    return wanted is torch.float32 or wanted is None and _value_dtype(node) == torch.float32


def _is_tanh(node: Any) -> bool:
    return isinstance(node, fx.Node) and _op_name(node) == "tanh" and isinstance(node.args[0], fx.Node)


def _scalar(node: fx.Node) -> float | None:
    """The number a binary op applies (``x * c``, ``x / c``), if its second argument is one."""
    other = node.args[1] if len(node.args) > 1 else None
    return float(other) if isinstance(other, (int, float)) and math.isfinite(other) else None


def _divisor(loss: fx.Node) -> str | None:
    readers = [r for r in _readers(loss) if r.op != "output"]
    if len(readers) == 1 and _op_name(readers[0]) in ("div", "truediv") and readers[0].args[0] is loss:
        other = readers[0].args[1]
        return other.name if isinstance(other, fx.Node) else str(other)
    return None


def _readers(node: fx.Node) -> list[fx.Node]:
    return [user for user in node.users if _op_name(user) not in _IGNORED_USERS]


def _op_name(node: fx.Node) -> str:
    """The op's short name: ``aten.view.default`` and ``Tensor.view`` are "view", ``operator.truediv`` "truediv"."""
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    if target is operator.truediv:
        return "truediv"
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _value_dtype(node: Any) -> torch.dtype | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(value, torch.Tensor):
        return value.dtype
    example = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return getattr(example, "dtype", None)
