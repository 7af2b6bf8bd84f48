"""PlanOptions: the one value that carries what every entry point shares (how to checkpoint, the host pool, the loop,
the solver, strictness, compilation). ``optimize``, ``plan``, ``Planner.from_model`` and ``plan_pipeline`` take it as
``options=``; their keyword arguments of the same names stay as the friendly spelling (``resolve_options``).

A new option is added here once: a field, its check in ``__post_init__``, and the entry points that do not support it
yet name it in ``unsupported``'s refusal.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from autockpt.core.solve.base import SolverOptions, checked_checkpoint
from autockpt.measure.loop import OptimizerSpec, check_accumulation_steps
from autockpt.types import Action, describe_value
from autockpt.units import GB

if TYPE_CHECKING:
    from autockpt.records.plan import Plan


class _Unset:
    """A keyword argument the caller did not give (its value then comes from ``options``)."""

    def __repr__(self) -> str:
        return "<from options>"


UNSET: Any = _Unset()


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
    """

    checkpoint: Action | str = "auto"
    host_pool_gb: float | str = 0
    optimizer: OptimizerSpec | None = None
    gradient_accumulation_steps: int = 1
    solver: SolverOptions = field(default_factory=SolverOptions)
    strict: bool = False
    compiled: bool | Mapping[str, Any] = False
    output_held: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "checkpoint", checked_checkpoint(self.checkpoint))
        host_pool_gb_checked(self.host_pool_gb)
        if self.optimizer is not None and not callable(self.optimizer) and not hasattr(self.optimizer, "step"):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or a function making one from a list of parameters "
                f"(e.g. torch.optim.AdamW), got {describe_value(self.optimizer)}"
            )
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


def resolve_options(options: PlanOptions | None, **keywords: Any) -> PlanOptions:
    """``options`` with the keyword arguments the caller gave (those not ``UNSET``). A keyword ``solver_options`` is
    the older spelling of ``solver``. An option given both ways must agree: else ``ValueError`` naming it."""
    if options is not None and not isinstance(options, PlanOptions):
        raise TypeError(f"options must be autockpt.PlanOptions, got {describe_value(options)}")
    given = {name: value for name, value in keywords.items() if value is not UNSET}
    if "solver_options" in given:
        solver = given.pop("solver_options")
        if solver is not None:
            given["solver"] = solver
    if "checkpoint" in given and given["checkpoint"] is None:  # None: the default choice (an older spelling)
        del given["checkpoint"]
    if options is None:
        return PlanOptions(**given)
    for name, value in given.items():
        if getattr(options, name) != value:
            raise ValueError(
                f"{name}={value!r} disagrees with options.{name}={getattr(options, name)!r}; give it once, either as "
                "a keyword argument or in PlanOptions"
            )
    return options


def unsupported(options: PlanOptions, entry_point: str, names: tuple[str, ...]) -> None:
    """Refuse the options ``entry_point`` does not support yet (never ignore them silently)."""
    refused = [name for name in names if name in options.given()]
    if refused:
        raise ValueError(
            f"{entry_point} does not support {', '.join(refused)} yet (given: "
            + ", ".join(f"{name}={getattr(options, name)!r}" for name in refused)
            + "); leave it at its default"
        )


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
