"""Courses: a step whose tensor values lead the model another way than the example's runs under a plan made for it.

The captured program follows the eager model's course (``measure/eager_paths.py``). Where that course was chosen
by reading tensor values (Hugging Face: "does this attention mask pad anything?"), the graph checks the values it
was captured on at run time; a batch that reads otherwise (padding present where the example had none) fails that
check before anything it chose is computed. Here such a step is planned afresh, on its own inputs, under the same
budget and options (``Planner.from_model(...).optimize``: capture, trace, solve, one measured step), and the result
is kept for the next step that takes that course. A course whose own plan cannot keep the budget (its eager program
needs more memory than the example's) is refused with the reason; the optimized module then warns and runs the
original model, or raises in strict mode.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from autockpt.errors import InfeasibleBudgetError
from autockpt.measure.capture import value_guards
from autockpt.runtime.model_state import preserved_model_state
from autockpt.runtime.rewrite import OptimizedModule, is_other_course

logger = logging.getLogger(__name__)

DEFAULT_MAX_COURSES = 4  # plans kept besides the example's: each holds a captured graph


@dataclasses.dataclass(frozen=True, slots=True)
class CourseVariant:
    """One course planned besides the example's: its module and how long planning it took."""

    module: OptimizedModule
    planning_s: float


class CourseVariants:
    """The plans made for other courses of one optimized module (``OptimizedModule.attach_courses``)."""

    def __init__(
        self, replan: Callable[[tuple, dict], OptimizedModule], *, max_courses: int = DEFAULT_MAX_COURSES
    ) -> None:
        self._replan = replan
        self._max_courses = max_courses
        self._variants: list[CourseVariant] = []

    def variants(self) -> list[CourseVariant]:
        return list(self._variants)

    def run(self, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        for variant in self._variants:
            try:
                return True, variant.module.run_planned_step(args, kwargs)
            except RuntimeError as error:
                if not is_other_course(error):
                    raise
        if len(self._variants) >= self._max_courses:
            return False, f"{self._max_courses} other courses are planned already (the most kept)"
        started = time.perf_counter()
        logger.warning("autockpt: these inputs take another course through the model than the example's; "
                       "planning it (once) under the same budget")
        try:
            module = self._replan(args, kwargs)
        except InfeasibleBudgetError as error:
            return False, f"its own plan cannot keep the budget ({error})"
        except Exception as error:  # noqa: BLE001 - any failure to plan the course: the step runs unplanned
            return False, f"planning it failed: {type(error).__name__}: {error}"
        variant = CourseVariant(module=module, planning_s=time.perf_counter() - started)
        self._variants.append(variant)
        logger.info("planned another course in %.1f s", variant.planning_s)
        return True, module.run_planned_step(args, kwargs)


def with_other_courses(module: OptimizedModule, planner: Any) -> OptimizedModule:
    """``module`` (made by ``planner.optimize``) with steps of other courses planned as ``planner`` planned it: same
    model, loss, options, device memory and budget; only where its graph checks values at run time."""
    executable = module.__dict__["_autockpt_executable"]
    if executable is None or not value_guards(executable):
        return module
    budget_bytes = module.plan.budget_bytes

    def plan_course(args: tuple, kwargs: dict) -> OptimizedModule:
        course = type(planner).from_model(
            planner.model, example_inputs=args, example_kwargs=kwargs, loss_fn=planner.request.loss,
            options=planner.options, device_memory_bytes=planner.device_memory_bytes,
        )
        return course.optimize(budget_bytes=budget_bytes)

    return attach_courses(module, plan_course)


def attach_courses(
    module: OptimizedModule, plan_course: Callable[[tuple, dict], OptimizedModule]
) -> OptimizedModule:
    """``module`` with steps of other courses planned by ``plan_course(args, kwargs)`` (the model's state, RNG and
    gradients left as they were by planning: only the step itself changes them)."""
    model = module.original_module

    def replan(args: tuple, kwargs: dict) -> OptimizedModule:
        with preserved_model_state(model, args, kwargs):
            return plan_course(args, kwargs)

    module.attach_courses(CourseVariants(replan))
    return module
