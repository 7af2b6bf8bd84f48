"""Measure one real training step: the reference every prediction is checked against.

Peak means the highest total of live tensor bytes on the model's device during forward + ``loss.backward()``
(+ ``optimizer.step()`` when an optimizer is given), gradients ``None`` at the start (zeros with gradient
accumulation), inputs allocated beforehand, the module's output held until the step ends (as the profile holds it; a
loop that drops it before backward peaks lower by what of it backward does not keep, a causal LM's logits:
``output_held=False`` measures that loop). On CPU it
is MemTracker's peak "Total" with the module and the inputs tracked as external; on CUDA it is
``torch.cuda.max_memory_allocated``, and beside it ``torch.cuda.max_memory_reserved`` (what the caching allocator held
from the device: allocated plus its cached, partly used blocks; the figure an out-of-memory error is about).

The device bytes a step does not own (``foreign_bytes``): on CUDA every tensor the process holds counts against the
device, so what is allocated beyond the step's own tensors (another model, a cache, leftovers, kernel workspaces)
is part of every peak. The planner reads it when it solves and when it verifies, not only when it profiles. On CPU
PyTorch keeps no such count: ``held_beside_step`` names the tensors to count (the seam tests drive the same
mechanism through on CPU).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autockpt.measure.loop import OptimizerSpec, check_accumulation_steps, optimizer_factory, state_tensors
from autockpt.measure.loss import default_loss
from autockpt.measure.storage_tracker import StorageTracker
from autockpt.measure.trace import device_of, step_tensors
from autockpt.runtime.model_state import weights_put_back
from autockpt.runtime.output_watch import unwatched_steps
from autockpt.runtime.rewrite import OptimizedModule


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMeasurement:
    peak_bytes: int  # CUDA: torch.cuda.max_memory_allocated; CPU: MemTracker's peak
    loss: float
    device: str
    # CUDA: torch.cuda.max_memory_reserved over the step (allocated plus the allocator's cached blocks); None on CPU
    reserved_bytes: int | None = None
    # device bytes the step did not own when it started, part of ``peak_bytes`` (``foreign_bytes``)
    foreign_bytes: int = 0


_held_beside_step: contextvars.ContextVar[tuple[torch.Tensor, ...]] = contextvars.ContextVar(
    "autockpt_held_beside_step", default=()
)


@contextlib.contextmanager
def held_beside_step(*tensors: torch.Tensor) -> Iterator[None]:
    """Count ``tensors`` as device memory the step does not own while the block runs (another model, a cache).

    On CUDA this changes nothing: ``torch.cuda.memory_allocated`` counts every tensor the process holds already.
    On CPU, where PyTorch keeps no such count, it is how a program tells autockpt what lives beside the step:
    ``foreign_bytes`` counts them, ``measure_step`` counts them in its peak (as CUDA's counter would), and a
    ``Planner`` solving or verifying inside the block plans for them. Nested blocks add up.
    """
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"held_beside_step takes tensors, got {type(tensor).__name__}")
    token = _held_beside_step.set(_held_beside_step.get() + tensors)
    try:
        yield
    finally:
        _held_beside_step.reset(token)


def owned_bytes(device: torch.device, owned: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``owned`` as the trace counts them (on CUDA in 512-byte allocator blocks)."""
    return StorageTracker(device, list(owned)).static_bytes


def foreign_bytes(device: torch.device, owned: Sequence[torch.Tensor]) -> int:
    """Bytes on ``device`` now that none of ``owned`` (the step's parameters, buffers, gradients and inputs:
    ``trace.step_tensors``) accounts for.

    CUDA: ``torch.cuda.memory_allocated`` minus ``owned`` counted as the trace counts them (the same reading the
    trace's first event starts from). Other devices: the tensors named by ``held_beside_step`` on ``device``, less
    any storage the step owns.
    """
    if device.type == "cuda":
        seen = StorageTracker(device, list(owned))
        return max(0, seen.live_bytes - seen.static_bytes)
    held = [t for t in _held_beside_step.get() if t.device == device]
    if not held:
        return 0
    return owned_bytes(device, [*owned, *held]) - owned_bytes(device, owned)


def measure_step(
    module: nn.Module,
    example_inputs: tuple = (),
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    optimizer: OptimizerSpec | None = None,
    gradient_accumulation_steps: int = 1,
    output_held: bool = True,
) -> StepMeasurement:
    """Run forward + backward once (gradients are left on the parameters) and return the peak bytes.

    On CPU the peak is MemTracker's; MemTracker cannot track a module with frozen parameters (it hooks every
    parameter's gradient), so such modules are measured with autockpt's own tracker, which counts the same storages.
    On CUDA it is ``torch.cuda.max_memory_allocated``: everything the process holds on the device counts
    (``StepMeasurement.foreign_bytes`` says how much of it the step did not own when it started), and
    ``reserved_bytes`` is ``torch.cuda.max_memory_reserved`` beside it. On CPU tensors named by ``held_beside_step``
    count from the start, as CUDA's counter would count them.

    A module whose plan offloads has a host pool: on CUDA it is host memory and not counted; on CPU, where the host
    is the device, MemTracker counts its buffer, and the peak returned is the step's *device* bytes without it (the
    budget's bytes; the pool is ``OptimizedModule.host_pool_bytes`` more, bounded by ``host_pool_gb``).

    The step as a loop runs it: with ``optimizer`` (an optimizer over the module's parameters, or a function making
    one, as ``autockpt.optimize`` takes it) two steps run, each forward + backward + ``optimizer.step()`` on a fresh
    copy of the optimizer, and the peak is the higher (the first makes the states, the second has them); the
    parameters' values are put back afterwards and the given optimizer is never stepped. With
    ``gradient_accumulation_steps`` > 1 every measured step starts with gradients alive (zeros). ``output_held=False``:
    the module's output is dropped before backward (the loop of Hugging Face's Trainer and torchtitan).
    """
    kwargs = dict(example_kwargs or {})
    loss_fn = loss_fn or default_loss
    device = device_of(module, example_inputs, kwargs)
    return _measured_loop(
        module, example_inputs, kwargs, optimizer, gradient_accumulation_steps,
        lambda the_optimizer: _one_step(
            module, example_inputs, kwargs, loss_fn, device, the_optimizer, output_held=output_held
        ),
    )


def _measured_loop(
    owner: nn.Module,
    args: tuple,
    kwargs: dict,
    optimizer: OptimizerSpec | None,
    gradient_accumulation_steps: int,
    one_step: Callable[[torch.optim.Optimizer | None], tuple[int, int | None, float]],
) -> StepMeasurement:
    """The step as a loop runs it, each step measured by ``one_step`` (peak, reserved peak or None, loss): one step,
    or two on a fresh copy of ``optimizer`` (states made, then alive) with ``owner``'s weights put back after; every
    step starts with gradients None, zeros when accumulating."""
    accumulating = check_accumulation_steps(gradient_accumulation_steps) > 1
    make_optimizer = optimizer_factory(owner, optimizer) if optimizer is not None else None
    device = device_of(owner, args, kwargs)
    params = list(owner.parameters())
    # the optimizer's steps move the weights: put back after
    with weights_put_back(params) if make_optimizer is not None else contextlib.nullcontext():
        the_optimizer = make_optimizer() if make_optimizer is not None else None
        peaks, reserved, loss, foreign = [], [], 0.0, 0
        for step in range(1 if the_optimizer is None else 2):
            for param in params:
                param.grad = torch.zeros_like(param) if accumulating and param.requires_grad else None
            if step == 0:
                foreign = foreign_bytes(device, step_tensors(owner, args, kwargs))
            with unwatched_steps():  # a measured step is not the user's loop (it names the loop it measures)
                peak, reserved_peak, loss = one_step(the_optimizer)
            peaks.append(peak)
            reserved.append(reserved_peak)
        del the_optimizer
    return StepMeasurement(
        peak_bytes=max(peaks), loss=loss, device=str(device), foreign_bytes=foreign,
        reserved_bytes=None if None in reserved else max(reserved),
    )

def _one_step(
    module: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable[[Any], torch.Tensor], device: torch.device,
    optimizer: torch.optim.Optimizer | None, *, output_held: bool = True,
) -> tuple[int, int | None, float]:
    """The peak bytes, the peak reserved bytes (CUDA; None elsewhere) and the loss of one forward + backward
    (+ ``optimizer.step()``), gradients as they are. Tensors named by ``held_beside_step`` count from the start."""
    static = step_tensors(module, args, kwargs)
    held = [t for t in _held_beside_step.get() if t.device == device]

    def run() -> torch.Tensor:
        output = module(*args, **kwargs)
        loss = loss_fn(output)
        if not output_held:
            del output
        loss.backward()
        if optimizer is not None:
            optimizer.step()  # the output, when held, is still held, as in a loop that keeps it until the next step
        return loss

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss = run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device), float(loss.detach())

    if all(p.requires_grad for p in module.parameters()):
        tracker = step_peak_tracker()
        external = [t for t in static if not isinstance(t, nn.Parameter)]
        tracker.track_external(module, *external, *held, *([optimizer] if optimizer is not None else []))
        with tracker:
            loss = run()
        peak = tracker.get_tracker_snapshot("peak")[device]["Total"]
        if isinstance(module, OptimizedModule):
            peak -= module.host_pool_bytes
    else:
        own = StorageTracker(device, static + held + (state_tensors(optimizer) if optimizer is not None else []))
        with own:
            loss = run()
        peak = max(event.peak_bytes for event in own.events)
    return int(peak), None, float(loss.detach())


def step_peak_tracker() -> Any:
    """torch's ``MemTracker``, keeping the step's peak snapshot only. At every new peak ``MemTracker`` also stores a
    deep copy of the whole snapshot for each module running then (its per-module peaks): 40-75 % of a measured step
    of the test models on CPU (a T5 0.70 -> 0.18 s), and nothing here reads them. The byte counts, their categories
    and the step's peak are ``MemTracker``'s own, to the byte (``tests/measure/test_storage_tracker.py``)."""
    return _step_peak_tracker_class()()


@functools.cache
def _step_peak_tracker_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepPeakTracker(MemTracker):
        def _update_peak_stats(self, peak_state: Any) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot["Total"]:
                    self._peak_mem[device] = snapshot["Total"]
                    self._peak_mem_snap[device] = copy.deepcopy(snapshot)

    return StepPeakTracker


def measure_compiled_step(
    module: nn.Module,
    example_inputs: tuple = (),
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    static_from: nn.Module | None = None,
    optimizer: OptimizerSpec | None = None,
    gradient_accumulation_steps: int = 1,
    output_held: bool = True,
) -> StepMeasurement:
    """``measure_step`` for a module that runs compiled code (``torch.compile``), where MemTracker cannot see: inside
    compiled code no module hook or dispatch mode runs, but every buffer still comes from the allocator. The same
    step (gradients ``None`` at the start, zeros with accumulation; with ``optimizer`` two steps on a fresh copy of it,
    the weights put back) and the same CUDA reading, ``torch.cuda.max_memory_allocated``.

    On CPU the peak is the highest running total of the CPU allocator's events in ``torch.profiler`` during the step,
    plus what existed before it (parameters, buffers, inputs, gradients when accumulating, optimizer states on the
    second step, tensors named by ``held_beside_step``: the profiler has no events for blocks allocated before it
    started). It sees buffers an op allocates and frees inside itself, which MemTracker's storage accounting does
    not; on the eager decoders of experiments/bench/bench_compile.py it nonetheless read 1-6 % below MemTracker (not
    investigated). ``static_from``: the module whose parameters and buffers are the step's (default ``module``; give
    the compiled module's original). Run the module once before, so that compiling is not measured.
    """
    kwargs = dict(example_kwargs or {})
    loss_fn = loss_fn or default_loss
    owner = static_from or module
    device = device_of(owner, example_inputs, kwargs)
    held = [t for t in _held_beside_step.get() if t.device == device]

    def one_step(the_optimizer: torch.optim.Optimizer | None) -> tuple[int, int | None, float]:
        if device.type == "cuda":
            return _one_step(
                module, example_inputs, kwargs, loss_fn, device, the_optimizer, output_held=output_held
            )
        existing = step_tensors(owner, example_inputs, kwargs) + held
        existing += state_tensors(the_optimizer) if the_optimizer is not None else []
        peak, loss = _allocator_event_step(
            module, example_inputs, kwargs, loss_fn, the_optimizer, existing, output_held=output_held
        )
        return peak, None, loss

    return _measured_loop(owner, example_inputs, kwargs, optimizer, gradient_accumulation_steps, one_step)

def _allocator_event_step(
    module: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable[[Any], torch.Tensor],
    optimizer: torch.optim.Optimizer | None, existing: list[torch.Tensor], *, output_held: bool = True,
) -> tuple[int, float]:
    """CPU: the peak of one forward + backward (+ ``optimizer.step()``) from the allocator's events in
    ``torch.profiler``, plus the bytes of ``existing`` (allocated before the profiler started), and the loss."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        output = module(*args, **kwargs)
        loss = loss_fn(output)
        if not output_held:
            del output
        loss.backward()
        if optimizer is not None:
            optimizer.step()
    changes: list[tuple[int, int]] = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            changes.append((node.start_time_ns, node.typed[1].alloc_size))  # a free is a negative size
        pending.extend(node.children)
    running = peak = 0
    for _, nbytes in sorted(changes, key=lambda change: (change[0], -change[1])):  # a tie: allocation first
        running += nbytes
        peak = max(peak, running)
    existing_bytes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in existing}
    return peak + sum(existing_bytes.values()), float(loss.detach())


def step_seconds(
    module: nn.Module, example_inputs: tuple, example_kwargs: Mapping[str, Any], loss_fn: Callable[[Any], torch.Tensor]
) -> float:
    """Wall-clock seconds of one forward + backward (gradients cleared first, the device synchronised at the end)."""
    for param in module.parameters():
        param.grad = None
    device = device_of(module, example_inputs, dict(example_kwargs))
    started = time.perf_counter()
    loss_fn(module(*example_inputs, **example_kwargs)).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def relative_step_times(seconds: Sequence[Sequence[float]]) -> list[float]:
    """Per module of ``alternating_step_seconds``'s answer, the median over rounds of its step time over the first
    module's in the same round (drift in the machine's speed cancels within a round)."""
    return [statistics.median(t / first for t, first in zip(times, seconds[0])) for times in seconds]


def alternating_step_seconds(
    modules: Sequence[nn.Module],
    example_inputs: tuple,
    example_kwargs: Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    rounds: int = 5,
) -> list[list[float]]:
    """Per module, the seconds of its step in each of ``rounds`` rounds; every module runs once per round, the order
    rotating so none always follows the same one, after one warm-up round. Compare modules round by round: drift
    in the machine's speed then cancels."""
    seconds: list[list[float]] = [[] for _ in modules]
    for round_index in range(rounds + 1):
        start = round_index % len(modules)
        for position in [*range(start, len(modules)), *range(start)]:
            with unwatched_steps():  # timing steps are not the user's loop
                elapsed = step_seconds(modules[position], example_inputs, example_kwargs, loss_fn)
            if round_index > 0:
                seconds[position].append(elapsed)
    for module in modules:
        for param in module.parameters():
            param.grad = None
    return seconds
