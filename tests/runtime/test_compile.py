"""torch.compile sees the plan (issue 24, item 1): ``torch.compile(optimized)`` compiles the step as few graphs as
``torch.compile(original)``, with every planned region inside the graph as one checkpoint higher-order op, the same
outputs, gradients and buffers as the original, and (Inductor) a lower compiled peak than the compiled original.

Peaks of compiled code are measured from the CPU allocator's events (``experiments/anchors.profiler_peak_bytes``, the
sweep's method): MemTracker does not see inside compiled code.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from support import assert_same_step, budget_at, needs_transformers, run_step, twin, zoo_params
from torch._dynamo.utils import counters

import autockpt
from autockpt.measure.step import measure_compiled_step
from autockpt.present import zoo
from autockpt.types import Action
from experiments.common.anchors import profiler_peak_bytes


def neox_case(*, layers: int = 1) -> zoo.ZooCase:
    """A GPT-NeoX-style decoder, small enough to compile in seconds on CPU."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=128, hidden_size=32, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        max_position_embeddings=64,
    )
    ids = torch.randint(0, 128, (2, 64))
    return zoo.ZooCase(name="neox", model=GPTNeoXForCausalLM(config), args=(ids,), kwargs={"labels": ids})


def optimized_at(case: zoo.ZooCase, fraction: float, action: Action) -> autockpt.runtime.rewrite.OptimizedModule:
    # the loss as captured: the chunked loss's loop over chunks is more graphs under Dynamo (3 for 1 on the decoder)
    planner = autockpt.Planner.from_model(
        case.model, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn, checkpoint=action,
        loss_chunk_tokens=0,
    )
    # the solver's plan applied: optimize's eager check of it (a measured step) is not what these tests compare
    module = planner.apply(planner.plan(budget_bytes=budget_at(planner, fraction)))
    assert module.plan.regions, "the test needs a plan that checkpoints something"
    return module


class GraphCount:
    """A Dynamo backend that counts the graphs it is handed, and the checkpoint ops in them, then runs ``backend``."""

    def __init__(self, backend: str) -> None:
        self.backend = torch._dynamo.lookup_backend(backend)
        self.graphs = 0
        self.checkpoints = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1
        self.checkpoints += sum(
            1 for node in gm.graph.nodes
            if node.op == "call_function" and getattr(node.target, "__name__", "") == "tag_activation_checkpoint"
        )
        return self.backend(gm, example_inputs)


def compiled_step(module: torch.nn.Module, case: zoo.ZooCase, backend: str) -> tuple[torch.nn.Module, GraphCount]:
    """``torch.compile(module)`` after one step (which compiles forward and backward), and what was compiled."""
    torch._dynamo.reset()
    counters.clear()
    count = GraphCount(backend)
    compiled = torch.compile(module, backend=count)
    for param in module.parameters():
        param.grad = None
    (case.loss_fn or autockpt.measure.loss.default_loss)(compiled(*case.args, **case.kwargs)).backward()
    return compiled, count


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    yield
    torch._dynamo.reset()  # compiled graphs hold the test's models


def compare_compiled(case: zoo.ZooCase, action: Action, backend: str, fraction: float = 0.5) -> None:
    """The step of the plan at ``fraction`` compiled against the original's compiled step: no more graphs and graph
    breaks (as their first steps compiled them), one checkpoint op per planned region, the same outputs, gradients
    and buffers."""
    reference = twin(case)
    module = optimized_at(case, fraction, action)
    compiled_reference, original = compiled_step(reference, case, backend)
    original_graphs, original_breaks = original.graphs, graph_breaks()
    # the original's step to compare with, run before the planned module's compile resets Dynamo (after it, the
    # compiled original would be compiled again: 1.4 s of the test, issue 46)
    expected = run_step(compiled_reference, case)
    compiled, planned = compiled_step(module, case, backend)
    planned_graphs, planned_breaks = planned.graphs, graph_breaks()
    assert planned_graphs <= original_graphs, f"optimized: {planned_graphs} graphs, original: {original_graphs}"
    assert planned_breaks <= original_breaks
    # the plan is in the graph: one checkpoint op per planned region
    assert planned.checkpoints == len(module.plan.regions)
    assert_same_step(compiled, compiled_reference, case, expected=expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "action", "blocks", "fraction"),
    [
        # both actions compile to the same form (rewrite.py: torch's checkpoint around each region's body), so one
        # model each (issue 46's suite time); BatchNorm statistics are updated in place inside its regions. Two
        # blocks' floor is over half-way: their budget at 0.6
        pytest.param(*zoo_params("cnn")[0].values, Action.RECOMPUTE_OWN, 2, 0.6, id="cnn-batchnorm-recompute_function"),
        # one layer's floor is about 70 % of the way from static bytes to its peak: its budget at 0.8
        pytest.param(*zoo_params("transformer")[0].values, Action.RECOMPUTE_TORCH, 1, 0.8, id="transformer-dropout"),
        # the export capture of a Hugging Face decoder: test_optimize_compiled_keeps_the_budget_as_the_compiled_step_runs
        # counts the graphs of the plan it keeps (one, as the original's), issue 46
    ],
)
def test_compile_keeps_the_plan_in_one_graph(name: str, action: Action, blocks: int, fraction: float) -> None:
    """fx captures (an export capture: test_optimize_compiled_keeps_the_budget_as_the_compiled_step_runs). aot_eager:
    Dynamo and AOTAutograd's partitioner, without Inductor's code generation (seconds, not a minute; Inductor:
    test_inductor_step_is_the_original_step_with_a_lower_peak). The zoo's models with fewer blocks
    (2 residual blocks, not 12; 1 layer, not 6): Dynamo and AOTAutograd trace every op of both models, and more blocks
    repeat the same ops (issue 46)."""
    compare_compiled(zoo.build(name, "tiny", blocks=blocks), action, "aot_eager", fraction=fraction)


@pytest.mark.slow
def test_inductor_step_is_the_original_step_with_a_lower_peak() -> None:
    """Inductor (torch.compile's default): one graph with one checkpoint op per region, no graph break, outputs,
    gradients and buffers equal to the compiled original's, and a compiled peak below the compiled original's,
    measured from allocator events. Most of the test's time is Inductor compiling the two models' C++ kernels (g++,
    one per kernel), so the smallest model with a region: the zoo's MLP with two blocks (5.8 s here, where a one-layer
    GPT-NeoX took 16.8 s; issue 46). What Dynamo and AOTAutograd make of an export capture of a Hugging Face decoder
    is ``test_optimize_compiled_keeps_the_budget_as_the_compiled_step_runs`` (aot_eager); Inductor's code generation
    sees only the partitioned graphs. Scalar C++ kernels (``cpp.vec_isa_ok=False``): with a cold cache, finding the
    CPU's vector ISA compiles and loads a probe library per ISA (9 of the test's 33 s on 2 cores, issue 46); the
    vector width changes neither the checkpoint ops nor the peak. No dropout: recomputed dropout under torch.compile
    is the aot_eager test's transformer above (Inductor's ``fallback_random`` would run the same aten random ops)."""
    import torch._inductor.config as inductor_config

    case = zoo.build("mlp", "tiny", blocks=2)
    reference = twin(case)
    module = optimized_at(case, 0.8, Action.RECOMPUTE_TORCH)  # two blocks: the floor is at about 70 % of the way
    loss_fn = case.loss_fn or autockpt.measure.loss.default_loss
    with inductor_config.patch({"cpp.vec_isa_ok": False}):
        compiled_reference, original = compiled_step(reference, case, "inductor")
        reference_peak = profiler_peak_bytes(compiled_reference, case.args, case.kwargs, loss_fn)
        compiled, planned = compiled_step(module, case, "inductor")
        assert planned.graphs == 1 == original.graphs and graph_breaks() == 0
        assert planned.checkpoints == len(module.plan.regions)
        peak = profiler_peak_bytes(compiled, case.args, case.kwargs, loss_fn)
        assert_same_step(compiled, compiled_reference, case)
    assert peak < reference_peak, f"compiled plan {peak} bytes, compiled original {reference_peak} bytes"


@needs_transformers
@pytest.mark.slow
def test_optimize_compiled_keeps_the_budget_as_the_compiled_step_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``optimize(..., compiled=..., optimizer=AdamW)``: the compiled loop step (forward, backward,
    ``optimizer.step()``; first step and a later one), measured by the allocator's events (MemTracker cannot see
    inside compiled code), is under the budget; the model's gradients and weights are as they were; the step is the
    original's. Backend aot_eager: AOTAutograd's partitioner re-decides what is saved, which is what makes the
    compiled step's peak differ from the eager plan's; Inductor's code generation took 233 s of a 2-core suite here
    (it is compiled once in ``test_inductor_step_is_the_original_step_with_a_lower_peak`` and on CUDA below). The
    plan kept, an export capture of a Hugging Face decoder, compiles to one graph with one checkpoint op per region
    and no graph break, as the original does. The search for a looser plan once one fits is off (a compile per
    try): which of the plans that fit is kept is ``tests/planning/test_compiled_choice.py``'s, on scripted readings."""
    monkeypatch.setattr("autockpt.planning.compiled.LOOSEN_ATTEMPTS", 0)
    backend = "aot_eager"
    case = neox_case()  # each plan tried is compiled: one layer compiles in half the time of two
    reference = twin(case)
    loss_fn = case.loss_fn or autockpt.measure.loss.default_loss
    weights = [param.detach().clone() for param in case.model.parameters()]
    # the first plan's compiled step measures over this budget (torch 2.13, CPU): planned again tighter
    budget = budget_at(autockpt.Planner.from_model(case.model, example_inputs=case.args, example_kwargs=case.kwargs,
                                                   optimizer=torch.optim.AdamW), 0.6)
    compiled = autockpt.optimize(case.model, budget_bytes=budget, example_inputs=case.args, example_kwargs=case.kwargs,
                                 optimizer=torch.optim.AdamW, compiled={"backend": backend},
                                 loss_chunk_tokens=0)  # as optimized_at: the loss's chunks are more graphs
    assert all(param.grad is None for param in case.model.parameters()), "planning left gradients on the model"
    assert all(torch.equal(param, weight) for param, weight in zip(case.model.parameters(), weights))
    the_plan = autockpt.get_plan(compiled)
    (note,) = [note for note in the_plan.notes if "compiled with torch.compile" in note]
    # the test means to tighten at least once: the plan for the budget itself compiled over it
    readings = [(int(target), int(peak)) for target, peak in re.findall(r"planned for (\d+), compiled (\d+)", note)]
    assert len(readings) >= 2 and readings[0][0] == budget < readings[0][1], note
    measured = measure_compiled_step(compiled, case.args, case.kwargs, loss_fn, static_from=compiled._orig_mod,
                                     optimizer=torch.optim.AdamW)
    assert measured.peak_bytes <= budget, f"compiled loop step {measured.peak_bytes} bytes, budget {budget}"
    # the reference behind Dynamo alone (backend "eager"), so that both name their parameters "_orig_mod.*"
    original = GraphCount("eager")  # Dynamo's graphs: the backend does not change them
    assert_same_step(compiled, torch.compile(reference, backend=original), case)
    assert original.graphs == 1
    kept = compiled._orig_mod
    assert kept.plan.regions, "the test needs a plan that checkpoints something"
    # Dynamo's graphs again, of the plan kept (compiled by aot_eager inside optimize): counted behind backend "eager"
    _, planned = compiled_step(kept, case, "eager")
    assert planned.graphs == 1 and graph_breaks() == 0 and planned.checkpoints == len(kept.plan.regions)


@pytest.mark.parametrize(
    ("options", "error"),
    [({"compiled": "max-autotune"}, TypeError),
     ({"compiled": True, "host_pool_gb": 1}, ValueError)],
)
def test_optimize_compiled_refuses_what_it_cannot_measure(options: dict[str, Any], error: type[Exception]) -> None:
    model = torch.nn.Linear(4, 4)
    with pytest.raises(error, match="compiled="):
        autockpt.optimize(model, budget_bytes=10**6, example_inputs=(torch.randn(2, 4),), **options)


def test_every_optimized_module_compiles_past_dynamos_recompile_limit() -> None:
    """Dynamo keeps at most ``recompile_limit`` graphs per code object, and one optimized module's graph never passes
    another's guards: with one ``forward`` code object shared by every optimized module, the ninth compiled in a
    process ran eager (a warning only), so ``optimize(..., compiled=True)``, which compiles up to six, measured eager
    steps as compiled ones after a sweep or two. Each module compiles its own graph, however many came before. The
    limit lowered to 1 for the test: two modules past it prove the same as two past 8, in 3 compiles, not 10."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[layer for _ in range(2) for layer in (torch.nn.Linear(32, 32), torch.nn.GELU())])
    x = torch.randn(64, 32)
    planner = autockpt.Planner.from_model(model, example_inputs=(x,), loss_fn=lambda y: y.square().mean())
    plan = planner.plan(budget_bytes=budget_at(planner, 0.8))  # two blocks: the floor is past half way
    assert plan.regions, "the test needs a plan that checkpoints something"
    count = GraphCount("eager")
    modules = []  # kept alive, as a sweep's would be
    with torch._dynamo.config.patch(recompile_limit=1):
        for index in range(torch._dynamo.config.recompile_limit + 2):
            modules.append(torch.compile(planner.apply(plan), backend=count))
            modules[-1](x).square().mean().backward()
            assert count.graphs == index + 1, f"optimized module {index + 1} was not compiled ({count.graphs} graphs)"
    assert count.checkpoints == len(modules) * len(plan.regions)


def test_an_optimized_module_survives_deepcopy_and_pickle() -> None:
    """Each optimized module carries a ``forward`` function of its own (not picklable by name): copies make theirs."""
    import copy
    import pickle

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    optimized = autockpt.optimize(model, budget_bytes=10**9, example_inputs=(x,))
    for copied in (copy.deepcopy(optimized), pickle.loads(pickle.dumps(optimized))):
        assert torch.equal(copied(x), optimized(x))
        assert copied.__dict__["_autockpt_forward"] is not optimized.__dict__["_autockpt_forward"]
    # after Module.compile() too (nn.Module's own state leaves the compiled call out), each copy runs its own weights
    optimized.compile(backend="eager")
    for copied in (copy.deepcopy(optimized), pickle.loads(pickle.dumps(optimized))):
        with torch.no_grad():
            for param in copied.parameters():
                param.zero_()
        assert not torch.equal(copied(x), optimized(x))


def test_an_optimized_module_inside_a_compiled_model_is_one_graph() -> None:
    """The optimized module as a submodule of what the user compiles, ``fullgraph=True``: Dynamo traces through its
    ``forward`` (no graph break at picking the module's own function)."""
    torch.manual_seed(0)
    inner = torch.nn.Sequential(*[layer for _ in range(3) for layer in (torch.nn.Linear(16, 16), torch.nn.GELU())])
    x = torch.randn(256, 16)
    planner = autockpt.Planner.from_model(inner, example_inputs=(x,), loss_fn=lambda y: y.square().mean())
    optimized = planner.apply(planner.plan(budget_bytes=budget_at(planner, 0.7)))
    assert optimized.plan.regions, "the test needs a plan that checkpoints something"
    outer = torch.nn.Sequential(torch.nn.Linear(16, 16), optimized)
    torch._dynamo.reset()
    count = GraphCount("eager")
    torch.compile(outer, backend=count, fullgraph=True)(x).square().mean().backward()
    assert count.graphs == 1 and count.checkpoints == len(optimized.plan.regions)


@needs_transformers
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_optimize_compiled_keeps_the_budget_on_cuda() -> None:
    """On CUDA the compiled step's peak is ``max_memory_allocated``, everything the process holds counted: the budget
    holds on the first compiled step after ``optimize`` returns and on a later one."""
    device = torch.device("cuda")
    torch._dynamo.reset()
    # the zoo's GPT-2 at size small: on CUDA a model as small as neox_case peaks at its kernels' workspaces (the H100
    # measured floor 68.99 MB, peak 69.70 MB), leaving no room to plan in
    case = zoo.build("gpt2", "small", seed=0)
    model = case.model.to(device)
    args = tuple(arg.to(device) for arg in case.args)
    kwargs = {key: value.to(device) for key, value in case.kwargs.items()}
    probe = autockpt.plan(model, budget_bytes=10**15, example_inputs=args, example_kwargs=kwargs)
    budget = (probe.min_feasible_bytes + probe.baseline_peak_bytes) // 2  # half way from the eager floor
    compiled = autockpt.optimize(model, budget_bytes=budget, example_inputs=args, example_kwargs=kwargs,
                                 compiled=True)
    peaks = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        autockpt.measure.loss.default_loss(compiled(*args, **kwargs)).backward()
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device))
    assert max(peaks) <= budget, f"compiled steps measured {peaks}, budget {budget}"
