"""PlanOptions (one validated options value for every entry point), the Planner over values and its trace-source seam,
and the facade, with the names removed in 0.3."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from support import loss_of, mlp

import autockpt
from autockpt.measure.sources import MeasuredTrace, StepInputs, TraceRequest
from autockpt.planning.options import PlanOptions, resolve_options
from autockpt.types import Graph, StepTrace


def _example() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(1)
    return mlp(), torch.randn(1024, 128)


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"checkpoint": "sometimes"}, "checkpoint must be 'auto' or one of"),
        ({"host_pool_gb": -1}, "host_pool_gb must be a number of GB"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be an integer >= 1"),
        ({"solver": {"time_limit_s": 3}}, "solver must be autockpt.SolverOptions"),
        ({"strict": "yes"}, "strict must be True or False"),
        ({"compiled": "max-autotune"}, "give True, False, or a dict of torch.compile keyword arguments"),
        ({"compiled": True, "host_pool_gb": 1}, "offloading is not measured under torch.compile"),
        ({"optimizer": 3}, "optimizer must be a torch.optim.Optimizer"),
        ({"optimizer": "lion"}, "optimizer='lion': the names are adam, adamw, sgd, none"),
        ({"trace": "real"}, "trace='real': choose one of auto, fake, measured"),
        ({"timing": "fast"}, "timing='fast': choose one of auto, measured, roofline, benchmark"),
        ({"target": "h900"}, "unknown device 'h900'"),
        ({"device_memory_bytes": 0}, "device_memory_bytes must be a positive whole number"),
    ],
)
def test_plan_options_refuse_bad_values_saying_what_was_given(given: dict, says: str) -> None:
    with pytest.raises((ValueError, TypeError), match=says):
        PlanOptions(**given)


def test_an_option_given_both_ways_must_agree() -> None:
    options = PlanOptions(strict=True, gradient_accumulation_steps=2, optimizer="none")
    assert options.optimizer is None  # "none" is None, the one default
    assert resolve_options(options, {"strict": True, "optimizer": "none"}, entry_point="f") is options
    with pytest.raises(ValueError, match=r"strict=False disagrees with options.strict=True"):
        resolve_options(options, {"strict": False}, entry_point="f")
    assert resolve_options(None, {"gradient_accumulation_steps": 3}, entry_point="f").gradient_accumulation_steps == 3
    older = resolve_options(None, {"solver_options": autockpt.SolverOptions(time_limit_s=3)}, entry_point="f")
    assert older.solver.time_limit_s == 3


def test_every_entry_point_takes_the_options_and_checks_their_names() -> None:
    """Issue 47, item 1: one definition; the keyword spelling is checked against it, not listed again by hand."""
    model, x = _example()
    entry_points = {
        "autockpt.optimize": lambda **kw: autockpt.optimize(model, budget_bytes=10**12, example_inputs=(x,), **kw),
        "autockpt.plan": lambda **kw: autockpt.plan(model, budget_bytes=10**12, example_inputs=(x,), **kw),
        "Planner.from_model": lambda **kw: autockpt.Planner.from_model(model, example_inputs=(x,), **kw),
        "autockpt.estimate": lambda **kw: autockpt.estimate(model, example_inputs=(x,), **kw),
        "plan_pipeline": lambda **kw: autockpt.plan_pipeline(model, 2, budget_bytes=10**9, example_inputs=(x,), **kw),
        "plan_fsdp": lambda **kw: autockpt.plan_fsdp(model, world_size=2, budget_bytes=10**9, example_inputs=(x,), **kw),
        "autockpt.max_batch_size": lambda **kw: autockpt.max_batch_size(
            lambda: model, lambda n: (x[:n],), budget_bytes=10**9, **kw),
    }
    for name, call in entry_points.items():
        with pytest.raises(TypeError, match=rf"{name}\(\) got an unexpected keyword argument 'checkpointt' \(did you "
                                            r"mean 'checkpoint'\?\); its options are the fields of autockpt.PlanOptions"):
            call(checkpointt="auto")
        with pytest.raises(TypeError, match="options must be autockpt.PlanOptions"):
            call(options={"checkpoint": "auto"})
    # what an entry point cannot honour is refused by name, never ignored
    refused = {"autockpt.optimize": "target", "autockpt.plan": "strict", "autockpt.estimate": "checkpoint",
               "plan_pipeline": "optimizer", "plan_fsdp": "gradient_accumulation_steps",
               "autockpt.max_batch_size": "compiled"}
    values = {"target": "h100", "strict": True, "checkpoint": "recompute_function", "optimizer": "adamw",
              "gradient_accumulation_steps": 2, "compiled": True}
    for name, option in refused.items():
        with pytest.raises(ValueError, match=rf"{name} cannot honour {option} \(given: {option}="):
            entry_points[name](options=PlanOptions(**{option: values[option]}))


def test_optimize_takes_options_and_keeps_strict() -> None:
    model, x = _example()
    probe = autockpt.plan(model, budget_bytes=10**12, example_inputs=(x,), loss_fn=loss_of)
    options = PlanOptions(strict=True, checkpoint=autockpt.Action.RECOMPUTE_OWN)
    module = autockpt.optimize(model, budget_bytes=(probe.min_feasible_bytes + probe.baseline_peak_bytes) // 2, example_inputs=(x,), loss_fn=loss_of,
                               options=options)
    assert module.strict is True
    assert autockpt.get_plan(module).planned_action is autockpt.Action.RECOMPUTE_OWN


def test_plan_refuses_the_options_of_the_returned_module() -> None:
    model, x = _example()
    with pytest.raises(ValueError, match=r"autockpt.plan cannot honour strict"):
        autockpt.plan(model, budget_bytes=10**12, example_inputs=(x,), loss_fn=loss_of, options=PlanOptions(strict=True))


def test_the_pipeline_planner_refuses_options_it_does_not_plan() -> None:
    model, x = _example()
    for options in (PlanOptions(optimizer=torch.optim.AdamW), PlanOptions(host_pool_gb=1)):
        with pytest.raises(ValueError, match=r"plan_pipeline cannot honour (optimizer|host_pool_gb)"):
            autockpt.plan_pipeline(model, 2, budget_bytes=10**9, example_inputs=(x,), loss_fn=lambda o, t: o.sum(),
                                   options=options)


class _RecordedTrace:
    """A trace source that runs no step: it hands back a trace made before (the seam a fake trace plugs into)."""

    name = "recorded"

    def __init__(self, trace: StepTrace) -> None:
        self.recorded = trace
        self.calls = 0

    def trace(self, graph: Graph, step: StepInputs, request: TraceRequest) -> StepTrace:
        self.calls += 1
        return self.recorded


def test_a_planner_from_values_plans_what_the_measuring_planner_plans() -> None:
    model, x = _example()
    measured = autockpt.Planner.from_model(model, example_inputs=(x,), loss_fn=loss_of)
    probe = measured.plan(budget_bytes=10**12)
    budget = (probe.min_feasible_bytes + probe.baseline_peak_bytes) // 2
    expected = measured.plan(budget_bytes=budget)

    step = StepInputs.check(model, (x,), None, loss_of)
    from_values = autockpt.Planner(measured.graph, measured.trace, measured.costs, PlanOptions(), step=step)
    got = from_values.plan(budget_bytes=budget)
    assert [(r.first_unit, r.last_unit) for r in got.regions] == [(r.first_unit, r.last_unit) for r in expected.regions]
    assert got.predicted_peak_bytes == expected.predicted_peak_bytes

    source = _RecordedTrace(measured.trace)
    through_source = autockpt.Planner.from_model(model, example_inputs=(x,), loss_fn=loss_of, trace_source=source,
                                                  timing="auto")  # the times the source gave, as they are
    assert source.calls == 1 and through_source.trace is measured.trace
    assert through_source.plan(budget_bytes=budget).predicted_peak_bytes == expected.predicted_peak_bytes


def test_the_planner_from_values_names_what_it_needs() -> None:
    model, x = _example()
    with pytest.raises(TypeError, match="takes a captured Graph, a StepTrace and a CostModel"):
        autockpt.Planner("graph", "trace", "costs", step=StepInputs.check(model, (x,), None, loss_of))
    measured_source = MeasuredTrace()
    assert measured_source.name == "measured"


def test_the_names_removed_in_0_3_say_where_they_went() -> None:
    model, x = _example()
    with pytest.raises(TypeError, match=r"removed in 0.3.*Planner.from_model"):
        autockpt.Planner(model, example_inputs=(x,), loss_fn=loss_of)
    with pytest.raises(AttributeError, match=r"removed from the facade in 0.3: import it from autockpt.errors"):
        autockpt.CaptureError  # noqa: B018
    with pytest.raises(AttributeError, match=r"renamed Action"):
        autockpt.CheckpointKind  # noqa: B018
    for removed in ("checkpoint_kinds",):
        assert not hasattr(autockpt.Planner, removed)
    assert not hasattr(autockpt.Plan, "checkpoint_kind")
    with pytest.raises(ImportError):
        from autockpt.types import CheckpointKind  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        autockpt.not_a_name  # noqa: B018


def test_the_facade_is_small_and_every_name_resolves() -> None:
    assert len(autockpt.__all__) <= 25
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a facade name never warns
        for name in autockpt.__all__:
            assert getattr(autockpt, name) is not None
    for name, home in autockpt.REMOVED_NAMES.items():  # each removed name's new home has it
        assert getattr(importlib.import_module(home.split()[0]), name.replace("CheckpointKind", "Action")) is not None
