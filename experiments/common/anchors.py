"""External anchors: other projects' activation checkpointing, run for real on the same model and inputs.

* ``hf_gradient_checkpointing``: Hugging Face's own ``model.gradient_checkpointing_enable(
  gradient_checkpointing_kwargs={"use_reentrant": False})`` (diffusers: ``enable_gradient_checkpointing()``, which
  uses ``use_reentrant=False`` itself) on a copy of the model. Peak by ``autockpt.measure_step`` (MemTracker on CPU,
  ``torch.cuda.max_memory_allocated`` on CUDA).
* ``torch_sac_milp``: PyTorch's module-level selective-activation-checkpointing MILP
  (``torch.distributed._tools.sac_ilp.sac_milp``) fed by its own estimators (MemTracker, RuntimeEstimator and
  SACEstimator in "operator-level-benchmark" mode: ops timed with CUDA events on CUDA, timed here on CPU). Its
  answer, a fraction of each chosen module's activation memory to discard, is applied as PyTorch intends: per module,
  ``get_optimal_checkpointing_policy_per_module`` picks which ops to save, and the module's forward runs under
  ``torch.utils.checkpoint(use_reentrant=False, context_fn=create_selective_checkpoint_contexts(policy))``.
  Peak by ``autockpt.measure_step``.
* ``torch_compile_budget``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` set to the
  budget's fraction (0 = recompute everything the partitioner can, 1 = its default). MemTracker cannot see
  allocations inside Inductor's compiled code, so the peak is measured with ``torch.profiler``
  (``profile_memory=True``): the highest running total of CPU allocator bytes during one step, plus the bytes of
  parameters, buffers and inputs that exist before the step. That method reads a few per cent above MemTracker on
  eager code (the allocator sees kernel workspaces MemTracker does not), so the eager model is measured the same
  way (``eager_profiler_peak_bytes``) to compare like with like. On CUDA the caching allocator sees every
  allocation, compiled or not, so the peak is ``torch.cuda.max_memory_allocated`` as for every other strategy.

Each anchor runs on a copy of the model while the model itself stays where it is: on CUDA, where
``max_memory_allocated`` counts everything the process holds, the model's parameters would be counted in the copy's
peak (46.5 MB on the H100 sweep's GPT-2, before this was noticed), so a CUDA peak here is the copy's own step: the
measured peak less ``StepMeasurement.foreign_bytes``, the bytes allocated when the step started that it does not own.

Every function returns an ``AnchorResult``; an anchor that cannot run says why (``status`` unavailable, ``reason``)
instead of raising, so a sweep can put a "not available: reason" row in its table.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn

from autockpt.measure.loss import default_loss
from autockpt.measure.step import StepMeasurement, measure_step

logger = logging.getLogger(__name__)

GIB = 2**30


class AnchorStatus(str, Enum):
    MEASURED = "measured"
    INFEASIBLE = "infeasible"  # the anchor ran and reported that it cannot meet the budget
    UNAVAILABLE = "unavailable"  # the anchor cannot run on this model / machine (``reason`` says why)


class PeakMethod(str, Enum):
    MEMTRACKER = "memtracker"  # torch.distributed._tools.mem_tracker.MemTracker, as autockpt.measure_step on CPU
    CUDA_ALLOCATOR = "max_memory_allocated"  # torch.cuda.max_memory_allocated, as autockpt.measure_step on CUDA
    PROFILER = "profiler"  # torch.profiler CPU allocator events + static bytes


def step_peak_method(model: nn.Module) -> PeakMethod:
    """How ``autockpt.measure_step`` measures a step of ``model`` (it follows the parameters' device)."""
    on_cuda = any(p.is_cuda for p in model.parameters())
    return PeakMethod.CUDA_ALLOCATOR if on_cuda else PeakMethod.MEMTRACKER


@dataclass(frozen=True, kw_only=True, slots=True)
class AnchorResult:
    strategy: str
    status: AnchorStatus
    module: nn.Module | None = None  # runs one step like the original model (for timing); None unless measured
    measured_peak_bytes: int | None = None
    peak_method: PeakMethod = PeakMethod.MEMTRACKER
    predicted_peak_bytes: int | None = None  # the anchor's own prediction, where it makes one
    solve_time_s: float = 0.0  # time the anchor spent deciding (estimators + MILP, or compilation)
    reason: str = ""
    notes: tuple[str, ...] = field(default=())
    eager_profiler_peak_bytes: int | None = None  # profiler method on the unmodified eager model (CPU only)


# ------------------------------------------------------------------------------------------------ Hugging Face


def hf_gradient_checkpointing(
    model: nn.Module, args: tuple, kwargs: Mapping[str, Any], loss_fn: Callable[[Any], torch.Tensor] | None
) -> AnchorResult:
    """Hugging Face's own per-layer checkpointing on a deep copy of ``model``."""
    strategy = "hf_gradient_checkpointing"
    twin = copy.deepcopy(model)
    started = time.perf_counter()
    try:
        if hasattr(twin, "gradient_checkpointing_enable"):  # transformers
            twin.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            how = "transformers gradient_checkpointing_enable(use_reentrant=False)"
        elif hasattr(twin, "enable_gradient_checkpointing"):  # diffusers (use_reentrant=False by default)
            twin.enable_gradient_checkpointing()
            how = "diffusers enable_gradient_checkpointing() (use_reentrant=False)"
        else:
            return AnchorResult(
                strategy=strategy, status=AnchorStatus.UNAVAILABLE,
                reason=f"{type(model).__name__} is not a Hugging Face model (no gradient_checkpointing_enable)",
            )
    except ValueError as error:  # the model class does not support gradient checkpointing
        return AnchorResult(strategy=strategy, status=AnchorStatus.UNAVAILABLE, reason=str(error).splitlines()[0])
    twin.train()
    solve_s = time.perf_counter() - started
    peak = own_step_peak(measure_step(twin, args, dict(kwargs), loss_fn))
    return AnchorResult(
        strategy=strategy, status=AnchorStatus.MEASURED, module=twin, measured_peak_bytes=peak, solve_time_s=solve_s,
        peak_method=step_peak_method(twin), notes=(how,),
    )


# ------------------------------------------------------------------------------------------------ SAC MILP


def torch_sac_milp(
    model: nn.Module,
    args: tuple,
    kwargs: Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    *,
    budget_bytes: int,
) -> AnchorResult:
    """PyTorch's module-level SAC MILP under ``budget_bytes``, applied through ``torch.utils.checkpoint``."""
    strategy = "torch_sac_milp"
    try:
        import pwlf  # noqa: F401  (SACEstimator's trade-off curves need it)
        from torch.distributed._tools.sac_ilp import sac_milp  # noqa: F401  (needs pulp)
    except ImportError as error:
        return AnchorResult(strategy=strategy, status=AnchorStatus.UNAVAILABLE, reason=f"import failed: {error}")
    if not all(p.requires_grad for p in model.parameters()):
        return AnchorResult(
            strategy=strategy, status=AnchorStatus.UNAVAILABLE,
            reason="MemTracker (the MILP's memory estimator) cannot track frozen parameters",
        )
    loss_fn = loss_fn or default_loss
    kwargs = dict(kwargs)
    started = time.perf_counter()
    try:
        decisions, recompute_ms, predicted_peak, sac_estimator = _sac_decisions(model, args, kwargs, loss_fn, budget_bytes)
    except Exception as error:  # noqa: BLE001  the estimators are private tools: report, do not crash the sweep
        logger.info("SAC MILP failed on %s: %r", type(model).__name__, error)
        return AnchorResult(
            strategy=strategy, status=AnchorStatus.UNAVAILABLE,
            reason=f"PyTorch's estimators/MILP failed on this model: {_first_line(error)}",
        )
    solve_s = time.perf_counter() - started
    if predicted_peak < 0:
        return AnchorResult(
            strategy=strategy, status=AnchorStatus.INFEASIBLE, solve_time_s=solve_s,
            reason=f"sac_milp found no solution under {budget_bytes / GIB:.4f} GiB (it returned peak -1)",
        )
    twin = copy.deepcopy(model)
    twin.train()
    wrapped, notes = _apply_sac(twin, decisions, sac_estimator)
    try:
        peak = own_step_peak(measure_step(twin, args, kwargs, loss_fn))
        _step(twin, args, kwargs, loss_fn)  # a second step: SAC's cache checks fire in backward
    except RuntimeError as error:
        return AnchorResult(
            strategy=strategy, status=AnchorStatus.UNAVAILABLE, solve_time_s=solve_s,
            reason=f"the MILP's decision ({len(wrapped)} modules) does not run under torch.utils.checkpoint: {_first_line(error)}",
        )
    notes = (f"{len(wrapped)} modules checkpointed: " + ", ".join(f"{m} discard {decisions[m]:.2f}" for m in wrapped[:6])
             + (" ..." if len(wrapped) > 6 else ""), f"MILP recompute estimate {recompute_ms} ms", *notes)
    return AnchorResult(
        strategy=strategy, status=AnchorStatus.MEASURED, module=twin, measured_peak_bytes=peak,
        peak_method=step_peak_method(twin), predicted_peak_bytes=int(predicted_peak), solve_time_s=solve_s, notes=notes,
    )


def _sac_decisions(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable[[Any], torch.Tensor], budget_bytes: int
) -> tuple[dict[str, float], float, int, Any]:
    """Run PyTorch's three estimators on a fake copy of the model (as they require) and solve ``sac_milp``.

    Their "operator-level-benchmark" mode times ops with CUDA events and the cost model needs CUDA's peak FLOP/s, so
    on CPU each op is timed here instead (random inputs of the fake tensors' shapes, median of 3 runs with
    ``time.perf_counter``); on CUDA, and everywhere else, it is PyTorch's code.
    """
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode
    from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator
    from torch.distributed._tools.sac_ilp import sac_milp

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # a loss_fn may hold real label tensors
    with FakeCopyMode(fake_mode):
        fake_model = copy.deepcopy(model)
    fake_model.train()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    on_cpu = device.type == "cpu"
    fake_args, fake_kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, fake_mode.from_tensor, (args, kwargs))

    def step() -> None:
        for param in fake_model.parameters():
            param.grad = None
        loss_fn(fake_model(*fake_args, **fake_kwargs)).backward()

    with fake_mode, contextlib.redirect_stdout(io.StringIO()):  # RuntimeEstimator prints its total
        mem_tracker = MemTracker()
        mem_tracker.track_external(fake_model)
        with mem_tracker:
            step()
        runtime_estimator = RuntimeEstimator()
        with runtime_estimator("operator-level-benchmark"):
            if on_cpu:
                runtime_estimator._estimate = _cpu_op_time  # type: ignore[attr-defined]
            step()
        sac_estimator = SACEstimator()
        with sac_estimator("operator-level-benchmark"):
            if on_cpu:
                sac_estimator._estimate_runtime = _cpu_op_time  # type: ignore[attr-defined]
            step()
    module_info = aggregate_stats(fake_model, mem_tracker, runtime_estimator, sac_estimator, device)
    sac_graph = parse_module_info(module_info)
    with _quiet("torch.distributed._tools.sac_ilp"):
        decisions, recompute_ms, predicted_peak = sac_milp(sac_graph, memory_budget=budget_bytes / GIB, world_size=1)
    return decisions, recompute_ms, predicted_peak, sac_estimator


def _cpu_op_time(func: Any, args: Any, kwargs: Any) -> tuple[Any, float]:
    """(fake result, CPU milliseconds of the real op on random inputs of the same shapes)."""
    from torch.utils._mode_utils import no_dispatch

    result = func(*args, **(kwargs or {}))
    if torch.Tag.inplace_view in func.tags or func._overloadpacket in _view_ops():
        return result, 0.0

    def real(value: Any) -> Any:
        if isinstance(value, torch._subclasses.fake_tensor.FakeTensor):
            if value.dtype.is_floating_point or value.dtype.is_complex:
                return torch.rand_like(value, device="cpu")
            return torch.ones_like(value, device="cpu")
        return value

    try:
        with no_dispatch():
            real_args, real_kwargs = torch.utils._pytree.tree_map(real, (args, kwargs or {}))
            func(*real_args, **real_kwargs)
            times = []
            for _ in range(3):
                started = time.perf_counter()
                func(*real_args, **real_kwargs)
                times.append((time.perf_counter() - started) * 1000)
        return result, sorted(times)[1]
    except Exception:  # noqa: BLE001  an op that cannot run on random inputs (indices out of range, ...): count no time
        return result, 0.0


@functools.cache
def _view_ops() -> frozenset:
    from torch.distributed._tools.runtime_estimator import _VIEW_OPS

    return frozenset(_VIEW_OPS)


def _apply_sac(model: nn.Module, decisions: Mapping[str, float], sac_estimator: Any) -> tuple[list[str], tuple[str, ...]]:
    """Wrap every chosen module's forward in selective checkpointing with PyTorch's per-module op policy."""
    from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP
    from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module

    root = type(model).__name__
    wrapped: list[str] = []
    notes: list[str] = []
    for fqn in sorted(decisions, key=lambda f: f.count(".")):  # outer modules first; nested choices are skipped
        ratio = decisions[fqn]
        if ratio <= 0 or any(fqn.startswith(w + ".") for w in wrapped):
            continue
        path = fqn.removeprefix(root).removeprefix(".")
        module = model.get_submodule(path) if path else model
        stats = sac_estimator.sac_mod_stats.get(fqn)
        if stats is None:
            notes.append(f"{fqn}: no SAC statistics, left as is")
            continue
        with _quiet("torch.distributed._tools.sac_ilp"):
            saves = get_optimal_checkpointing_policy_per_module(stats, memory_budget=max(0.0, 1.0 - ratio))
        if not saves:
            notes.append(f"{fqn}: per-module policy MILP failed, left as is")
            continue
        module.forward = functools.partial(_checkpointed_forward, module.forward, tuple(saves), OPS_TO_ALWAYS_SKIP, fqn)
        wrapped.append(fqn)
    return wrapped, tuple(notes)


def _checkpointed_forward(forward: Callable[..., Any], saves: tuple[int, ...], skipped: Any, fqn: str, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def context() -> Any:
        counters = {False: 0, True: 0}  # op index in the forward and in the recomputation

        def policy(ctx: Any, func: Any, *op_args: Any, **op_kwargs: Any) -> CheckpointPolicy:
            if func in skipped:
                return CheckpointPolicy.PREFER_RECOMPUTE
            index = counters[ctx.is_recompute]
            counters[ctx.is_recompute] += 1
            if index >= len(saves):  # more ops than SACEstimator saw: recompute them
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if saves[index] == 1 else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)


# ------------------------------------------------------------------------------------------------ torch.compile


def torch_compile_budget(
    model: nn.Module,
    args: tuple,
    kwargs: Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    *,
    fraction: float,
) -> AnchorResult:
    """``torch.compile`` of a copy of ``model`` with ``activation_memory_budget = fraction``; peak by the profiler
    on CPU, by ``torch.cuda.max_memory_allocated`` on CUDA.

    The copy is compiled by a backend of its own (Inductor with the budget set while it partitions): Dynamo keeps a
    compiled graph for the backend that made it, so copies compiled at other budgets (same class, same code) do not
    reuse each other's graphs, and all of them stay compiled side by side (to be timed in one round robin).
    """
    strategy = "torch_compile_budget"
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"activation_memory_budget is a fraction in [0, 1], got {fraction!r}")
    twin = copy.deepcopy(model)
    twin.train()
    loss_fn = loss_fn or default_loss
    kwargs = dict(kwargs)
    on_cuda = step_peak_method(model) is PeakMethod.CUDA_ALLOCATOR
    eager_peak = None if on_cuda else profiler_peak_bytes(model, args, kwargs, loss_fn)
    started = time.perf_counter()
    try:
        compiled = torch.compile(twin, backend=_inductor_at_memory_budget(fraction))
        _step(compiled, args, kwargs, loss_fn)  # compiles forward (partitioned under the budget) and backward
    except Exception as error:  # noqa: BLE001  compilation fails in many ways: reported as not available
        return AnchorResult(
            strategy=strategy, status=AnchorStatus.UNAVAILABLE,
            reason=f"torch.compile failed: {_first_line(error)}",
        )
    compile_s = time.perf_counter() - started
    _step(compiled, args, kwargs, loss_fn)  # a second step: nothing left to compile
    if on_cuda:
        peak, method = own_step_peak(measure_step(compiled, args, kwargs, loss_fn)), PeakMethod.CUDA_ALLOCATOR
    else:
        peak, method = profiler_peak_bytes(compiled, args, kwargs, loss_fn, static_from=twin), PeakMethod.PROFILER
    return AnchorResult(
        strategy=strategy, status=AnchorStatus.MEASURED, module=compiled, measured_peak_bytes=peak,
        peak_method=method, solve_time_s=compile_s, eager_profiler_peak_bytes=eager_peak,
        notes=(f"activation_memory_budget={fraction:.3f}; compile {compile_s:.0f} s",),
    )


def own_step_peak(measurement: StepMeasurement) -> int:
    """The peak of the measured step's own tensors: on CUDA less what was allocated before it that it does not own
    (the original model beside the anchor's copy); on CPU MemTracker counts the step's own already."""
    return measurement.peak_bytes - measurement.foreign_bytes


def _inductor_at_memory_budget(fraction: float) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]:
    """A Dynamo backend: Inductor, with ``activation_memory_budget`` set while AOTAutograd partitions each graph (the
    partition is decided when the forward compiles). A new backend object per call: Dynamo guards each compiled graph
    on the backend that made it."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def inductor_at_budget(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        with functorch_config.patch(activation_memory_budget=fraction):
            return compile_fx(graph, example_inputs)

    return inductor_at_budget


def profiler_peak_bytes(
    module: nn.Module,
    args: tuple,
    kwargs: Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    static_from: nn.Module | None = None,
) -> int:
    """Peak of one step from the CPU allocator's events in ``torch.profiler``, plus parameters, buffers and inputs
    (``autockpt.measure.step.measure_compiled_step``): works on compiled code, where MemTracker sees nothing."""
    from autockpt.measure.step import measure_compiled_step

    with _quiet("torch.profiler"):
        return measure_compiled_step(module, args, kwargs, loss_fn, static_from=static_from).peak_bytes


def _first_line(error: BaseException, limit: int = 160) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    text = f"{type(error).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _step(module: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable[[Any], torch.Tensor]) -> None:
    for param in module.parameters():
        param.grad = None
    loss_fn(module(*args, **kwargs)).backward()


class _quiet:
    """Silence a logger for a block (the SAC MILP logs at INFO on every call, and an ERROR when infeasible)."""

    def __init__(self, name: str) -> None:
        self.logger = logging.getLogger(name)
        self.level = self.logger.level

    def __enter__(self) -> None:
        self.level = self.logger.level
        self.logger.setLevel(logging.CRITICAL)  # the MILP logs an ERROR when infeasible: reported in the result instead

    def __exit__(self, *exc: object) -> None:
        self.logger.setLevel(self.level)
