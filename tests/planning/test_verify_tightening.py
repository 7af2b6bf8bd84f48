"""Verification's tightening (``autockpt.planning.verify.verified_module``) when measured steps read higher than predicted.

A CUDA allocator whose cache is warm from other work can count more than the step's tensors (blocks handed out whole):
an H100 sweep saw ViT plans measure over their budget on every tightening, and ``optimize`` then called the budget
infeasible, stating a "smallest budget" just above it, while a tighter plan that kept it existed. The planner here is
real; only its measurements are read high, by an amount the test chooses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import pytest
import torch
from support import loss_of, mlp

import autockpt
from autockpt.measure.step import StepMeasurement
from autockpt.planning.verify import verified_module
from autockpt.records.plan import Plan
from autockpt.runtime.rewrite import OptimizedModule


@dataclasses.dataclass
class ReadsHigh:
    """A Planner whose measured peaks are ``extra(plan)`` bytes above the real ones; records every reading."""

    planner: autockpt.Planner
    extra: Callable[[Plan], int]
    readings: list[int] = dataclasses.field(default_factory=list)
    read_plans: list[Plan] = dataclasses.field(default_factory=list)  # the plan of each reading

    def plans_under(self, target_bytes: int, budget_bytes: int) -> list[Plan]:
        return self.planner.plans_under(target_bytes, budget_bytes)

    def floor_plans(self, floor_bytes: int, budget_bytes: int) -> list[Plan]:
        return self.planner.floor_plans(floor_bytes, budget_bytes)

    def apply(self, plan: Plan) -> OptimizedModule:
        return self.planner.apply(plan)

    def measure(self, module: OptimizedModule) -> StepMeasurement:
        measured = self.planner.measure(module)
        reading = dataclasses.replace(measured, peak_bytes=measured.peak_bytes + self.extra(module.plan))
        self.readings.append(reading.peak_bytes)
        self.read_plans.append(module.plan)
        return reading

    def alternating_step_seconds(self, modules: Sequence[OptimizedModule]) -> list[list[float]]:
        return self.planner.alternating_step_seconds(modules)


def planner_and_floor() -> tuple[autockpt.Planner, int, int]:
    model, x = mlp(), torch.randn(512, 128)
    planner = autockpt.Planner.from_model(model, example_inputs=(x,), loss_fn=loss_of)
    with pytest.raises(autockpt.InfeasibleBudgetError) as floor:
        planner.plan(budget_bytes=1)
    unmodified = planner.plan(budget_bytes=10**15)
    return planner, floor.value.min_feasible_bytes, unmodified.baseline_peak_bytes


def test_when_every_tightening_reads_over_the_floor_plan_is_tried() -> None:
    planner, floor, unmodified = planner_and_floor()
    budget = (floor + unmodified) // 2
    # every plan but the floor's reads over the budget, by more the tighter it is: a tightening by the overshoot never
    # catches up; the floor's own plan reads true and keeps the budget
    over = lambda plan: 0 if plan.predicted_peak_bytes <= floor else 2 * (budget - plan.predicted_peak_bytes) + 1
    reads_high = ReadsHigh(planner, over)
    module = verified_module(reads_high, budget)
    assert module.plan.predicted_peak_bytes <= floor
    assert module.plan.measured_peak_bytes is not None and module.plan.measured_peak_bytes <= budget
    assert any(reading > budget for reading in reads_high.readings), "the test must make some plan read over"


def test_a_budget_no_plan_keeps_states_the_floor_plans_lowest_measured_peak() -> None:
    planner, floor, unmodified = planner_and_floor()
    budget = (floor + unmodified) // 2
    # every reading over the budget, the plans at the floor the highest: the lowest reading is a looser plan's, which
    # a call at that budget need not choose again (the measured times choose it); the floor's own plans, chosen by
    # bytes, are what such a call tries last, so their lowest reading is the budget stated (issue 37)
    reads_high = ReadsHigh(planner, lambda plan: budget + (budget if plan.predicted_peak_bytes <= floor else 0))
    with pytest.raises(autockpt.InfeasibleBudgetError) as error:
        verified_module(reads_high, budget)
    by_bytes = {plan.policy.region_actions for plan in planner.floor_plans(floor, budget)}
    floor_readings = [
        reading for plan, reading in zip(reads_high.read_plans, reads_high.readings)
        if plan.policy.region_actions in by_bytes
    ]
    assert floor_readings and min(reads_high.readings) < min(floor_readings)
    assert error.value.min_feasible_bytes == min(floor_readings)
