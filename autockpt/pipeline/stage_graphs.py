"""Stage graphs: a captured graph cut at unit boundaries into one fx.GraphModule per pipeline stage.

A stage's module takes what crosses the cut before it (the model's own inputs on stage 0) and returns what crosses
the cut after it (the model's output on the last stage), so ``torch.distributed.pipelining.PipelineStage`` can send
one stage's outputs as the next one's inputs. A value made before a stage and used after it passes through the
stage (an input and an output). Parameters and buffers are read where they are used: a stage module holds the
user's own ``Parameter`` objects under their original names (the ``state_dict`` keys of the model), and a
parameter read by two stages (a tied embedding and head) is held by both (``shared_parameters`` says which, so their
gradients can be summed).

A cut is possible only where everything crossing it is a tensor: pipelining sends tensors, not Python values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx import _pytree as fx_pytree
from torch.fx.graph import CodeGen, _PyTreeCodeGen, _PyTreeInfo
from torch.utils import _pytree as pytree

from autockpt.record_types import SharedParameter
from autockpt.runtime.fx_nodes import compute_nodes
from autockpt.types import CaptureKind, Graph

logger = logging.getLogger(__name__)

_ATTRIBUTE_PREFIX = {CaptureKind.EXPORT: "model."}  # the export wrapper holds the user's model as `.model`


@dataclass(frozen=True, kw_only=True, slots=True)
class CrossingValue:
    """One value of the captured graph, as seen on the example microbatch."""

    name: str  # the fx node's name
    is_tensor: bool
    nbytes: int  # 0 for a non-tensor
    requires_grad: bool
    describe: str  # for error messages: "float32[4, 16, 32]" or "a torch.Size"


@dataclass(frozen=True, kw_only=True, slots=True)
class StageGraph:
    """One stage of a cut graph."""

    index: int
    first_unit: int
    last_unit: int
    module: fx.GraphModule
    input_names: tuple[str, ...]  # values received from the stage before (empty on stage 0: the model's inputs)
    output_names: tuple[str, ...]  # values sent to the stage after (empty on the last stage: the model's output)
    parameter_names: tuple[str, ...]  # the model's parameters this stage reads, by their names in the model
    module_paths: tuple[str, ...]  # the submodules whose units this stage runs, outermost first


class GraphValues(fx.Interpreter):
    """Runs the captured graph once and records what each node produced (tensor or not, bytes, requires_grad)."""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.values: dict[str, CrossingValue] = {}

    def run_node(self, node: fx.Node) -> Any:
        result = super().run_node(node)
        if isinstance(result, torch.Tensor):
            shape = list(result.shape)
            self.values[node.name] = CrossingValue(
                name=node.name, is_tensor=True, nbytes=result.untyped_storage().nbytes(),
                requires_grad=result.requires_grad, describe=f"{str(result.dtype).removeprefix('torch.')}{shape}",
            )
        else:
            self.values[node.name] = CrossingValue(
                name=node.name, is_tensor=False, nbytes=0, requires_grad=False, describe=f"a {type(result).__name__}"
            )
        return result


def graph_values(graph: Graph, args: tuple, kwargs: dict) -> dict[str, CrossingValue]:
    """Every node's value on these inputs (the graph run once, with gradients recorded as in training)."""
    executable = graph.executable
    assert isinstance(executable, fx.GraphModule)
    recorder = GraphValues(executable)
    flat = _flat_inputs(executable, args, kwargs)
    with torch.random.fork_rng():
        recorder.run(*flat)
    return recorder.values


def _flat_inputs(module: fx.GraphModule, args: tuple, kwargs: dict) -> list[Any]:
    """The placeholder values for a call ``module(*args, **kwargs)``."""
    codegen = module.graph._codegen
    if isinstance(codegen, _PyTreeCodeGen) and codegen.pytree_info is not None and codegen.pytree_info.in_spec:
        return list(fx_pytree.tree_flatten_spec((args, kwargs), codegen.pytree_info.in_spec))
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    flat = list(args)
    for node in placeholders[len(args):]:
        if node.target in kwargs:
            flat.append(kwargs[node.target])
        elif node.args:
            flat.append(node.args[0])  # the forward's default
        else:
            raise TypeError(f"the example inputs give no value for the graph input {node.target!r}")
    return flat


def unit_positions(module: fx.GraphModule) -> dict[str, int]:
    """The unit index of every compute node; placeholders are at -1 (before every unit)."""
    positions = {n.name: -1 for n in module.graph.nodes if n.op == "placeholder"}
    positions.update({n.name: i for i, n in enumerate(compute_nodes(module))})
    return positions


def crossing(module: fx.GraphModule, after_unit: int) -> list[fx.Node]:
    """The values made at or before unit ``after_unit`` that a later unit or the output reads, in graph order."""
    positions = unit_positions(module)
    found = []
    for node in module.graph.nodes:
        if node.op in ("get_attr", "output") or positions[node.name] > after_unit:
            continue
        for user in node.users:
            if user.op == "output" or (user.name in positions and positions[user.name] > after_unit):
                found.append(node)
                break
    return found


def cut_problem(module: fx.GraphModule, values: dict[str, CrossingValue], after_unit: int) -> str:
    """Why the graph cannot be cut after this unit ('' when it can)."""
    blocked = [
        f"{node.name} ({values[node.name].describe})" for node in crossing(module, after_unit)
        if not values[node.name].is_tensor and not _is_none(node, values)
    ]
    return "" if not blocked else "values that are not tensors cross it: " + ", ".join(blocked[:4])


def _is_none(node: fx.Node, values: dict[str, CrossingValue]) -> bool:
    return values[node.name].describe == "a NoneType"


def build_stage_graphs(graph: Graph, cuts: Sequence[int]) -> list[StageGraph]:
    """Cut ``graph`` after each unit in ``cuts`` (ascending); stage k runs units cuts[k-1]+1 .. cuts[k]."""
    num_units = len(graph.units)
    bounds = [-1, *cuts, num_units - 1]
    if any(b >= a for a, b in zip(bounds[1:], bounds)):
        raise ValueError(f"cuts must be ascending unit indices below {num_units - 1}, got {list(cuts)}")
    return [stage_graph(graph, bounds[k] + 1, bounds[k + 1], index=k) for k in range(len(bounds) - 1)]


def stage_graph(graph: Graph, first: int, last: int, *, index: int = 0) -> StageGraph:
    """The stage that runs units ``first .. last`` of ``graph`` (the first stage when ``first`` is 0, the last when
    ``last`` is the last unit)."""
    module = graph.executable
    if not isinstance(module, fx.GraphModule) or graph.kind not in (CaptureKind.FX, CaptureKind.EXPORT):
        raise ValueError(f"only fx and export captures can be cut into stages, not {graph.kind.value}")
    prefix = _ATTRIBUTE_PREFIX.get(graph.kind, "")
    positions = unit_positions(module)
    is_first, is_last = first == 0, last == len(graph.units) - 1
    received = [] if is_first else crossing(module, first - 1)
    sent = [] if is_last else crossing(module, last)
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attributes: dict[str, Any] = {}

    def read(node: fx.Node) -> fx.Node:
        if node not in env and node.op == "get_attr":  # parameters and buffers are read where they are used
            target = str(node.target).removeprefix(prefix)
            attributes[target] = _attribute(module, str(node.target))
            env[node] = new.get_attr(target)
            env[node].meta = dict(node.meta)
        return env[node]

    if is_first:
        for node in module.graph.nodes:
            if node.op == "placeholder":
                env[node] = new.node_copy(node)
    else:
        for node in received:
            env[node] = new.placeholder(node.name)
            env[node].meta = dict(node.meta)
    for node in module.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module") and first <= positions[node.name] <= last:
            if node.op == "call_module":
                target = str(node.target).removeprefix(prefix)
                attributes[target] = module.get_submodule(str(node.target))
                copied = new.create_node("call_module", target, *_mapped(node, read))
                copied.meta = dict(node.meta)
                env[node] = copied
            else:
                env[node] = new.node_copy(node, read)
    if is_last:
        (output,) = [n for n in module.graph.nodes if n.op == "output"]
        new.output(fx.node.map_arg(output.args[0], read))
    else:
        new.output(tuple(read(node) for node in sent))
    stage_module = fx.GraphModule(attributes, new, class_name=f"Stage{index}")
    _keep_call_form(stage_module, module, is_first=is_first, is_last=is_last)
    return StageGraph(
        index=index, first_unit=first, last_unit=last, module=stage_module,
        input_names=tuple(n.name for n in received), output_names=tuple(n.name for n in sent),
        parameter_names=tuple(name for name, _ in stage_module.named_parameters(remove_duplicate=False)),
        module_paths=_module_paths(graph, first, last),
    )


def crossing_tensors(
    graph: Graph, args: tuple, kwargs: dict, after_units: Sequence[int],
    keep: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors that cross a cut after each of these units on these inputs, by fx node name: what ``keep`` makes
    of each (default: a detached copy that requires grad as the value did)."""
    keep = keep or (lambda tensor: tensor.detach().clone().requires_grad_(tensor.requires_grad))
    module = graph.executable
    assert isinstance(module, fx.GraphModule)
    wanted = {node.name for after in after_units for node in crossing(module, after)}
    kept: dict[str, torch.Tensor] = {}

    class Keeper(fx.Interpreter):
        def run_node(self, node: fx.Node) -> Any:
            result = super().run_node(node)
            if node.name in wanted and isinstance(result, torch.Tensor):
                kept[node.name] = keep(result)
            return result

    with torch.random.fork_rng():
        Keeper(module).run(*_flat_inputs(module, args, kwargs))
    return kept


def _mapped(node: fx.Node, read: Any) -> tuple[tuple, dict]:
    return fx.node.map_arg(node.args, read), fx.node.map_arg(node.kwargs, read)


def _attribute(module: fx.GraphModule, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, name)


def _keep_call_form(stage: fx.GraphModule, captured: fx.GraphModule, *, is_first: bool, is_last: bool) -> None:
    """An exported graph takes and returns pytrees (``_PyTreeCodeGen``): stage 0 keeps how the model is called,
    the last stage what it returns; the stages between take and return flat tensors."""
    codegen = captured.graph._codegen
    if not isinstance(codegen, _PyTreeCodeGen) or codegen.pytree_info is None:
        return
    if not is_first and not is_last:  # fx's default code generation: flat in, flat out
        stage.graph._codegen = CodeGen()
    else:
        info = codegen.pytree_info
        names = [n.target for n in stage.graph.nodes if n.op == "placeholder"]
        in_spec = info.in_spec if is_first else pytree.tree_flatten((tuple(names), {}))[1]
        stage.graph._codegen = _PyTreeCodeGen(_PyTreeInfo(names, in_spec, info.out_spec if is_last else None))
    stage.recompile()


def _module_paths(graph: Graph, first: int, last: int) -> tuple[str, ...]:
    """The outermost module paths of the stage's units (``layers.0``, ``layers.1``, ``norm``), in unit order."""
    paths: list[str] = []
    for unit in graph.units[first:last + 1]:
        path = unit.module_path
        if path and not any(path == p or path.startswith(p + ".") for p in paths):
            paths = [p for p in paths if not p.startswith(path + ".")] + [path]
    return tuple(paths)


def shared_parameters(stages: Sequence[StageGraph]) -> tuple[SharedParameter, ...]:
    """Parameters held by more than one stage (tied weights: the same ``Parameter`` object), by a name each stage
    the first holding stage calls it by, with every stage that holds it."""
    found: dict[int, tuple[str, list[int], int]] = {}
    for stage in stages:
        for name, parameter in stage.module.named_parameters(remove_duplicate=False):
            _, holders, _ = found.setdefault(id(parameter), (name, [], parameter.nbytes))
            if stage.index not in holders:
                holders.append(stage.index)
    return tuple(
        SharedParameter(name=name, stages=tuple(holders), nbytes=nbytes)
        for name, holders, nbytes in found.values() if len(holders) > 1
    )
