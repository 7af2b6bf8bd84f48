"""Estimate: what one training step of a model holds in memory, by category and per module.

Like ``accelerate estimate-memory`` but traced on a step (capture + profile, nothing is solved), so it
includes what accelerate omits: activations saved for backward and the temporaries of the step. The optimizer's
states and the peak of ``optimizer.step()`` are measured too (``loop.measure_optimizer_step``: a fresh optimizer of
that kind stepped twice on the model's parameters, which are put back). A model on the meta device, or a step
predicted over the device memory, is traced on fake tensors (``trace=``): the same bytes, no real step. The optimizer
counted is ``PlanOptions.optimizer``'s (None by default: none).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autockpt.core.simulate import memory_curve
from autockpt.measure.fake import FakeTrace
from autockpt.measure.loop import measure_optimizer_step, named_optimizer, optimizer_factory, step_in_loop
from autockpt.measure.trace import device_of
from autockpt.planning.options import PlanOptions, resolve_options
from autockpt.planning.planner import Planner
from autockpt.record_types import Provenance
from autockpt.records.summary import enclosing_modules
from autockpt.types import Action, StepTrace, TrainingLoop
from autockpt.units import format_bytes

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True, kw_only=True, slots=True)
class ModuleMemory:
    """One module of the per-module table: its own parameters and the activations its ops save for backward."""

    path: str  # "" is the whole model
    depth: int
    parameter_bytes: int
    activation_bytes: int  # bytes saved for backward by the ops inside this module (unmodified step)
    forward_ms: float


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """Memory of one unmodified training step. GB = 10^9 bytes, GiB = 2^30 bytes in the text table."""

    model_class: str
    optimizer: str  # the optimizer whose states and step are counted: its name ("adam", ...), its class, or "none"
    parameter_bytes: int
    buffer_bytes: int
    input_bytes: int
    gradient_bytes: int  # one gradient per trainable parameter
    optimizer_state_bytes: int  # measured after two steps
    activation_bytes: int  # every tensor made in forward and saved for backward, counted once per storage
    step_peak_bytes: int  # measured peak of forward + backward (no optimizer state)
    training_peak_bytes: int  # a training step's peak once the optimizer has states, its optimizer.step() included
    peak_activation_bytes: int  # at that peak: forward tensors still alive
    peak_gradient_bytes: int  # at that peak: gradients made so far
    peak_temporary_bytes: int  # at that peak: everything else (backward temporaries, activation gradients)
    step_ms: float
    modules: tuple[ModuleMemory, ...]
    provenance: Provenance | None = None  # which trace and timing made the figures, for which device

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("parameters", self.parameter_bytes),
            ("buffers", self.buffer_bytes),
            ("inputs", self.input_bytes),
            ("gradients", self.gradient_bytes),
            (f"optimizer state ({self.optimizer})", self.optimizer_state_bytes),
            ("activations saved for backward", self.activation_bytes),
            ("  at the peak: activations alive", self.peak_activation_bytes),
            ("  at the peak: gradients so far", self.peak_gradient_bytes),
            ("  at the peak: temporaries", self.peak_temporary_bytes),
            ("forward + backward peak", self.step_peak_bytes),
            ("training step peak (optimizer states and step included)", self.training_peak_bytes),
        ]

    def to_dataframe(self) -> pd.DataFrame:
        """One row per category (``kind`` = "total"), then one row per module (``kind`` = "module")."""
        import pandas as pd

        totals = [{"kind": "total", "name": name, "bytes": value, "activation_bytes": None, "forward_ms": None}
                  for name, value in self.rows()]
        modules = [
            {"kind": "module", "name": m.path or "(model)", "bytes": m.parameter_bytes,
             "activation_bytes": m.activation_bytes, "forward_ms": m.forward_ms}
            for m in self.modules
        ]
        return pd.DataFrame(totals + modules)

    def table(self) -> str:
        width = max(len(name) for name, _ in self.rows())
        lines = [f"memory of one training step of {self.model_class} (GB = 10^9 bytes, GiB = 2^30 bytes)"]
        if self.provenance is not None:
            lines.append(f"  made from: {self.provenance.describe()}")
        lines += [f"  {name:<{width}}  {value:>15,d} B  {format_bytes(value)}" for name, value in self.rows()]
        if self.modules:
            path_width = max(12, *(len(m.path) + 2 * m.depth for m in self.modules))
            lines += ["", f"  {'module':<{path_width}}  {'parameters':>14}  {'activations':>14}  {'forward ms':>10}"]
            for m in self.modules:
                name = "  " * m.depth + (m.path.rsplit(".", 1)[-1] if m.path else "(model)")
                lines.append(
                    f"  {name:<{path_width}}  {_gb(m.parameter_bytes):>14}  {_gb(m.activation_bytes):>14}  {m.forward_ms:>10.2f}"
                )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# what an estimate cannot honour: it plans nothing, holds the output (the unmodified step) and runs no loop
ESTIMATE_REFUSED = ("checkpoint", "host_pool_gb", "gradient_accumulation_steps", "solver", "strict", "compiled",
                    "output_held")


def estimate(
    model: nn.Module,
    *,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    depth: int = 2,
    options: PlanOptions | None = None,
    **option_keywords: Any,
) -> MemoryEstimate:
    """Measure one training step of ``model`` on the example inputs and break its memory down.

    Options (``PlanOptions``, or its fields as keyword arguments): ``optimizer`` (None, the default, counts no
    optimizer; a name, "adam", "adamw", "sgd" (with momentum); or a factory such as ``torch.optim.AdamW``), and
    ``trace``, ``timing``, ``target``, ``device_memory_bytes`` as for ``Planner.from_model``: a model on the meta
    device (or a step predicted over the device memory) is traced on fake tensors, its optimizer's states and step
    too, and no real step runs. The options about a plan or a loop are refused (``ESTIMATE_REFUSED``). ``depth``
    limits the per-module table (0: the model only). The model is left as it was.
    """
    options = resolve_options(options, option_keywords, entry_point="autockpt.estimate", refused=ESTIMATE_REFUSED)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"depth must be an integer >= 0 (module nesting levels in the table), got {depth!r}")
    # no plan is made: one recompute action keeps the trace to what the estimate reads; the optimizer is measured
    # apart (its states and step), not in the traced loop
    planner = Planner.from_model(
        model, example_inputs=example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
        options=dataclasses.replace(options, checkpoint=Action.RECOMPUTE_TORCH, optimizer=None),
    )
    return estimate_from_planner(planner, options.optimizer, depth)


def estimate_from_planner(planner: Planner, optimizer: Any, depth: int) -> MemoryEstimate:
    """The estimate of a planner's unmodified step, with ``optimizer`` (a ``PlanOptions.optimizer`` value)."""
    measured = planner.trace
    curve = memory_curve(measured, planner.costs, ())
    peak_event = max(range(len(curve.phases)), key=curve.total_bytes.__getitem__)
    make = named_optimizer(optimizer) if isinstance(optimizer, str) else optimizer
    cost = None
    if make is not None and planner.provenance is not None and planner.provenance.trace == "fake":
        if isinstance(make, torch.optim.Optimizer):
            raise ValueError(
                f"optimizer={type(make).__name__}(...): a fake trace has no real parameters to rebuild it over; give "
                "its class or a factory (torch.optim.AdamW) or a name ('adamw')"
            )
        planned_for = planner.target.device_type if planner.target is not None else None
        cost = FakeTrace().optimizer_step(planner.graph, planner.request, make, planned_for)  # no real weights
    elif make is not None:
        device = device_of(planner.model, planner.request.args, planner.request.kwargs)
        cost = measure_optimizer_step(
            optimizer_factory(planner.model, make), planner.model, device,
            implementation_of=planner.target.device_type if planner.target is not None else None,
        )
    in_loop = step_in_loop(measured, TrainingLoop(optimizer=cost)) if cost is not None else measured
    return MemoryEstimate(
        model_class=type(planner.model).__name__,
        optimizer=_optimizer_label(optimizer),
        parameter_bytes=measured.parameter_bytes,
        buffer_bytes=measured.buffer_bytes,
        input_bytes=measured.input_bytes,
        gradient_bytes=measured.gradient_bytes,
        optimizer_state_bytes=cost.state_bytes if cost is not None else 0,
        activation_bytes=sum(s.nbytes for s in measured.storages if s.saver_units),
        step_peak_bytes=measured.baseline_peak_bytes,
        training_peak_bytes=in_loop.baseline_peak_bytes,
        peak_activation_bytes=curve.activation_bytes[peak_event],
        peak_gradient_bytes=curve.gradient_bytes[peak_event],
        peak_temporary_bytes=curve.temporary_bytes[peak_event],
        step_ms=measured.step_ms,
        modules=_module_table(planner, measured, depth),
        provenance=planner.provenance,
    )


def _optimizer_label(optimizer: Any) -> str:
    if optimizer is None or isinstance(optimizer, str):
        return optimizer or "none"
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer).__name__
    function = getattr(optimizer, "func", optimizer)  # a functools.partial: the function it binds
    return getattr(function, "__name__", type(optimizer).__name__)


def _module_table(planner: Planner, measured: StepTrace, depth: int) -> tuple[ModuleMemory, ...]:
    parameter_bytes: dict[str, int] = {}
    for name, param in planner.model.named_parameters():
        for prefix in enclosing_modules(name.rsplit(".", 1)[0] if "." in name else "", depth):
            parameter_bytes[prefix] = parameter_bytes.get(prefix, 0) + param.numel() * param.element_size()
    activation_bytes: dict[str, int] = {}
    forward_ms: dict[str, float] = {}
    for unit, cost in zip(planner.graph.units, measured.units):
        for prefix in enclosing_modules(unit.module_path, depth):
            activation_bytes[prefix] = activation_bytes.get(prefix, 0) + cost.saved_bytes
            forward_ms[prefix] = forward_ms.get(prefix, 0.0) + cost.forward_ms
    paths = sorted(set(parameter_bytes) | set(activation_bytes), key=_module_order(planner.model))
    return tuple(
        ModuleMemory(
            path=path,
            depth=0 if not path else path.count(".") + 1,
            parameter_bytes=parameter_bytes.get(path, 0),
            activation_bytes=activation_bytes.get(path, 0),
            forward_ms=forward_ms.get(path, 0.0),
        )
        for path in paths
    )


def _module_order(model: nn.Module) -> Callable[[str], tuple[int, str]]:
    """Sort modules in definition order (as ``named_modules`` lists them), unknown paths last."""
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    return lambda path: (order.get(path, len(order)), path)


def _gb(nbytes: int) -> str:
    """Decimal units sized to the value: '849.4 kB', '5.68 MB', '1.234 GB' (k = 10^3, M = 10^6, G = 10^9)."""
    for unit, scale, decimals in (("GB", 1e9, 3), ("MB", 1e6, 2), ("kB", 1e3, 1)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{decimals}f} {unit}"
    return f"{nbytes} B"
