"""Capture: model + example inputs -> Graph (a sequence of units that can be profiled and checkpointed).

Three paths, tried in order, each checked against the model's own output on the example inputs:

1. ``torch.fx.symbolic_trace`` (torch-level nodes, leaf modules stay whole);
2. ``torch.export.export(strict=False)`` (aten-level nodes; works for Hugging Face transformers v5), first with
   libraries kept on their eager course (``eager_paths.py``; value reads asserted at run time), then as is;
3. module level: the model runs as it is and hooks on its submodules cut the forward into units. Used for models
   whose Python control flow depends on data; such models are checkpointed a whole submodule at a time.

Where the model or its inputs are on the meta device, what runs the model eagerly (the checks, the module level) runs
a fake copy of it under a ``FakeTensorMode`` instead (``_runnable``); the graph is still the user's model's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autockpt.errors import CaptureError, first_line
from autockpt.measure.eager_paths import (
    ValueReads,
    eager_library_paths,
    is_data_dependent_error,
    recorded_reads,
)
from autockpt.runtime.fx_nodes import compute_nodes
from autockpt.runtime.model_state import BufferState, autocast_state, buffer_values, cuda_devices_of, training_modes
from autockpt.types import CaptureKind, Graph, ModuleSpan, Unit

logger = logging.getLogger(__name__)

_PLAIN_LEAVES = (torch.Tensor, int, float, bool, str, type(None))


def capture(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Graph:
    """Capture ``model`` called as ``model(*args, **kwargs)``; never fails on an untraceable model."""
    notes: list[str] = []
    # a trace may assign to buffers (fx leaves a Proxy in ``self.ema = 0.9 * self.ema + ...``): each attempt starts
    # from, and leaves, the model's own buffers
    buffers = BufferState(model)
    attempts = (
        (CaptureKind.FX, "fx", _capture_fx),
        (CaptureKind.EXPORT, "export on eager library paths", _capture_export_on_eager_paths),
        (CaptureKind.EXPORT, "export", _capture_export),
    )
    plain_export_failure: Exception | None = None  # the plain export's, where an earlier attempt ran it
    for kind, label, attempt in attempts:
        try:
            if attempt is _capture_export and plain_export_failure is not None:
                raise plain_export_failure  # the same export on the same inputs: not run twice
            executable, extra_notes = attempt(model, args, kwargs)
            buffers.restore()
            _check_same_outputs(model, executable, args, kwargs)
        except Exception as error:  # noqa: BLE001  any failure means: try the next path
            buffers.restore()
            if isinstance(error, _PlainExportFailed):
                error = plain_export_failure = error.__cause__
            reason = f"{label} capture not used: {type(error).__name__}: {first_line(error)}"
            logger.info(reason)
            notes.append(reason)
            continue
        units = graph_units(executable, module_prefix=_EXPORT_PREFIX if kind is CaptureKind.EXPORT else "")
        logger.info("captured the model with %s (%d units)", kind.value, len(units))
        return Graph(
            kind=kind, model=model, executable=executable, units=units, module_spans=(), notes=tuple(notes + extra_notes),
            training_modes=training_modes(model), autocast=autocast_state(),
        )
    try:
        units, spans = _record_module_units(model, args, kwargs)
    except Exception as error:
        raise CaptureError(
            f"could not run {type(model).__name__} on the example inputs: {type(error).__name__}: "
            f"{first_line(error)}. Check that model(*example_inputs, **example_kwargs) runs in train mode."
        ) from error
    logger.info("captured the model at module level (%d units, %d module calls)", len(units), len(spans))
    return Graph(
        kind=CaptureKind.MODULE,
        model=model,
        executable=model,
        units=units,
        module_spans=spans,
        notes=tuple(notes),
        training_modes=training_modes(model),
        autocast=autocast_state(),
    )


def graph_units(gm: fx.GraphModule, *, module_prefix: str = "") -> tuple[Unit, ...]:
    """One unit per compute node; ``module_prefix`` is what the capture wrapper adds to module paths."""
    wrapper = module_prefix.removesuffix(".")
    return tuple(
        Unit(
            index=index,
            name=node.name,
            op=_op_name(node),
            # the wrapper's own attribute is the user's root module: its path is ""
            module_path="" if wrapper and _module_path(node) == wrapper else _module_path(node).removeprefix(module_prefix),
        )
        for index, node in enumerate(compute_nodes(gm))
    )


def plain_outputs(output: Any) -> tuple[Any, list[str]]:
    """Replace output leaves that are not tensors or Python scalars by None (e.g. a KV cache object)."""
    dropped: list[str] = []

    def keep_plain(path: Any, leaf: Any) -> Any:
        if isinstance(leaf, _PLAIN_LEAVES):
            return leaf
        dropped.append(f"{pytree.keystr(path) if path else 'an output'} ({type(leaf).__name__})")
        return None

    try:
        return pytree.tree_map_with_path(keep_plain, output), dropped
    except ValueError:  # a pytree node type registered without key paths (e.g. diffusers' BaseOutput)
        dropped.clear()
        return pytree.tree_map(lambda leaf: keep_plain((), leaf), output), dropped


_EXPORT_PREFIX = "model."  # _PlainOutputs holds the user's model as `.model`


class _PlainOutputs(nn.Module):
    """Export wrapper: returns the model's output with non-tensor objects replaced by None; with ``asserted_reads``
    the model's value reads are checked against them (``eager_paths.ValueReads``, inside export's own modes)."""

    def __init__(self, model: nn.Module, asserted_reads: list[Any] | None = None) -> None:
        super().__init__()
        self.model = model
        self.asserted_reads = asserted_reads

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.asserted_reads is None:
            return plain_outputs(self.model(*args, **kwargs))[0]
        with ValueReads(self.asserted_reads, asserted=True).replayed():
            return plain_outputs(self.model(*args, **kwargs))[0]


def _capture_fx(model: nn.Module, args: tuple, kwargs: dict) -> tuple[fx.GraphModule, list[str]]:
    return fx.symbolic_trace(model), []


def _capture_export(
    model: nn.Module, args: tuple, kwargs: dict, *, asserted_reads: list[Any] | None = None
) -> tuple[fx.GraphModule, list[str]]:
    with torch.no_grad(), _runnable(model, args, kwargs) as (runnable, run_args, run_kwargs):
        output = runnable(*run_args, **run_kwargs)
        _, dropped = plain_outputs(output)
        lost = _results_lost(output)
    if lost:
        raise ValueError(
            f"the model returns {lost}, which torch.export cannot return (not a registered pytree type): its tensors "
            "would be lost; torch.utils._pytree.register_dataclass on its class lets export keep them"
        )
    # a failed export logs a warning and prints the partial graph to stderr; the reason is kept in Graph.notes instead
    distinct_args, distinct_kwargs = _without_shared_storage(args, kwargs)
    with _quiet_logger("torch.fx.experimental.symbolic_shapes"), contextlib.redirect_stderr(io.StringIO()), \
            _no_node_stack_traces():
        exported = torch.export.export(_PlainOutputs(model, asserted_reads), distinct_args, distinct_kwargs, strict=False)
    notes = []
    if dropped:
        notes.append(
            "outputs that are not tensors are returned as None by the optimized module: " + ", ".join(dropped)
        )
    return exported.module(), notes


def _without_shared_storage(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs, with a copy of every tensor that shares storage with an earlier one.

    ``torch.export`` makes inputs that are the same tensor one graph input: exported on ``model(ids, labels=ids)``,
    the causal-LM idiom, the graph looked up the embeddings of ``labels``, and every later batch whose labels differ
    from its ids (shifted, or -100 on padding) computed something else, silently. A graph traced on distinct inputs
    is right for shared ones too.
    """
    seen: set[int] = set()

    def distinct(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.untyped_storage().nbytes() == 0:
            return leaf
        storage = leaf.untyped_storage().data_ptr()
        if storage in seen:
            return leaf.detach().clone().requires_grad_(leaf.requires_grad)
        seen.add(storage)
        return leaf

    return pytree.tree_map(distinct, (args, kwargs))


def _results_lost(output: Any) -> str:
    """What of the model's output ``plain_outputs`` would drop that holds its results ('' if nothing): the whole
    output, or a dataclass with tensor fields. Caches (Hugging Face's ``DynamicCache``) are dropped on purpose."""
    leaves = pytree.tree_leaves(output)
    if output is not None and not isinstance(output, _PLAIN_LEAVES) and len(leaves) == 1 and leaves[0] is output:
        return f"a {type(output).__name__}"
    for leaf in leaves:
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            fields = [getattr(leaf, field.name) for field in dataclasses.fields(leaf)]
            if any(isinstance(value, torch.Tensor) for value in pytree.tree_leaves(fields)):
                return f"a {type(leaf).__name__} holding tensors"
    return ""


def _capture_export_on_eager_paths(model: nn.Module, args: tuple, kwargs: dict) -> tuple[fx.GraphModule, list[str]]:
    """Export with libraries on their eager course (``eager_paths.py``). Where that course reads tensor values
    (``if padding_mask.all()``), the reads are recorded on one eager forward and export runs again with each read
    checked equal to its recorded value (``ValueReads(asserted=True)``): the graph takes the example's course and
    asserts it at run time (``aten._assert_scalar``), so a batch that would take the other branch fails the
    assertion instead of silently running this one. (Export's real-tensor propagation would do the same by copying
    every weight and keeping every activation while it traces: memory a step that captures new shapes cannot spare.)"""
    with eager_library_paths():
        try:
            return _capture_export(model, args, kwargs)
        except Exception as error:
            reads = recorded_reads(model, args, kwargs) if is_data_dependent_error(error) else None
            if not reads:
                raise  # not about values, no values (meta), or the eager model reads none
    # values read on the eager course only (a library's check it skips when traced) are asserted; a model whose own
    # control flow reads values fails the traced course too, and is left to the module level (any value, no replans)
    try:
        _capture_export(model, args, kwargs)
    except Exception as error:
        raise _PlainExportFailed from error
    # that export is dropped, but lives on in reference cycles: collected now, since a capture of new shapes runs
    # inside a training step, under its budget (measured: 0.47 MB over it in tests/planning/test_trainer.py)
    gc.collect()
    logger.info("the eager course reads %d tensor value(s): exported with the example's, asserted", len(reads))
    with eager_library_paths():
        executable, notes = _capture_export(model, args, kwargs, asserted_reads=reads)
    _refuse_value_dependent_shapes(executable)
    if value_guards(executable):
        notes.append(
            f"the model reads {len(reads)} tensor value(s) to choose its course (e.g. whether a mask has padding): "
            "the graph takes the example's course and checks it at run time; a step whose values take another course "
            "is planned again for it"
        )
    return executable, notes


class _PlainExportFailed(Exception):
    """The export as is failed inside the eager-paths attempt (its ``__cause__``): ``capture``'s next attempt, the
    same export, is answered with that failure instead of being run again (a third of a module-level capture)."""


def value_guards(executable: fx.GraphModule) -> list[str]:
    """The run-time checks of values the eager course read while it was captured (their assertion messages)."""
    return [
        str(node.args[1]) if len(node.args) > 1 else node.name
        for node in executable.graph.nodes
        if node.op == "call_function" and node.target is torch.ops.aten._assert_scalar.default
    ]


def _refuse_value_dependent_shapes(executable: fx.GraphModule) -> None:
    """A graph whose tensor shapes depend on values read while tracing (unbacked sizes) is not one autockpt can
    profile and price: the plain export or the module level takes such a model instead."""
    for node in executable.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and any(isinstance(size, torch.SymInt) for size in value.shape):
            raise ValueError(f"node {node.name}: its shape {tuple(value.shape)} depends on tensor values")


@contextlib.contextmanager
def _no_node_stack_traces() -> Iterator[None]:
    """No Python stack trace recorded on each traced node: nothing autockpt reads, and extracting and symbolising one
    per node was about a fifth of an export's time (tests' models, CPU). Export's own errors still say where."""
    config = fx.config
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """Drop one library logger's records for the duration (a filter, removed afterwards)."""
    target = logging.getLogger(name)
    drop_all = logging.Filter(name="\0never-matches")
    target.addFilter(drop_all)
    try:
        yield
    finally:
        target.removeFilter(drop_all)


def _check_same_outputs(model: nn.Module, executable: nn.Module, args: tuple, kwargs: dict) -> None:
    """Run both from the same RNG state and buffers; raise if the captured graph computes something else or leaves
    the buffers otherwise (fx does not trace an update like ``self.count += 1`` that reads no traced tensor: it ran
    once while tracing and the graph would never advance the counter)."""
    start = BufferState(model)
    with torch.random.fork_rng(devices=cuda_devices_of(args, kwargs, list(model.parameters()))), torch.no_grad():
        seed = 1234
        torch.manual_seed(seed)
        with _runnable(model, args, kwargs) as (runnable, run_args, run_kwargs):
            expected, _ = plain_outputs(runnable(*run_args, **run_kwargs))
            expected_buffers = buffer_values(runnable)
        start.restore()
        torch.manual_seed(seed)
        actual = executable(*args, **kwargs)
        actual_buffers = buffer_values(model)
        start.restore()
    for name, want in expected_buffers.items():
        got = actual_buffers.get(name)
        if got is None or got.shape != want.shape or not _same_values(want, got):
            raise ValueError(f"buffer {name!r}: the graph leaves it different from the model's own forward")
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    actual_leaves, actual_spec = pytree.tree_flatten(actual)
    if len(expected_leaves) != len(actual_leaves):
        raise ValueError(f"output structure differs: the model returns {expected_spec}, the graph {actual_spec}")
    for position, (want, got) in enumerate(zip(expected_leaves, actual_leaves)):
        if not isinstance(want, torch.Tensor):
            continue
        if not isinstance(got, torch.Tensor) or want.shape != got.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ValueError(f"output {position}: the model returns shape {tuple(want.shape)}, the graph {shape}")
        if not _same_values(want, got):
            largest = (want.double() - got.double()).abs().max().item()
            raise ValueError(f"output {position}: the graph's values differ from the model's (largest difference {largest:.3g})")


def _same_values(want: torch.Tensor, got: torch.Tensor) -> bool:
    if want.device.type == "meta" or got.device.type == "meta":  # no values (a model on the meta device): shapes
        return want.shape == got.shape and want.dtype == got.dtype
    return torch.allclose(want, got, rtol=1e-4, atol=1e-5) if want.is_floating_point() else torch.equal(want, got)


class ModuleUnitRecorder:
    """Cuts a module-level forward into units at every submodule entry and exit.

    ``on_unit_start(i)`` is called when unit ``i`` begins. The unit sequence is deterministic for a given model and
    inputs, so capture and profile see the same units.
    """

    def __init__(self, model: nn.Module, on_unit_start: Callable[[int], None] | None = None) -> None:
        self.model = model
        self.on_unit_start = on_unit_start
        self.units: list[Unit] = []
        self.spans: list[ModuleSpan] = []
        self._stack: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[ModuleUnitRecorder]:
        handles = []
        for path, module in self.model.named_modules():
            handles.append(module.register_forward_pre_hook(self._make_enter(path)))
            handles.append(module.register_forward_hook(self._make_exit(path), always_call=True))
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _start_unit(self, path: str, kind: str) -> None:
        index = len(self.units)
        self.units.append(Unit(index=index, name=f"{path or '<root>'}:{kind}{index}", op=kind, module_path=path))
        if self.on_unit_start is not None:
            self.on_unit_start(index)

    def _make_enter(self, path: str) -> Callable[..., None]:
        def enter(module: nn.Module, inputs: Any) -> None:
            if not self._stack:  # a new top-level forward (profiling runs several): units count from 0 again
                self.units, self.spans = [], []
            self._stack.append((path, len(self.units)))
            self._start_unit(path, "module" if not any(True for _ in module.children()) else "enter")

        return enter

    def _make_exit(self, path: str) -> Callable[..., None]:
        def exit_(module: nn.Module, inputs: Any, output: Any) -> None:
            entered_path, first_unit = self._stack.pop()
            assert entered_path == path, f"module hooks out of order: {entered_path} vs {path}"
            self.spans.append(ModuleSpan(path=path, first_unit=first_unit, last_unit=len(self.units) - 1))
            if self._stack:
                self._start_unit(self._stack[-1][0], "glue")

        return exit_


def _record_module_units(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple[Unit, ...], tuple[ModuleSpan, ...]]:
    with (torch.random.fork_rng(devices=cuda_devices_of(args, kwargs, list(model.parameters()))), torch.no_grad(),
          _runnable(model, args, kwargs) as (runnable, run_args, run_kwargs)):
            recorder = ModuleUnitRecorder(runnable)  # a copy has the model's module paths
            with recorder.recording():
                runnable(*run_args, **run_kwargs)
    return tuple(recorder.units), tuple(recorder.spans)


@contextlib.contextmanager
def _runnable(model: nn.Module, args: tuple, kwargs: dict) -> Iterator[tuple[nn.Module, tuple, dict]]:
    """The model and inputs to run eagerly: themselves, or, where any of their tensors is on the meta device, fake
    copies of them (``fake_copy.fake_copy``) run under a ``FakeTensorMode``, entered here.

    Meta tensors have no values: Python code that reads one fails on them (transformers' packed-sequence check at
    batch size 1 calls ``.item()``), where code that knows it is traced skips such checks on fake tensors, as it does
    while torch.export traces the model. The user's model stays as it is, on the meta device.
    """
    tensors = [*model.parameters(), *model.buffers(), *pytree.tree_leaves((args, kwargs))]
    if not any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tensors):
        yield model, args, kwargs
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autockpt.measure.fake_copy import fake_copy

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    copied, fake_args, fake_kwargs = fake_copy(model, args, kwargs, mode)
    with mode:
        yield copied, fake_args, fake_kwargs


def _op_name(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"module:{node.target}"
    if node.op == "call_method":
        return f"method:{node.target}"
    return getattr(node.target, "__name__", str(node.target)) if not isinstance(node.target, str) else node.target


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if stack:
        return str(list(stack.values())[-1][0])
    if node.op == "call_module":
        return str(node.target)
    return ""
