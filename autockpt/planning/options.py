"""PlanOptions: the one value that carries what every entry point shares (how to checkpoint, the host pool, the loop,
the solver, strictness, compilation, which trace and timing, the device planned for). Every entry point
(``optimize``, ``plan``, ``Planner.from_model``, ``plan_pipeline``, ``compare_pipeline_splits``, ``plan_fsdp``,
``estimate``, ``max_batch_size``, the command line) takes it as ``options=``; its fields given as keyword arguments
are the friendly spelling, checked against this one definition (``resolve_options``): an unknown name is a
``TypeError`` that lists the options, an option the entry point cannot honour is refused by name.

A new option is added here once: a field with its default and its line in the docstring, its check in
``__post_init__``, and the entry points that cannot honour it name it in their ``refused``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from autockpt.core.devices import DeviceSpec, device_spec
from autockpt.core.solve.base import SolverOptions, checked_checkpoint
from autockpt.measure.loop import NAMED_OPTIMIZERS, OptimizerSpec, check_accumulation_steps
from autockpt.measure.sources import TraceSource
from autockpt.measure.timing import Timing, check_timing
from autockpt.types import Action, describe_value
from autockpt.units import GB

if TYPE_CHECKING:
    from autockpt.records.plan import Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """What to plan with, checked when made. GB = 10^9 bytes.

    ``checkpoint``: "auto" (plan for each recompute action; ``optimize`` times the candidates), or
    ``Action.RECOMPUTE_TORCH`` / ``Action.RECOMPUTE_OWN`` (or their values). ``host_pool_gb``: the most host memory
    saved tensors may be offloaded into (0: recompute only; "auto": half the host memory available when planning).
    ``optimizer``: the optimizer (or a factory such as ``torch.optim.AdamW``) whose step the budget covers.
    ``gradient_accumulation_steps``: micro-steps per optimizer step. ``solver``: ``SolverOptions``. ``strict``: a step
    larger than the planned one raises ``UnplannedStepError`` instead of running unplanned. ``compiled``: True or a
    dict of ``torch.compile`` keyword arguments: the budget is kept by the compiled step (not with a host pool).
    ``output_held``: the training loop holds the model's output through backward and the optimizer step (True, the
    default: ``out = model(x); loss_fn(out).backward()``); False: the output is gone before backward, as in Hugging
    Face's ``Trainer``, torchtitan's train step (``del pred``) and ``model(**batch).loss.backward()``: the plan counts
    what of it backward does not keep (a causal LM's logits) as freed there. The optimized module checks the loop on
    its first steps and says when it differs.

    Where the step is known from and the device planned for: ``trace``: "auto" (a fake trace when the unmodified step
    would not fit the device memory, else a measured one), "measured", "fake", or a ``TraceSource``; ``timing``:
    "auto", "measured", "roofline", "benchmark", or a ``Timing``; ``target``: a device of the table
    (``autockpt.core.devices``, e.g. "h100-sxm-80gb") or a ``DeviceSpec`` to plan for another device than the model's
    (None: the model's); ``device_memory_bytes``: the memory of the device planned for (None: the target's, or on
    CUDA what is free now).

    ``optimizer`` also takes a name: "adam", "adamw", "sgd" (torch's, with momentum for SGD) or "none" (None).

    ``loss_chunk_tokens``: the output projection and the cross-entropy computed over chunks of tokens, so the full
    logits, their upcast, softmax and gradient never exist at once (``measure/chunked_tail.py``; the loss inside the
    model's graph). "auto" (default): the planner decides, chunked or not and which chunk, with recompute and offload
    under the one budget; 0: never; a positive integer: always, in chunks of that many tokens.
    """

    checkpoint: Action | str = "auto"
    host_pool_gb: float | str = 0
    optimizer: OptimizerSpec | None = None
    gradient_accumulation_steps: int = 1
    solver: SolverOptions = field(default_factory=SolverOptions)
    strict: bool = False
    compiled: bool | Mapping[str, Any] = False
    output_held: bool = True
    trace: str | TraceSource = "auto"
    timing: str | Timing = "auto"
    target: str | DeviceSpec | None = None
    device_memory_bytes: int | None = None
    loss_chunk_tokens: int | str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "checkpoint", checked_checkpoint(self.checkpoint))
        host_pool_gb_checked(self.host_pool_gb)
        object.__setattr__(self, "optimizer", _checked_optimizer(self.optimizer))
        _check_where(self.trace, self.timing, self.target, self.device_memory_bytes)
        check_accumulation_steps(self.gradient_accumulation_steps)
        if not isinstance(self.solver, SolverOptions):
            raise TypeError(f"solver must be autockpt.SolverOptions, got {describe_value(self.solver)}")
        if not isinstance(self.strict, bool):
            raise TypeError(f"strict must be True or False, got {describe_value(self.strict)}")
        if not isinstance(self.output_held, bool):
            raise TypeError(
                f"output_held must be True (the loop holds the model's output through backward) or False (it drops "
                f"it before backward, as Hugging Face's Trainer does), got {describe_value(self.output_held)}"
            )
        if self.loss_chunk_tokens != "auto" and (
            isinstance(self.loss_chunk_tokens, bool) or not isinstance(self.loss_chunk_tokens, int)
            or self.loss_chunk_tokens < 0
        ):
            raise ValueError(
                f"loss_chunk_tokens={self.loss_chunk_tokens!r}: give \"auto\" (the planner decides), 0 (the loss as "
                "the model computes it) or a positive number of tokens per chunk"
            )
        if not isinstance(self.compiled, (bool, Mapping)):
            raise TypeError(
                f"compiled={self.compiled!r}: give True, False, or a dict of torch.compile keyword arguments "
                "(e.g. compiled={'mode': 'max-autotune'})"
            )
        if self.compiled is not False and self.host_pool_gb != 0:
            raise ValueError(
                f"compiled={self.compiled!r} with host_pool_gb={self.host_pool_gb!r}: offloading is not measured under "
                "torch.compile; give host_pool_gb=0 to compile, or compiled=False to offload"
            )

    def given(self) -> tuple[str, ...]:
        """The options that differ from their defaults."""
        default = PlanOptions()
        return tuple(f.name for f in fields(self) if getattr(self, f.name) != getattr(default, f.name))


def _checked_optimizer(optimizer: Any) -> Any:
    """The optimizer option: None, an optimizer, a function making one, or a name ("none" is None)."""
    if isinstance(optimizer, str):
        if optimizer == "none":
            return None
        if optimizer not in NAMED_OPTIMIZERS:
            raise ValueError(
                f"optimizer={optimizer!r}: the names are {', '.join([*NAMED_OPTIMIZERS, 'none'])}; or give a "
                "torch.optim.Optimizer, or a function making one from a list of parameters (torch.optim.AdamW)"
            )
        return optimizer
    if optimizer is not None and not callable(optimizer) and not hasattr(optimizer, "step"):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, a function making one from a list of parameters "
            f"(e.g. torch.optim.AdamW) or a name ({', '.join(NAMED_OPTIMIZERS)}), got {describe_value(optimizer)}"
        )
    return optimizer


TRACES = ("auto", "fake", "measured")


def _check_where(trace: Any, timing: Any, target: Any, device_memory_bytes: Any) -> None:
    """The trace, timing, target and device memory options (what they mean: ``PlanOptions``)."""
    if isinstance(trace, str):
        if trace not in TRACES:
            raise ValueError(f"trace={trace!r}: choose one of {', '.join(TRACES)}, or give a TraceSource")
    elif not callable(getattr(trace, "trace", None)):
        raise TypeError(
            f"trace must be one of {TRACES} or a TraceSource (an object with name and trace(graph, step, request)), "
            f"got {type(trace).__name__}"
        )
    check_timing(timing)
    if target is not None:
        device_spec(target)  # an unknown name raises, listing the table
    if device_memory_bytes is not None and (
        isinstance(device_memory_bytes, bool) or not isinstance(device_memory_bytes, int) or device_memory_bytes <= 0
    ):
        raise ValueError(
            f"device_memory_bytes must be a positive whole number of bytes, got {describe_value(device_memory_bytes)}"
        )


OPTION_NAMES = tuple(f.name for f in fields(PlanOptions))
_OLDER_SPELLINGS = {"solver_options": "solver", "trace_source": "trace"}  # older name -> the field; None: default


def resolve_options(
    options: PlanOptions | None, keywords: Mapping[str, Any], *, entry_point: str, refused: Sequence[str] = ()
) -> PlanOptions:
    """``options`` with the options given as keyword arguments (``keywords``: what the entry point's
    ``**option_keywords`` collected). A name that is not a ``PlanOptions`` field is a ``TypeError`` naming the
    options (and the closest one); ``solver_options`` is the older spelling of ``solver``. An option given both ways
    must agree, else ``ValueError`` naming it. An option in ``refused`` that differs from its default is refused by
    name: the entry point cannot honour it."""
    if options is not None and not isinstance(options, PlanOptions):
        raise TypeError(f"options must be autockpt.PlanOptions, got {describe_value(options)}")
    unknown = [name for name in keywords if name not in OPTION_NAMES and name not in _OLDER_SPELLINGS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], OPTION_NAMES, n=1)
        raise TypeError(
            f"{entry_point}() got an unexpected keyword argument {unknown[0]!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; its options are the fields of autockpt.PlanOptions: {', '.join(OPTION_NAMES)}"
        )
    resolved = _merged(options, dict(keywords))
    refusing = [name for name in refused if name in resolved.given()]
    if refusing:
        raise ValueError(
            f"{entry_point} cannot honour {', '.join(refusing)} (given: "
            + ", ".join(f"{name}={getattr(resolved, name)!r}" for name in refusing)
            + "); leave it at its default"
        )
    return resolved


def _merged(options: PlanOptions | None, given: dict[str, Any]) -> PlanOptions:
    for older, name in _OLDER_SPELLINGS.items():
        if older in given:
            value = given.pop(older)
            if name in given and value is not None and given[name] != value:
                raise ValueError(f"give {name}= or {older}= (its older name), not both")
            if value is not None:
                given[name] = value
    for name in ("checkpoint", "host_pool_gb"):  # None: the default (an older spelling: plan_fsdp's pool)
        if name in given and given[name] is None:
            del given[name]
    if options is None:
        return PlanOptions(**given)
    merged = dataclasses.replace(options, **given)  # each value as PlanOptions keeps it ("none" is None)
    for name, value in given.items():
        if getattr(merged, name) != getattr(options, name):
            raise ValueError(
                f"{name}={value!r} disagrees with options.{name}={getattr(options, name)!r}; give it once, either as "
                "a keyword argument or in PlanOptions"
            )
    return options


def host_pool_gb_checked(host_pool_gb: Any) -> float | str:
    """Check the host pool argument (GB = 10^9 bytes, or "auto")."""
    if host_pool_gb == "auto":
        return host_pool_gb
    if isinstance(host_pool_gb, bool) or not isinstance(host_pool_gb, numbers.Real) or not math.isfinite(host_pool_gb) \
            or host_pool_gb < 0:
        raise ValueError(
            f"host_pool_gb must be a number of GB (10^9 bytes) >= 0 or 'auto', got {describe_value(host_pool_gb)}; "
            "0 (the default) offloads nothing"
        )
    return host_pool_gb


def pool_bytes_of(host_pool_gb: float | str, available_host_bytes: Callable[[], int]) -> int:
    """The host pool's capacity in bytes: "auto" is half of ``available_host_bytes()`` (read only then)."""
    if host_pool_gb == "auto":
        return available_host_bytes() // 2
    return int(float(host_pool_gb_checked(host_pool_gb)) * GB)


def pareto_budgets(the_plan: Plan, points: int) -> list[int]:
    """``points`` budgets evenly spaced from the smallest feasible peak to the unmodified peak (both included)."""
    low, high = the_plan.min_feasible_bytes, the_plan.baseline_peak_bytes
    if points == 1 or high <= low:
        return [low]
    return [round(low + (high - low) * i / (points - 1)) for i in range(points)]


def budget_to_bytes(budget_gb: Any, budget_bytes: Any) -> int:
    """Check the budget arguments; GB = 10^9 bytes."""
    if (budget_gb is None) == (budget_bytes is None):
        raise ValueError(
            f"give exactly one of budget_gb (GB = 10^9 bytes) or budget_bytes; got budget_gb={budget_gb!r}, "
            f"budget_bytes={budget_bytes!r}"
        )
    name, value = ("budget_gb", budget_gb) if budget_gb is not None else ("budget_bytes", budget_bytes)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        # ValueError for every bad budget, as for one that is not positive: one exception to catch
        raise ValueError(f"{name} must be a positive number, got {describe_value(value)} ({type(value).__name__})")  # noqa: TRY004
    if not math.isfinite(float(value)) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if name == "budget_bytes" and float(value) != int(value):
        raise ValueError(f"budget_bytes must be a whole number of bytes, got {value!r}; for GB use budget_gb=")
    result = round(float(value) * GB) if name == "budget_gb" else int(value)
    if result <= 0:
        raise ValueError(f"{name}={value!r} is less than one byte; give the budget in {'GB' if name == 'budget_gb' else 'bytes'}")
    return result


def checkpoint_choice(options: PlanOptions) -> Action | str:
    """The checkpoint choice: ``options.checkpoint``, or ``SolverOptions(checkpoint=)``, its older spelling."""
    return options.checkpoint if options.checkpoint != "auto" else options.solver.checkpoint
