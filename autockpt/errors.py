"""Exception types raised by autockpt. Every message says what was given, what was expected and what to do."""

from __future__ import annotations


class AutockptError(Exception):
    """Base class of the errors autockpt raises on purpose."""


class InfeasibleBudgetError(AutockptError, ValueError):
    """The budget is below the smallest peak any plan can reach.

    ``min_feasible_bytes`` is the smallest predicted peak autockpt found; a budget at or above it is accepted.
    ``host_pool_bytes_needed``: a host pool (``host_pool_gb``) of that many bytes makes the budget feasible by
    offloading (None: no pool would, or it was not looked for).
    """

    def __init__(
        self, message: str, *, budget_bytes: int, min_feasible_bytes: int, host_pool_bytes_needed: int | None = None
    ) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.host_pool_bytes_needed = host_pool_bytes_needed


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
