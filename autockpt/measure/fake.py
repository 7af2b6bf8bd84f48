"""FakeTrace: the step's memory timeline without running a real step (issue 36, the memory half).

The captured graph runs on a copy of the model whose parameters and buffers are fake tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes, devices and storages, no data), on fake example
inputs, through the same ``trace_step`` as ``MeasuredTrace`` (warm-up, tracked step under autockpt's own
``StorageTracker``, FLOPs). Fake tensors have storages of the same sizes, aliasing and lifetimes as real ones, so the
memory timeline (events, storage lives, peaks, static bytes) is the measured one; on CPU it is the same event for
event. The user's model is not touched: a model on the meta device stays there, and a real model's weights are never
read (a fake tensor has only the metadata of the tensor it stands for).

Times are not measured: a fake kernel takes none. Every unit time is 0, or proportional to the unit's FLOPs at a
rate the caller gives (``flops_per_ms``); ``StepTrace.times_measured`` is False either way. ``Planner.from_model``
then gives the trace its times by its timing (``timing.py``): "auto" benchmarks each op alone on this machine
("benchmark"), "roofline" uses a device's FLOPs and bytes; ``timing=MeasuredTiming()`` keeps these placeholders.

A step whose Python code needs tensor values (``if x.mean() > 0``, ``float(loss)``, ``torch.nonzero``) cannot run on
fake tensors: ``FakeStepError`` names the op and the line of the model that asked.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import traceback
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
    unset_fake_temporarily,
)
from torch.utils import _pytree as pytree

from autockpt.errors import FakeStepError, LossFunctionError, ProfileError
from autockpt.measure.capture import value_guards
from autockpt.measure.fake_copy import fake_copies, fake_of
from autockpt.measure.loop import measure_optimizer_step, optimizer_factory
from autockpt.measure.sources import StepInputs, TraceRequest, in_the_loop, with_foreign_bytes_counted
from autockpt.measure.trace import device_of, trace_step
from autockpt.types import CaptureKind, Graph, OptimizerStepCost, StepTrace


class _CpuFakeTensorMode(FakeTensorMode):
    """Fake tensors whose normalisations on the CPU make what the CPU kernels make.

    On a low-precision input (bfloat16, float16) with float32 parameters or running statistics, as autocast leaves
    them, the CPU kernels of layer, group and batch normalisation keep the saved mean and inverse standard deviation
    in float32, where torch's fake kernels (its reference implementations) make them in the input's dtype (half the
    bytes); and group normalisation's backward returns the input's gradient in the input's dtype, where the fake
    kernel makes it float32 (and autograd then adds a copy to the input's dtype). Such outputs are converted here to
    the dtype the CPU kernel gives them (checked op by op against the CPU kernels: ``tests/measure/test_fake_trace.py``).
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        dtypes = _cpu_kernel_dtypes(func, args, kwargs or {})
        if dtypes is None:
            return out
        return tuple(
            super(_CpuFakeTensorMode, self).__torch_dispatch__(
                torch.ops.aten._to_copy.default, types, (value,), {"dtype": dtype}
            ) if dtype is not None and isinstance(value, torch.Tensor) and value.dtype != dtype else value
            for value, dtype in itertools.zip_longest(out, dtypes)
        )


_CPU_MIXED_NORMS = frozenset({
    torch.ops.aten.native_layer_norm.default,
    torch.ops.aten.native_group_norm.default,
    torch.ops.aten.native_batch_norm.default,
    torch.ops.aten._native_batch_norm_legit.default,
    torch.ops.aten._native_batch_norm_legit.no_stats,
    torch.ops.aten._native_batch_norm_legit_functional.default,
    torch.ops.aten._native_batch_norm_legit_no_training.default,
    torch.ops.aten._batch_norm_with_update.default,
    torch.ops.aten._batch_norm_with_update_functional.default,
    torch.ops.aten._batch_norm_no_update.default,
})
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _cpu_kernel_dtypes(func: Any, args: tuple, kwargs: dict) -> tuple[torch.dtype | None, ...] | None:
    """The dtypes the CPU kernel gives the outputs of ``func`` where its fake kernel gives others (None: it agrees;
    a None entry: that output agrees)."""
    if func is torch.ops.aten.native_group_norm_backward.default:
        source = args[1] if len(args) > 1 else kwargs.get("input")
        if isinstance(source, torch.Tensor) and source.device.type == "cpu":
            return (source.dtype,)  # the input's gradient
        return None
    if func not in _CPU_MIXED_NORMS:
        return None
    source = args[0] if args else None
    if not isinstance(source, torch.Tensor) or source.device.type != "cpu" or source.dtype not in _LOW_PRECISION:
        return None
    others = pytree.tree_leaves((args[1:], kwargs))
    if not any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in others):
        return None
    # the saved statistics, after the output; running statistics keep their own (float32) dtype already
    return (None, torch.float32, torch.float32)


class FakeTrace:
    """The step traced on fake tensors: ``MeasuredTrace``'s memory timeline without running a real step.

        planner = autockpt.Planner.from_model(model, example_inputs=(x,), trace_source=FakeTrace())

    ``device``: where the fake step runs, and whose memory it counts (CUDA: in the allocator's 512-byte blocks, which
    needs a CUDA device); default the model's device, the CPU for a model on the meta device. Tensors elsewhere (a
    meta model's, inputs beside it) become fakes of their shapes on it.

    ``flops_per_ms``: unit times are not measured; None (the default) leaves every time 0, a rate makes each unit's
    forward time its FLOPs (``torch.utils.flop_counter``: matmuls, convolutions, attention; 0 for the rest) divided
    by it, and the step three times the forward (backward: twice the forward's FLOPs). Either way a placeholder, marked
    by ``StepTrace.times_measured = False``: plans made from it choose by memory (and by FLOPs) alone. The planner's
    default timing replaces them by benchmarked ones; ``timing=measure.timing.MeasuredTiming()`` keeps them.
    """

    name = "fake"

    def __init__(self, *, device: torch.device | str | None = None, flops_per_ms: float | None = None) -> None:
        if flops_per_ms is not None and not flops_per_ms > 0:
            raise ValueError(f"flops_per_ms must be a positive rate (FLOPs per millisecond) or None, got {flops_per_ms!r}")
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "meta":
            raise ValueError("device='meta': give the device the step is planned for (e.g. 'cpu', 'cuda')")
        if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r}: the trace counts CUDA memory through torch.cuda's allocator, which this process "
                "does not have (no CUDA device); trace on 'cpu' (no 512-byte allocator rounding) or on a CUDA machine"
            )
        self.flops_per_ms = flops_per_ms

    def trace_device(self, step: StepInputs) -> torch.device:
        """Where the fake step runs: ``device``, else the model's device (the CPU for a model on the meta device)."""
        if self.device is not None:
            return self.device
        device = step.device
        return torch.device("cpu") if device.type == "meta" else device

    def trace(self, graph: Graph, step: StepInputs, request: TraceRequest) -> StepTrace:
        mode = _fake_mode_for(graph)
        fake = FakeStep.of(graph, step, mode, self.trace_device(step))
        with mode:
            try:
                trace = trace_step(
                    fake.graph, fake.args, fake.kwargs, step.loss, timed=False, warm_up=False,
                    time_repeated_blocks_once=request.time_repeated_blocks_once,
                    gradient_lifetimes=request.gradient_lifetimes, output_held=request.output_held,
                )
            except (ProfileError, LossFunctionError) as error:
                _raise_fake_step_error(error, graph)
                raise
            trace = with_foreign_bytes_counted(trace, fake.device, fake.graph.model, fake.args, fake.kwargs)
            trace = self._with_placeholder_times(trace)
            cost = request.optimizer_step
            if request.optimizer is not None and cost is None:
                cost = _fake_optimizer_step(fake, graph, request.optimizer, request.planned_device_type)
        return in_the_loop(trace, cost, request)

    def optimizer_step(
        self, graph: Graph, step: StepInputs, optimizer: Any, planned_device_type: str | None = None
    ) -> OptimizerStepCost:
        """The optimizer's states and step (``loop.measure_optimizer_step``) on fakes of the model's parameters:
        what ``trace`` adds for ``TraceRequest.optimizer``, alone (``autockpt.estimate`` reports both)."""
        mode = _CpuFakeTensorMode(allow_non_fake_inputs=True)
        fake = FakeStep.of(graph, step, mode, self.trace_device(step))
        with mode:
            return _fake_optimizer_step(fake, graph, optimizer, planned_device_type)

    def _with_placeholder_times(self, trace: StepTrace) -> StepTrace:
        if self.flops_per_ms is None:
            return trace
        units = tuple(dataclasses.replace(u, forward_ms=u.flops / self.flops_per_ms) for u in trace.units)
        forward_ms = sum(u.forward_ms for u in units)
        return dataclasses.replace(trace, units=units, forward_ms=forward_ms, step_ms=3 * forward_ms)


@dataclasses.dataclass(frozen=True, slots=True)
class FakeStep:
    """The captured step on fake tensors: a copy of the graph (model and executable) whose parameters, buffers and
    tensor attributes are fake, and fake example inputs. Tensors shared between them (tied weights, an input passed
    twice) stay shared; views of one storage stay views of one fake storage."""

    graph: Graph
    args: tuple
    kwargs: dict
    mode: FakeTensorMode
    fakes: dict[int, torch.Tensor]  # id of a real (or meta) tensor -> its fake
    originals: list[torch.Tensor]  # those tensors

    @property
    def device(self) -> torch.device:
        return device_of(self.graph.model, self.args, self.kwargs)

    @staticmethod
    def of(graph: Graph, step: StepInputs, mode: FakeTensorMode, device: torch.device) -> FakeStep:
        """The fake step on ``device``: tensors there become fakes of themselves (``FakeTensorMode.from_tensor``),
        others (a meta model's, real token ids beside it) fakes of their metadata on ``device``."""
        fakes: dict[int, torch.Tensor] = {}
        originals: list[torch.Tensor] = []  # the tensors the ids stand for, alive while the ids are looked up
        (model, executable), (args, kwargs) = fake_copies(
            (graph.model, graph.executable), (step.args, step.kwargs), lambda t: fake_of(t, mode, device),
            fakes, originals,
        )
        if isinstance(executable, fx.GraphModule) and device.type != "meta":
            _move_device_constants(executable, "meta", device)  # export wrote the meta device into the graph
        fake_graph = dataclasses.replace(graph, model=model, executable=executable)
        return FakeStep(graph=fake_graph, args=args, kwargs=kwargs, mode=mode, fakes=fakes, originals=originals)

    def optimizer_factory(self, optimizer: Any) -> Any:
        """``loop.optimizer_factory`` over the fake model: an optimizer over the real parameters is rebuilt over their
        fakes (its settings and a fake copy of its state)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            return optimizer_factory(self.graph.model, optimizer)
        missing = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in self.fakes)
        if missing:
            raise ValueError(
                f"the optimizer ({type(optimizer).__name__}) holds {missing} parameters that are not the model's: "
                "pass the optimizer made over this model's parameters"
            )

        def make() -> torch.optim.Optimizer:
            # as ``loop._rebuilt`` makes it, over the fakes, with fakes of its state (fake tensors cannot be
            # deep-copied, which loading a state dict does)
            groups = [
                {**{k: self._fake_state(v) for k, v in group.items() if k != "params"},
                 "params": [self.fakes[id(p)] for p in group["params"]]}
                for group in optimizer.param_groups
            ]
            accepted = inspect.signature(type(optimizer)).parameters
            made = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
            for param, state in optimizer.state.items():
                made.state[self.fakes[id(param)]] = {k: self._fake_state(v) for k, v in state.items()}
            return made

        return make

    def _fake_state(self, value: Any) -> Any:
        """A fake of an optimizer state; a step counter (one element) keeps its value, which the step reads."""
        if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor):
            return value
        if value.numel() <= 1 and value.device.type != "meta":
            with unset_fake_temporarily():  # a copy: the fake step adds to its constant, in place
                value = value.detach().clone()
            return self.mode.fake_tensor_converter.from_real_tensor(self.mode, value, make_constant=True)
        return self.mode.from_tensor(value, static_shapes=True)


def _fake_mode_for(graph: Graph) -> FakeTensorMode:
    """The fake mode a step of ``graph`` runs in; real tensors a loss function closes over become fake. A graph that
    checks values the eager course read (``capture.value_guards``) reads them as unbacked symbols, its checks
    deferred: a fake trace has no values, and every course of those values has the same tensors' shapes."""
    if graph.kind is CaptureKind.EXPORT and value_guards(graph.executable):
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        return _CpuFakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
    return _CpuFakeTensorMode(allow_non_fake_inputs=True)


def _fake_optimizer_step(
    fake: FakeStep, graph: Graph, optimizer: Any, planned_device_type: str | None
) -> OptimizerStepCost:
    """The optimizer's step on the fakes, running torch's default implementation for the device planned for (the
    fake step's own by default): torch picks the for-loop for any fake tensor, where real CUDA tensors get foreach."""
    try:
        return measure_optimizer_step(
            fake.optimizer_factory(optimizer), fake.graph.model, fake.device,
            implementation_of=planned_device_type or fake.device.type,
        )
    except Exception as error:
        _raise_fake_step_error(error, graph, what="the optimizer's step")
        raise


def _move_device_constants(gm: fx.GraphModule, device_type: str, device: torch.device) -> None:
    """Replace the devices of type ``device_type`` in the arguments of ``gm``'s nodes (a copy's) by ``device``: a
    graph exported on a model on the meta device creates tensors there and asserts that its tensors are there."""
    moved = False

    def move(value: Any) -> Any:
        nonlocal moved
        if isinstance(value, torch.device) and value.type == device_type:
            moved = True
            return device
        return value

    for node in gm.graph.nodes:
        node.args = fx.node.map_aggregate(node.args, move)
        node.kwargs = fx.node.map_aggregate(node.kwargs, move)
    if moved:
        gm.recompile()


def _raise_fake_step_error(error: BaseException, graph: Graph, *, what: str = "the training step") -> None:
    """Raise a ``FakeStepError`` naming the op and the model's line when ``error`` came from a step that cannot run on
    fake tensors (it needed tensor values, or an op has no fake kernel); return otherwise."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(
        cause, (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
    ):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return
    op = str(getattr(cause, "func", "") or cause)
    where = _user_frame(cause)
    if isinstance(cause, UnsupportedOperatorException):
        reason = f"{op} has no fake (meta) kernel"
    elif isinstance(cause, DynamicOutputShapeException):
        reason = f"{op} makes an output whose shape depends on tensor values"
    else:
        reason = f"{op} reads a tensor's value (a data-dependent branch, .item(), float(tensor), bool(tensor))"
    raise FakeStepError(
        f"{what} of {type(graph.model).__name__} ({graph.kind.value} capture) cannot run on fake tensors, which have "
        f"shapes but no values: {reason}{f', at {where}' if where else ''}. Trace it on real tensors instead "
        "(trace='measured', which a model on the meta device cannot be: it needs real weights and inputs).",
        op=op,
    ) from error


def _user_frame(error: BaseException) -> str:
    """The innermost frame of the traceback outside torch and autockpt ('' if none): where the model asked."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or "/autockpt/measure/" in path or "/autockpt/runtime/" in path or path.startswith("<"):
            continue
        line = f": {frame.line.strip()}" if frame.line else ""
        return f"{path.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}{line}"
    return ""
