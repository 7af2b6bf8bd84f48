"""What the tests share: small models, budgets, and PyTorch itself as the reference answer for every optimized model;
and the settings every test runs under (one intra-op thread, the fixed times, machinery prices and checkpoint kind
of every plan, unless a test names its own). Imported by the test modules (``from support import ...``) and, for
the settings, by conftest.py in every process that runs tests (not in pytest-xdist's controller, which runs none:
importing torch and autockpt there delayed the workers' start)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import autockpt
from autockpt.core.devices import DeviceSpec
from autockpt.core.roofline import link_price
from autockpt.core.solve.base import Scorer, region_actions
from autockpt.measure import costs as costs_module
from autockpt.measure.capture import capture, plain_outputs
from autockpt.measure.loss import default_loss
from autockpt.measure.sources import TraceSource
from autockpt.measure.timing import RooflineTiming
from autockpt.measure.trace import trace_step
from autockpt.planning.build import trace_request
from autockpt.planning.options import PlanOptions
from autockpt.present import zoo
from autockpt.runtime.model_state import enter_training_modes, preserved_model_state
from autockpt.runtime.rewrite import rewrite
from autockpt.types import Action, ActionPrice, CostModel, LinkPrice, Policy, Region, RegionAction, StepTrace

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
needs_diffusers = pytest.mark.skipif(importlib.util.find_spec("diffusers") is None, reason="needs diffusers")


# the zoo models the end-to-end tests run, with readable ids and the extras they need
_ZOO_PARAMS = {
    "mlp": pytest.param("mlp", id="mlp"),
    "cnn": pytest.param("cnn", id="cnn-batchnorm-inplace"),
    "transformer": pytest.param("transformer", id="transformer-dropout"),
    "control_flow": pytest.param("control_flow", id="data-dependent-control-flow"),
    "gpt2": pytest.param("gpt2", marks=needs_transformers, id="hf-gpt2"),
    "vit": pytest.param("vit", marks=needs_transformers, id="hf-vit"),
    "unet": pytest.param("unet", marks=needs_diffusers, id="diffusers-unet2d"),
    "vae": pytest.param("vae", marks=needs_diffusers, id="diffusers-autoencoder-kl"),
}


def zoo_params(*names: str) -> list[Any]:
    """pytest parameters for these zoo models."""
    return [_ZOO_PARAMS[name] for name in names]


# torch intra-op threads in the tests. One: the test models are tiny (their ops take microseconds), so a second
# OpenMP thread adds synchronisation to every op and no speed; on a busy 2-core machine it made whole files about
# three times slower. Set at import too: module- and session-scoped fixtures run before conftest's per-test fixture.
THREADS = 1
torch.set_num_threads(THREADS)

# The times every plan a test makes is planned with, unless the test names a timing (issue 46: no test depends on a
# measured time or on machine load; a calibration a test needs is injected). autockpt's default, timing="auto", keeps
# the times the measured trace took: three timed steps per trace (27.8 s of ~350 s of test time, 415 traces), and
# plans that may differ from run to run with the machine's load. A roofline of a fixed CPU instead: the same units get
# the same times on every machine, and a measured trace runs no timed steps for it (``uses_measured_times``). Exact
# ties between repeated blocks make the solver's refinement solve more programs on some models (the per-op overhead,
# 30 us, solved fewer than 5 us did); the programs repeat from test to test, which ``pulp_tools.SOLVED_PROGRAMS``
# answers. What tests check of a plan (its peak, its budget, the gradients) does not depend on the times; tests of
# the timings themselves ("auto", "measured", "benchmark": tests/measure/test_timing.py, ...) name theirs.
TEST_CPU = DeviceSpec(
    name="test-cpu", description="a fixed CPU for the tests' plans", memory_bytes=16 * 2**30,
    peak_tflops=(("float32", 0.1), ("bfloat16", 0.05)), hbm_gb_per_s=10.0,
    host_to_device_gb_per_s=8.0, device_to_host_gb_per_s=8.0, op_overhead_us=30.0, link_latency_us=2.0,
    copies_overlap_compute=False, device_type="cpu",
    source=(("every figure", "fixed for the tests: tests/support.py"),),
)
TEST_TIMING = RooflineTiming(TEST_CPU)
# PlanOptions is a keyword-only dataclass: its generated __init__ reads its defaults from __kwdefaults__
assert PlanOptions.__init__.__kwdefaults__["timing"] == "auto", "autockpt's default timing changed: see this comment"
PlanOptions.__init__.__kwdefaults__["timing"] = TEST_TIMING

# The checkpoint kind every plan a test makes is planned for, unless the test names one or "auto": torch's (the kind
# "auto" keeps for module-level captures too). autockpt's default, "auto", plans both kinds (a trace with gradient
# lifetimes, two problems prepared and solved per budget), and ``optimize`` then times both plans' steps against each
# other to keep the faster: a choice that follows the machine's load, which no test may depend on (issue 46). Both
# kinds in one suite run: the shared helpers plan autockpt's own for the models of ``_OWN_CHECKPOINT_MODELS`` below;
# the tests of "auto", of the actions side by side and of the fake trace's gradient lifetimes name "auto". (Planning
# both kinds: 611 of the suite's 826 ``solve_each`` calls, 36 s of its ~290 s of test time, measured 2026-11-29.)
assert PlanOptions.__init__.__kwdefaults__["checkpoint"] == "auto", "autockpt's default checkpoint changed: see above"
PlanOptions.__init__.__kwdefaults__["checkpoint"] = Action.RECOMPUTE_TORCH

# The checkpoint machinery's prices and the host link on the CPU, fixed like the times above (issue 46): autockpt
# measures them once per process (``costs.calibrate``: a chain of checkpointed regions run and timed, copies to a
# host buffer), so a worker that measured them on a busy machine could plan otherwise than one on an idle machine
# (ties between plans that differ in regions, or in what is offloaded). Figures of the order measured on this project's
# CPUs (2026-11-29: torch's checkpoint 0.18 ms a region and 0.02 ms a saved tensor, autockpt's own 0.16 and 0.003 ms,
# an offloaded tensor 0.007 ms; copies 6 GB/s each way). The tests of the calibration itself call
# ``costs.measure_action_price`` and ``costs.measure_link``, which still measure.
TEST_PRICES = {
    Action.RECOMPUTE_TORCH: ActionPrice(action=Action.RECOMPUTE_TORCH, region_ms=0.2, saved_tensor_ms=0.02),
    Action.RECOMPUTE_OWN: ActionPrice(action=Action.RECOMPUTE_OWN, region_ms=0.15, saved_tensor_ms=0.003),
    Action.OFFLOAD: ActionPrice(action=Action.OFFLOAD, region_ms=0.0, saved_tensor_ms=0.007),
}
_measured_price_on, _measured_link_on = costs_module._price_on, costs_module._link_on


def _fixed_price_on(device: torch.device, action: Action) -> ActionPrice:
    return TEST_PRICES[action] if torch.device(device).type == "cpu" else _measured_price_on(device, action)


def _fixed_link_on(device: torch.device) -> LinkPrice:
    return link_price(TEST_CPU) if torch.device(device).type == "cpu" else _measured_link_on(device)


costs_module._price_on, costs_module._link_on = _fixed_price_on, _fixed_link_on


def mlp(depth: int = 6, classes: int = 8) -> torch.nn.Module:
    """A seeded MLP of width 128, 6 layers by default (the loop and device-memory tests' model)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(128, 128), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(128, classes))


# The blocks of the zoo's tiny models the tests build (``tiny``): fewer where more blocks only repeat what two show
# (issue 46: every capture, trace, program and step grows with them; the sizes themselves stay the benchmarks'). A
# test whose fact needs the size's blocks (block families, plan files recorded for a model) builds ``zoo.build``.
# The plain transformer keeps its 6 layers: with 3, budgets a third of the way to its peak fell under the block
# program's floor, and the flat programs solved there took longer than the layers saved (4.7 s against 0.6 s for
# test_actions' mixed regions). The data-dependent net keeps 8 of its 16 (with 4, half its activations fell under its
# floor: test_models' half budget).
TEST_BLOCKS = {"gpt2": 2, "bert": 2, "t5": 2, "llama": 2, "vit": 2, "cnn": 6, "control_flow": 8}


def tiny(name: str) -> zoo.ZooCase:
    """The zoo's tiny ``name`` with the tests' blocks (``TEST_BLOCKS``; the size's for the others)."""
    return zoo.build(name, "tiny", blocks=TEST_BLOCKS.get(name))


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def budget_at(plan: autockpt.Plan | autockpt.Planner, fraction: float) -> int:
    """A budget ``fraction`` of the way from static bytes to the unmodified peak, read from a plan or from a
    planner's trace (the same figures, without a plan at an unlimited budget, which searches the full floor)."""
    trace = plan.trace if isinstance(plan, autockpt.Planner) else plan
    return int(trace.static_bytes + fraction * (trace.baseline_peak_bytes - trace.static_bytes))


# The checkpoint kind the shared helpers plan with, per zoo model: one kind each, both kinds across the families (an
# MLP, a conv net with BatchNorm, Hugging Face decoders and an encoder-decoder, a diffusion UNet and the VAE on
# autockpt's own, whose trace records gradient lifetimes: the VAE's test is about a gradient hook handed None;
# dropout, the module-level capture and encoders on torch's). "auto", the default, plans both kinds and, in
# ``optimize``, measures both plans and times their steps against each other to keep the faster: twice the planning
# and measuring of one kind, and a choice that moves with the machine's load (issue 46). Its own tests plan "auto"
# (``tests/runtime/test_recompute.py``); the tests that call ``autockpt.optimize`` or ``plan`` with defaults plan
# torch's kind (the tests' default, above).
_OWN_CHECKPOINT_MODELS = frozenset({"mlp", "cnn", "gpt2", "t5", "unet", "vae"})


def checkpoint_for(case: zoo.ZooCase) -> Action:
    """The checkpoint kind ``planner_for`` plans ``case`` with (see ``_OWN_CHECKPOINT_MODELS``)."""
    return Action.RECOMPUTE_OWN if case.name in _OWN_CHECKPOINT_MODELS else Action.RECOMPUTE_TORCH


def planner_for(
    case: zoo.ZooCase, solver_options: autockpt.SolverOptions | None = None, *, checkpoint: Action | str | None = None
) -> autockpt.Planner:
    """The Planner ``autockpt.optimize`` and ``autockpt.plan`` make for the case (they are ``Planner.from_model(...).optimize``
    and ``.plan``): the model captured and traced once, for a probe and any number of budgets. The loss as captured
    (``loss_chunk_tokens=0``): weighing its chunked programs costs two more traces per language model, which the tests
    of that action (``tests/planning/test_loss_chunks.py``, the fake-trace plans of ``test_trace_choice.py``) pay.
    ``checkpoint``: the case's own kind (``checkpoint_for``) unless given, or given by ``solver_options``."""
    if checkpoint is None:
        by_solver = solver_options is not None and solver_options.checkpoint != "auto"
        checkpoint = "auto" if by_solver else checkpoint_for(case)
    return autockpt.Planner.from_model(
        case.model, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn,
        solver_options=solver_options, loss_chunk_tokens=0, checkpoint=checkpoint,
    )


def profile_of(case: zoo.ZooCase, *, gradient_lifetimes: bool = False) -> StepTrace:
    """The case's model captured and traced (no Planner, no solving)."""
    graph = capture(case.model, case.args, case.kwargs)
    return trace_step(graph, case.args, case.kwargs, case.loss_fn or default_loss, gradient_lifetimes=gradient_lifetimes)


# every action with its machinery priced at zero: for tests about memory, or with modelled times
FREE_MACHINERY = CostModel(
    device="cpu", prices=tuple(ActionPrice(action=a, region_ms=0.0, saved_tensor_ms=0.0) for a in Action)
)


def with_times_from_flops(trace: StepTrace) -> StepTrace:
    """``trace`` with each unit's forward time injected, not measured (issue 46: a test must not follow the machine's
    load): from its FLOPs and output bytes at CPU-like rates (10 GFLOP/s, 1 GB/s; identical blocks alike)."""
    return dataclasses.replace(trace, units=tuple(
        dataclasses.replace(unit, forward_ms=unit.flops / 1e7 + unit.output_bytes / 1e6) for unit in trace.units
    ))


def torch_scorer(trace: StepTrace, costs: CostModel = FREE_MACHINERY) -> Scorer:
    """The simulator for plans under torch's checkpoint (``Action.RECOMPUTE_TORCH``)."""
    return Scorer(trace, costs, Action.RECOMPUTE_TORCH)


def torch_actions(regions: Sequence[Region]) -> tuple[RegionAction, ...]:
    return region_actions(regions, Action.RECOMPUTE_TORCH)


def with_regions(plan: autockpt.Plan, regions: Sequence[Region], action: Action | None = None) -> autockpt.Plan:
    """``plan`` with other regions (under ``action``, default the plan's own): a hand-made plan to rewrite."""
    action = action or plan.planned_action
    policy = Policy.uniform(regions, action, plan.policy.placement)
    return dataclasses.replace(plan, policy=policy, planned_action=action)


def rewritten(plan: autockpt.Plan, model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> torch.nn.Module:
    """``model`` captured anew and rewritten to run ``plan``'s policy (no fingerprint check, nothing measured)."""
    kwargs = kwargs or {}
    return rewrite(capture(model, args, kwargs), plan.policy, args, kwargs, plan=plan)


def optimize_at(case: zoo.ZooCase, fraction: float) -> torch.nn.Module:
    """Optimize at ``budget_above_floor(planner, fraction)``: ``fraction`` of the way from static to peak, or
    half-way from the floor to the peak where that budget is higher.

    One Planner (``planner_for``) makes the plans and the optimized module: the model is captured and profiled once,
    not twice."""
    planner = planner_for(case)
    return planner.optimize(budget_bytes=budget_above_floor(planner, fraction))


def budget_above_floor(planner: autockpt.Planner, fraction: float) -> int:
    """``budget_at(planner, fraction)``, or half-way from the floor to the unmodified peak if that is higher. The
    floor is the one a plan at the first budget states: the quick floor where that budget is above it (at least the
    full floor, so the budget only has more room), the full one where it is not (issue 46: a probe at an unlimited
    budget searches the full floor of both recompute kinds)."""
    budget = budget_at(planner, fraction)
    try:
        floor = planner.plan(budget_bytes=budget).min_feasible_bytes
    except autockpt.InfeasibleBudgetError as refusal:
        floor = refusal.min_feasible_bytes
    return max(budget, (floor + planner.trace.baseline_peak_bytes) // 2)


def check_optimized(case: zoo.ZooCase, fraction: float = 0.5) -> autockpt.Plan:
    """Optimize (``optimize_at``), then: some region planned, the same step as the original model, the budget kept
    when measured, and the measured peak within 5 % of the prediction."""
    reference = twin(case)
    optimized = optimize_at(case, fraction)
    plan = autockpt.get_plan(optimized)
    assert plan.regions
    assert_same_step(optimized, reference, case)
    measured = autockpt.measure_step(optimized, case.args, case.kwargs, case.loss_fn).peak_bytes
    assert measured <= plan.budget_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * measured
    return plan


def run_step(module: torch.nn.Module, case: zoo.ZooCase, seed: int = 7) -> tuple[Any, dict[str, torch.Tensor]]:
    """One training step from zero grads with a fixed RNG seed; returns (outputs, grads by parameter name)."""
    for param in module.parameters():
        param.grad = None
    torch.manual_seed(seed)
    output = module(*case.args, **case.kwargs)
    (case.loss_fn or autockpt.measure.loss.default_loss)(output).backward()
    grads = {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}
    return output, grads


def assert_same_step(optimized: torch.nn.Module, reference: torch.nn.Module, case: zoo.ZooCase, *,
                     expected: tuple[Any, dict[str, torch.Tensor]] | None = None) -> None:
    """Outputs, gradients and buffers after one step match the original model (rtol 1e-4). ``expected``: the
    reference's ``run_step`` already run (its buffers are then read as they are now)."""
    expected_out, expected_grads = run_step(reference, case) if expected is None else expected
    actual_out, actual_grads = run_step(optimized, case)
    assert type(actual_out) is type(expected_out)
    if _loss_chunked(optimized) and isinstance(expected_out, Mapping):
        # the loss in chunks (Plan.loss_chunk_tokens) never makes the full logits: a training step's output holds
        # None there (a model output drops the field); every field it returns is compared
        dropped = [key for key in expected_out if key not in actual_out]
        assert "logits" in dropped and all(  # besides the logits, what the plain outputs drop too (a KV cache)
            not isinstance(expected_out[key], torch.Tensor) for key in dropped if key != "logits"), dropped
        expected_out = {key: value for key, value in expected_out.items() if key in actual_out}
        actual_out = dict(actual_out)
    expected_leaves = pytree.tree_leaves(plain_outputs(expected_out)[0])
    actual_leaves = pytree.tree_leaves(actual_out)
    assert len(actual_leaves) == len(expected_leaves)
    for want, got in zip(expected_leaves, actual_leaves):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert actual_grads.keys() == expected_grads.keys() and actual_grads
    for name, want in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], want, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")
    for (name, want), (_, got) in zip(reference.named_buffers(), optimized.named_buffers()):
        torch.testing.assert_close(got, want, msg=f"buffer {name}")


def tiny_causal_lm(config_class: str, vocab: int, hidden: int, **extra: Any) -> torch.nn.Module:
    """A one-layer Hugging Face causal LM of ``config_class`` (4 heads, 2 KV heads), random weights (seed 0), train mode."""
    import transformers

    config = getattr(transformers, config_class)(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, **extra,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _loss_chunked(module: torch.nn.Module) -> bool:
    module = getattr(module, "_orig_mod", module)
    return isinstance(module, autockpt.runtime.rewrite.OptimizedModule) and module.plan.loss_chunk_tokens > 0


def twin(case: zoo.ZooCase) -> torch.nn.Module:
    """An independent copy of the case's model (same weights) to serve as the reference."""
    return copy.deepcopy(case.model)


def trace_memory(trace: StepTrace) -> dict[str, Any]:
    """Everything of a trace but its times."""
    return {
        "events": trace.events,
        "storages": trace.storages,
        "units": [(u.index, u.flops, u.output_bytes, u.saved_bytes, u.saved_tensors) for u in trace.units],
        "baseline_peak_bytes": trace.baseline_peak_bytes,
        "static_bytes": trace.static_bytes,
        "parts": (trace.parameter_bytes, trace.buffer_bytes, trace.input_bytes, trace.gradient_bytes),
        "gradient_bytes_by_event": trace.gradient_bytes_by_event,
        "gradient_lifetimes": trace.gradient_lifetimes,
        "loop": (trace.optimizer_state_bytes, trace.loop),
        "foreign_bytes": trace.foreign_bytes,
    }


def assert_same_memory(fake: StepTrace, measured: StepTrace) -> None:
    fake_parts, measured_parts = trace_memory(fake), trace_memory(measured)
    for name, want in measured_parts.items():
        assert fake_parts[name] == want, f"{name} differs"


def retraced(planner: autockpt.Planner, source: TraceSource, options: PlanOptions | None = None) -> StepTrace:
    """The planner's own captured graph traced again by ``source``, asked for what a planner of ``options`` (the
    planner's own by default) asks, in the state ``build.built_step`` traces in (training modes entered, the model's
    state put back): the timeline to compare with the planner's trace, without a second capture."""
    step = planner.request
    request = trace_request(options or planner.options, planner.graph, None)
    with preserved_model_state(step.model, step.args, step.kwargs):
        enter_training_modes(step.model)
        return source.trace(planner.graph, step, request)
