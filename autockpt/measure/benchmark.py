"""Op benchmarks: every unit of an fx or export graph run alone on the local device, at the shapes the step gives it,
on random inputs, forward and backward, without running the step (the ``"benchmark"`` timing, ``timing.py``).

1. Shapes: the captured graph runs once on a fake copy of the model and inputs (``fake.FakeStep``, the fake trace's
   copy: no data, no real step) with a marker before every unit (``trace.unit_callbacks``) that records the shape,
   strides, dtype and ``requires_grad`` of each value the unit reads.
2. Per unit: its op (an fx ``call_function``/``call_method`` target, or a copy of the ``call_module`` submodule:
   the model's weights copied, random ones where the model is on the meta device) runs on random inputs of those
   shapes, made once per unit: floating tensors ``randn``, integer and boolean ones zeros (always in range for an
   index, a gather, a mask), an embedding's indices uniform below its number of rows. Inputs that require grad are
   leaves, each cloned before a run (an in-place op then writes into the clone, as into an activation). Forward: the
   op; backward: autograd on that op alone (``torch.autograd.grad`` of its outputs, with random output gradients,
   for those leaves and the module's weights). One warm-up, then the median of ``repeats`` runs (one run when the
   warm-up took over ``LONG_OP_MS``). Only one op's inputs, outputs and gradients exist at a time: the memory of the
   largest op, never the step's.
3. Repeated blocks (``core.structure.find_repeated_blocks``) are benchmarked once: unit ``first + k`` of every
   instance of a family takes the times of unit ``first + k`` of the family's first instance. Instances are found
   from equal unit signatures (op, FLOPs, output and saved bytes, offset by offset), so unit k of each instance does
   the same op at the same shapes.

A unit that cannot run alone (an op whose inputs cannot be made, a missing derivative, a value it needs) is reported
as failed with its reason; the timing gives it a roofline time instead. The global RNG is left as it was.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autockpt.core.structure import find_repeated_blocks
from autockpt.errors import first_line
from autockpt.measure.fake import FakeStep
from autockpt.measure.sources import StepInputs
from autockpt.measure.trace import synchronizer, unit_callbacks
from autockpt.runtime.fx_nodes import compute_nodes
from autockpt.runtime.model_state import start_autocast_step
from autockpt.types import CaptureKind, Graph, StepTrace

LONG_OP_MS = 50.0  # an op whose warm-up (forward + backward) takes longer is timed once after it
_EMBEDDING_OPS = (torch.ops.aten.embedding.default, F.embedding, torch.embedding)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorMeta:
    """What a unit's input looks like in the step (of a fake tensor), enough to make a random one like it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorMeta:
        return TensorMeta(
            shape=tuple(tensor.shape), stride=tuple(tensor.stride()), dtype=tensor.dtype,
            requires_grad=tensor.requires_grad,
        )

    @property
    def storage_numel(self) -> int:
        if any(size == 0 for size in self.shape):
            return 0
        return 1 + sum((size - 1) * stride for size, stride in zip(self.shape, self.stride))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OpTime:
    """One unit run alone: median forward and backward milliseconds (backward 0: no output needs a gradient)."""

    forward_ms: float
    backward_ms: float


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OpBenchmarks:
    """Per unit, its times (None: it did not run alone, see ``failures``), and the unit they were measured at."""

    times: tuple[OpTime | None, ...]
    timed_at: tuple[int, ...]  # per unit: itself, or the same unit of its family's first instance
    failures: tuple[tuple[int, str], ...]  # (unit benchmarked, why it could not run alone)
    benchmarked: int  # units run (the others took a first instance's times)
    seconds: float  # wall time of the whole benchmark, shapes pass included


def benchmark_units(
    graph: Graph, step: StepInputs, trace: StepTrace, device: torch.device, *, repeats: int = 3,
    blocks_once: bool = True,
) -> OpBenchmarks:
    """Benchmark every unit of ``graph`` (fx or export) alone on ``device``; ``trace`` gives the repeated blocks."""
    if graph.kind is CaptureKind.MODULE:
        raise ValueError("a module-level graph has no ops to benchmark alone: time it by roofline")
    started = time.perf_counter()
    count = len(graph.units)
    timed_at = first_instance_units(graph, trace) if blocks_once else list(range(count))
    times: list[OpTime | None] = [None] * count
    failures: list[tuple[int, str]] = []
    # dropout draws from the global RNG; the user's stream stays as it was
    with torch.random.fork_rng(devices=_cuda_indices(device)):
        try:
            nodes, inputs = _unit_inputs(graph, step, device)
        except Exception as error:  # noqa: BLE001 - no shapes: every unit falls back to the roofline
            reason = f"the shapes pass failed: {type(error).__name__}: {first_line(error, 160)}"
            return OpBenchmarks(
                times=tuple(times), timed_at=tuple(range(count)), failures=((-1, reason),), benchmarked=0,
                seconds=time.perf_counter() - started,
            )
        bench = _OpBench(device, repeats)
        originals = dict(graph.executable.named_modules())
        benchmarked = sorted(set(timed_at))
        for unit in benchmarked:
            node = nodes[unit]
            try:
                times[unit] = bench.measure(node, inputs[unit], originals)
            except Exception as error:  # noqa: BLE001 - any op that cannot run alone falls back to the roofline
                failures.append((unit, f"{graph.units[unit].op}: {type(error).__name__}: {first_line(error, 160)}"))
    for unit, at in enumerate(timed_at):
        times[unit] = times[at]
    return OpBenchmarks(
        times=tuple(times), timed_at=tuple(timed_at), failures=tuple(failures), benchmarked=len(benchmarked),
        seconds=time.perf_counter() - started,
    )


def first_instance_units(graph: Graph, trace: StepTrace) -> list[int]:
    """Per unit, the unit whose benchmark it takes: itself, or the same unit (same offset) of its repeated block
    family's first instance."""
    timed_at = list(range(len(trace.units)))
    for family in find_repeated_blocks(graph, trace).families:
        first = family.instances[0].first_unit
        for instance in family.instances[1:]:
            for offset in range(family.block_units):
                timed_at[instance.first_unit + offset] = first + offset
    return timed_at


# --------------------------------------------------------------------------------------------------- shapes pass


def _unit_inputs(graph: Graph, step: StepInputs, device: torch.device) -> tuple[list[fx.Node], list[dict[fx.Node, Any]]]:
    """The compute nodes of a fake copy of the graph and, per unit, what each of its input nodes held (tensors as
    ``TensorMeta``), from one forward on fake tensors."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = FakeStep.of(graph, step, mode, device)
    gm = fake.graph.executable
    assert isinstance(gm, fx.GraphModule)
    nodes = compute_nodes(gm)
    inputs: list[dict[fx.Node, Any]] = [{} for _ in nodes]

    def record(index: int, values: tuple[Any, ...]) -> None:
        metas = pytree.tree_map(lambda v: TensorMeta.of(v) if isinstance(v, torch.Tensor) else v, list(values))
        inputs[index] = dict(zip(nodes[index].all_input_nodes, metas))

    with mode, torch.enable_grad(), unit_callbacks(fake.graph, lambda index: None, on_inputs=record):
        fake.graph.executable(*fake.args, **fake.kwargs)
    return nodes, inputs


# ------------------------------------------------------------------------------------------------ one op alone


class _OpBench:
    """Makes a unit's inputs and times its op alone, forward and backward."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device = device
        self.repeats = repeats
        self.sync = synchronizer(device)
        self.generator = torch.Generator(device=device).manual_seed(0)

    def measure(self, node: fx.Node, metas: dict[fx.Node, Any], originals: dict[str, nn.Module]) -> OpTime:
        op, weights = self._op(node, originals)
        bounds = _index_bounds(node, metas, originals)
        made = {source: self._made_tree(value, bounds.get(source)) for source, value in metas.items()}
        leaves = [t for t in [*pytree.tree_leaves(made), *weights] if isinstance(t, torch.Tensor) and t.requires_grad]
        warm_up = self._run(node, op, made, leaves)
        # an op that takes long (a large matmul) varies little: fewer repeats keep a large model's benchmark short
        repeats = self.repeats if sum(warm_up) < LONG_OP_MS else 1
        runs = [self._run(node, op, made, leaves) for _ in range(repeats)]
        return OpTime(
            forward_ms=statistics.median(f for f, _ in runs), backward_ms=statistics.median(b for _, b in runs)
        )

    def _op(self, node: fx.Node, originals: dict[str, nn.Module]) -> tuple[Callable[..., Any], list[torch.Tensor]]:
        """What the node calls, and the weights of a module it calls (a copy, so the model is never touched)."""
        if node.op == "call_function":
            return node.target, []  # type: ignore[return-value]
        if node.op == "call_method":
            name = str(node.target)
            return (lambda self, *args, **kwargs: getattr(self, name)(*args, **kwargs)), []
        module = copy.deepcopy(originals[str(node.target)])
        tensors = [*module.parameters(), *module.buffers()]
        if any(t.device != self.device for t in tensors):  # on the meta device (no weights): random ones here
            module.to_empty(device=self.device)
            with torch.no_grad():
                for tensor in [*module.parameters(), *module.buffers()]:
                    tensor.copy_(self._made(TensorMeta.of(tensor), None))
        return module, [p for p in module.parameters() if p.requires_grad]

    def _made_tree(self, value: Any, index_bound: int | None) -> Any:
        return pytree.tree_map(lambda leaf: self._made(leaf, index_bound), value)

    def _made(self, value: Any, index_bound: int | None) -> Any:
        """A random tensor like ``value`` (a ``TensorMeta``, same strides); anything else as it is."""
        if not isinstance(value, TensorMeta):
            return value
        numel = value.storage_numel
        if index_bound is not None and not value.dtype.is_floating_point:
            flat = torch.randint(0, max(index_bound, 1), (numel,), generator=self.generator, device=self.device)
            flat = flat.to(value.dtype)
        elif value.dtype.is_floating_point or value.dtype.is_complex:
            flat = torch.randn(numel, generator=self.generator, device=self.device, dtype=value.dtype)
        else:
            flat = torch.zeros(numel, device=self.device, dtype=value.dtype)
        if numel == math.prod(value.shape):  # its own storage, not a view: ``detach_`` and ``resize_`` accept it
            made = torch.empty_strided(value.shape, value.stride, device=self.device, dtype=value.dtype)
            made.untyped_storage().copy_(flat.untyped_storage())
        else:  # overlapping (an expanded tensor): a view of a smaller storage, as in the step
            made = flat.as_strided(value.shape, value.stride)
        return made.requires_grad_() if value.requires_grad else made

    def _run(
        self, node: fx.Node, op: Callable[..., Any], made: dict[fx.Node, Any], leaves: list[torch.Tensor]
    ) -> tuple[float, float]:
        # a clone of each leaf: an in-place op writes into it as into an activation, and its backward is identity
        inputs = {
            source: pytree.tree_map(
                lambda v: v.clone() if isinstance(v, torch.Tensor) and v.requires_grad else v, value
            )
            for source, value in made.items()
        }
        args = fx.node.map_arg(node.args, inputs.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, inputs.__getitem__)
        with torch.enable_grad():
            start_autocast_step()  # autocast casts the weights in every step: not from its cache of an earlier run
            self.sync()
            began = time.perf_counter()
            output = op(*args, **kwargs)
            self.sync()
            forward_ms = (time.perf_counter() - began) * 1e3
            outputs = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not outputs or not leaves:
                return forward_ms, 0.0
            gradients = [
                torch.randn(t.shape, generator=self.generator, device=t.device, dtype=t.dtype) for t in outputs
            ]
            self.sync()
            began = time.perf_counter()
            torch.autograd.grad(outputs, leaves, gradients, allow_unused=True)
            self.sync()
        return forward_ms, (time.perf_counter() - began) * 1e3


def _index_bounds(node: fx.Node, metas: dict[fx.Node, Any], originals: dict[str, nn.Module]) -> dict[fx.Node, int]:
    """The input nodes of an embedding lookup that hold indices, with the number of rows they index (zeros, the
    default for integer inputs, would read one row only)."""
    args = list(node.args)
    if node.op == "call_module":
        module = originals.get(str(node.target))
        if isinstance(module, nn.Embedding) and args and isinstance(args[0], fx.Node):
            return {args[0]: module.num_embeddings}
        return {}
    if node.op != "call_function" or node.target not in _EMBEDDING_OPS:
        return {}
    # aten.embedding(weight, indices); F.embedding(indices, weight); torch.embedding(weight, indices)
    weight_at, indices_at = (1, 0) if node.target is F.embedding else (0, 1)
    if len(args) <= max(weight_at, indices_at):
        return {}
    weight, indices = args[weight_at], args[indices_at]
    weight_meta = metas.get(weight) if isinstance(weight, fx.Node) else None
    if isinstance(indices, fx.Node) and isinstance(weight_meta, TensorMeta) and weight_meta.shape:
        return {indices: weight_meta.shape[0]}
    return {}


def _cuda_indices(device: torch.device) -> list[int]:
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]
