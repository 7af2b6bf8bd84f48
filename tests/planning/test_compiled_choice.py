"""Which plan ``optimize(..., compiled=True)`` keeps (``autockpt.planning.compiled.compiled_module``): when the compiled step
leaves headroom, every plan whose compiled step fits is a candidate, and the fastest by measured step time is kept
(of steps tied within a few per cent, the lowest peak); when none fits down to the eager floor, the structural plans
are compiled before the budget is refused.

The eager prediction of what recomputation costs does not carry over to compiled code (Inductor fuses what a region
recomputes): on CPU, in experiments/bench/bench_compile.py, the looser plans chosen by their predicted overhead ran slower
compiled than a tighter one. The planner here is real; only the compiled step's readings (a chosen amount under the
eager peak) and the step times are scripted, so which plan is faster is the test's choice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import pytest
import torch
from support import loss_of, mlp, with_times_from_flops
from torch import nn

import autockpt
from autockpt.measure.step import StepMeasurement
from autockpt.planning.compiled import compiled_module
from autockpt.records.plan import Plan
from autockpt.runtime.rewrite import OptimizedModule


@dataclasses.dataclass
class ScriptedCompile:
    """A Planner whose compiled steps read ``compiled_peak(plan, eager peak)`` and whose fastest step is the
    candidate at ``fastest`` (an index into the modules timed)."""

    planner: autockpt.Planner
    compiled_peak: Callable[[Plan, int], int]
    fastest: int | None = 0  # None: every step takes as long
    timed: list[int] = dataclasses.field(default_factory=list)  # how many modules each timing compared
    compiled: list[str] = dataclasses.field(default_factory=list)  # each compiled plan's strategy

    def optimize(self, budget_gb: float | None = None, *, budget_bytes: int | None = None) -> OptimizedModule:
        return self.planner.optimize(budget_gb, budget_bytes=budget_bytes)

    def structural_plan(self, strategy: str) -> Plan | None:
        return self.planner.structural_plan(strategy)

    def apply(self, plan: Plan) -> OptimizedModule:
        return self.planner.apply(plan)

    def measure_compiled(self, compiled: nn.Module, module: OptimizedModule) -> StepMeasurement:
        self.compiled.append(module.plan.strategy)
        eager = self.planner.measure(module)
        return dataclasses.replace(eager, peak_bytes=self.compiled_peak(module.plan, eager.peak_bytes))

    def alternating_step_seconds(self, modules: Sequence[nn.Module]) -> list[list[float]]:
        self.timed.append(len(modules))
        fastest = None if self.fastest is None else range(len(modules))[self.fastest]
        return [[1.0 if fastest in (None, index) else 1.5] * 5 for index in range(len(modules))]


def mlp_planner() -> tuple[autockpt.Planner, int, int]:
    """A planner of a 6-layer MLP, its eager floor and its unmodified peak. Its times are injected, not measured
    (issue 46: which plans a budget gives, and so which candidates fit, followed the machine's load): each unit's
    from its FLOPs and output bytes (``with_times_from_flops``), the checkpoint machinery at fixed prices."""
    model, x = mlp(), torch.randn(512, 128)
    planner = autockpt.Planner.from_model(model, example_inputs=(x,), loss_fn=loss_of)
    planner.trace = with_times_from_flops(planner.trace)
    planner.costs = dataclasses.replace(planner.costs, prices=tuple(  # the actions priced so far (offload is not)
        dataclasses.replace(price, region_ms=0.7, saved_tensor_ms=0.07) for price in planner.costs.prices))
    with pytest.raises(autockpt.InfeasibleBudgetError) as floor:
        planner.plan(budget_bytes=1)
    return planner, floor.value.min_feasible_bytes, planner.plan(budget_bytes=10**15).baseline_peak_bytes


@pytest.mark.parametrize("fastest", [0, -1], ids=["tightest_fastest", "loosest_fastest"])
def test_the_fastest_compiled_plan_that_fits_is_kept(fastest: int) -> None:
    planner, floor, unmodified = mlp_planner()
    budget = (floor + unmodified) // 2
    # every compiled step a quarter of the activations under the eager one: the looser plans fit too
    scripted = ScriptedCompile(planner, lambda plan, eager: eager - (unmodified - floor) // 4, fastest=fastest)
    # the eager backend: nothing is compiled here, the scripted planner reads the eager module
    compiled = compiled_module(scripted, budget, {"backend": "eager"})
    kept = compiled._orig_mod
    assert scripted.timed and scripted.timed[0] >= 2, "the test needs at least two plans that fit"
    (note,) = [note for note in kept.plan.notes if "compiled with torch.compile" in note]
    assert f"kept of {scripted.timed[0]} compiled plans that fit the lowest peak" in note
    if fastest == 0:
        # the candidates in order: one half way down to the eager floor, the plan for the budget, looser ones
        assert kept.plan.budget_bytes < budget, note
    else:
        assert kept.plan.budget_bytes > budget, note


def test_when_no_eager_plan_compiles_under_the_budget_a_structural_plan_is_tried() -> None:
    """The compiled peak does not follow the eager one (on CPU a GPT-NeoX's eager floor plan compiled to 2.48 MB, its
    region-per-layer plan to 2.02 MB): when every eager plan down to the floor compiles over the budget, the
    structural plans are compiled before the budget is refused."""
    planner, floor, unmodified = mlp_planner()
    budget = (floor + unmodified) // 2
    scripted = ScriptedCompile(planner, lambda plan, eager: budget - 1 if plan.strategy == "every_1" else budget + 1)
    compiled = compiled_module(scripted, budget, {"backend": "eager"})
    assert compiled._orig_mod.plan.strategy == "every_1"
    assert scripted.compiled[0] == "autockpt" and "every_1" in scripted.compiled


def test_a_refusal_states_the_lowest_compiled_peak_of_every_plan_tried() -> None:
    planner, floor, unmodified = mlp_planner()
    budget = (floor + unmodified) // 2
    # every plan compiles over the budget; the structural ones the least
    scripted = ScriptedCompile(planner, lambda plan, eager: budget + (10 if plan.strategy != "autockpt" else 1000))
    with pytest.raises(autockpt.InfeasibleBudgetError) as refusal:
        compiled_module(scripted, budget, {"backend": "eager"})
    assert refusal.value.min_feasible_bytes == budget + 10
    assert "structural plans" in str(refusal.value)


def test_of_compiled_plans_equally_fast_the_lowest_peak_is_kept() -> None:
    planner, floor, unmodified = mlp_planner()
    budget = (floor + unmodified) // 2
    scripted = ScriptedCompile(planner, lambda plan, eager: eager - (unmodified - floor) // 4, fastest=None)
    kept = compiled_module(scripted, budget, {"backend": "eager"})._orig_mod
    assert scripted.timed and scripted.timed[0] >= 2, "the test needs at least two plans that fit"
    # the plan half way down to the eager floor is the tightest: its eager peak, and its scripted compiled one, lowest
    assert kept.plan.budget_bytes < budget


def test_a_budget_under_the_eager_floor_states_the_structural_plans_compiled_peaks() -> None:
    """Under the eager floor no eager plan is made; the structural plans are compiled, and when none fits the refusal
    states the lowest of their compiled peaks (not the eager floor, which would be refused again)."""
    planner, floor, _ = mlp_planner()
    budget = floor - 1000
    scripted = ScriptedCompile(planner, lambda plan, eager: floor + 500)
    with pytest.raises(autockpt.InfeasibleBudgetError) as refusal:
        compiled_module(scripted, budget, {"backend": "eager"})
    assert "every_1" in scripted.compiled
    assert refusal.value.min_feasible_bytes == floor + 500
    assert "structural plans" in str(refusal.value)


class _CompiledWrapper(nn.Module):
    """What the timing reads of ``torch.compile(module)``'s wrapper: the module it compiled, as ``_orig_mod``. (A real
    compile traced the checkpointed step with Dynamo for most of this test's 4 s, issue 46; compiled steps are
    measured for real in ``tests/runtime/test_compile.py``.)"""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._orig_mod = module

    def forward(self, *args: object, **kwargs: object) -> object:
        return self._orig_mod(*args, **kwargs)


def test_candidates_are_timed_in_train_mode_when_the_model_is_in_eval_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """An optimized module in eval mode runs the original model: timing candidates so would compare nothing. A
    compiled candidate's mode is its compiled module's (``_orig_mod``: another module than the first candidate)."""
    planner, floor, unmodified = mlp_planner()
    planner.model.eval()
    the_plan = planner.plan(budget_bytes=(floor + unmodified) // 2)
    module, compiled_module = planner.apply(the_plan), planner.apply(the_plan)
    assert not module.training and not compiled_module.training
    planned_runs: dict[int, int] = {}
    run_planned = OptimizedModule._run_planned

    def counted(self: OptimizedModule, args: tuple, kwargs: dict) -> object:
        planned_runs[id(self)] = planned_runs.get(id(self), 0) + 1
        return run_planned(self, args, kwargs)

    monkeypatch.setattr(OptimizedModule, "_run_planned", counted)
    planner.alternating_step_seconds([module, _CompiledWrapper(compiled_module).eval()])
    assert min(planned_runs.get(id(m), 0) for m in (module, compiled_module)) >= 5, planned_runs
    assert not module.training and not compiled_module.training and not planner.model.training
