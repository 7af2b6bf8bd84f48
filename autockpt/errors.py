"""Exception types raised by autockpt. Every message says what was given, what was expected and what to do."""

from __future__ import annotations

from collections.abc import Callable


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of an error's message, at most ``limit`` characters ('' when it has none): for messages that
    quote an error from elsewhere."""
    text = str(error).strip().splitlines()
    return text[0][:limit] if text else ""


class AutockptError(Exception):
    """Base class of the errors autockpt raises on purpose."""


class InfeasibleBudgetError(AutockptError, ValueError):
    """The budget is below the smallest peak any plan can reach.

    ``min_feasible_bytes`` is the smallest predicted peak autockpt found; a budget at or above it is accepted.
    A budget under what the step still holds when it ends (the static bytes: parameters, gradients, optimizer
    states, buffers, inputs; the model's output and ``optimizer.step()``'s temporaries) is refused before any floor is
    searched (``core/solve/refine.py``, ``refuse_static_over_budget``): then ``lower_bound_bytes`` is that bound, no
    plan goes under it, and ``min_feasible_bytes`` is searched when first read (the floor search the refusal skipped:
    seconds to a minute on a model of billions of parameters), then kept. Over the static bytes, the message states
    the floor (reading it searches the floor): a budget that close needs the floor to be chosen.
    ``host_pool_bytes_needed``: a host pool (``host_pool_gb``) of that many bytes makes the budget feasible by
    offloading (None: no pool would, or it was not looked for).
    """

    def __init__(
        self,
        message: str,
        *,
        budget_bytes: int,
        min_feasible_bytes: int | Callable[[], int],
        host_pool_bytes_needed: int | None = None,
        lower_bound_bytes: int | None = None,
        searched_message: Callable[[], str] | None = None,
    ) -> None:
        super().__init__(message)
        # the message is the searched floor's refusal (reading it searches the floor first): where the refusal came
        # before the search and the user needs the floor to choose a budget
        self._searched_message = searched_message
        self.budget_bytes = budget_bytes
        self._min_feasible: int | Callable[[], int] = min_feasible_bytes
        self.host_pool_bytes_needed = host_pool_bytes_needed
        # known without a search: min_feasible_bytes is at least this (None: min_feasible_bytes itself is known)
        self.lower_bound_bytes = lower_bound_bytes

    def __str__(self) -> str:
        if self._searched_message is not None:
            self.min_feasible_bytes  # noqa: B018  the search that the message states
            return self._searched_message()
        return super().__str__()

    @property
    def min_feasible_bytes(self) -> int:
        """The smallest predicted peak found; searched now when the refusal did not search it (see the class)."""
        if callable(self._min_feasible):
            self._min_feasible = int(self._min_feasible())
        return self._min_feasible

    @min_feasible_bytes.setter
    def min_feasible_bytes(self, value: int) -> None:
        self._min_feasible = value

    @property
    def floor_searched(self) -> bool:
        """Whether ``min_feasible_bytes`` is known (reading it then searches nothing)."""
        return not callable(self._min_feasible)

    @property
    def known_bound_bytes(self) -> int:
        """``min_feasible_bytes`` where known, else ``lower_bound_bytes``: what is known of the floor without a search."""
        if not self.floor_searched:
            assert self.lower_bound_bytes is not None, "a refusal whose floor is searched later states its bound"
            return self.lower_bound_bytes
        return self._min_feasible


class LossFunctionError(AutockptError, ValueError):
    """The loss function did not return a scalar tensor that backward can start from."""


class CaptureError(AutockptError, RuntimeError):
    """No capture path (fx, export, module-level) could run the model on the example inputs."""


class ProfileError(AutockptError, RuntimeError):
    """Running the captured graph forward and backward on the example inputs failed."""


class FakeStepError(ProfileError):
    """The training step cannot run on fake tensors (``autockpt.measure.fake.FakeTrace``): its Python code needs a
    tensor's value (a data-dependent branch, ``.item()``), an op makes an output whose shape depends on values, or an
    op has no fake kernel. ``op`` names the op."""

    def __init__(self, message: str, *, op: str | None = None) -> None:
        super().__init__(message)
        self.op = op


class PlanMismatchError(AutockptError, ValueError):
    """A saved plan was applied to a model or inputs other than the ones it was made for."""


class PlanFileError(AutockptError, ValueError):
    """A plan file could not be read: not JSON, not an autockpt plan, or a schema version this autockpt does not know."""


class UnplannedStepError(AutockptError, RuntimeError):
    """A training step could not run under the plan (inputs larger than planned, or conditions changed) and the
    optimized module is in strict mode (``OptimizedModule.strict``), so it was not run over the budget."""
