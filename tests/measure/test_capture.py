"""Capture: which path (fx, export, module level) a model takes, and what each path must keep: the model's outputs,
parameters and buffers, dropout and BatchNorm behaviour, inputs passed twice, outputs export cannot return, the
eager library code paths."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from edge_models import Chain, ShapeBranchConvNet
from support import assert_same_step, check_optimized, needs_transformers, optimize_at, planner_for, tiny, twin
from torch import fx, nn

import autockpt
from autockpt.measure.capture import capture
from autockpt.measure.loss import default_loss
from autockpt.measure.trace import trace_step
from autockpt.planning.planner import baseline_plan
from autockpt.present import zoo
from autockpt.types import CaptureKind

# ------------------------------------------------------------------------------------------ the three paths


@pytest.mark.parametrize(
    ("build", "kind"),
    [
        (lambda: (Chain(depth=3), torch.randn(8, 128)), CaptureKind.FX),
        (lambda: (ShapeBranchConvNet(blocks=2), torch.randn(2, 3, 8, 8)), CaptureKind.EXPORT),  # a branch on a shape
        (lambda: (zoo.DataDependentNet(16, 3), torch.randn(8, 16)), CaptureKind.MODULE),  # a branch on values
    ],
    ids=["fx", "export", "module"],
)
def test_each_path_is_taken_where_the_earlier_ones_fail_and_runs_as_the_model(
    build, kind: CaptureKind, monkeypatch: pytest.MonkeyPatch
) -> None:
    exports: list[tuple] = []
    export = torch.export.export

    def counted_export(*args, **kwargs):
        exports.append(args)
        return export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted_export)
    torch.manual_seed(0)
    model, x = build()
    graph = capture(model, (x,), {})
    assert graph.kind is kind and graph.model is model and graph.units
    # one note per earlier path, saying why it was not used
    assert len(graph.notes) == {CaptureKind.FX: 0, CaptureKind.EXPORT: 1, CaptureKind.MODULE: 3}[kind], graph.notes
    assert all(note.split(":")[0].endswith("capture not used") for note in graph.notes)
    # values read by the model's own branch: export on the eager paths, then as is inside that attempt (whose failure
    # the export attempt then says, not running it a third time)
    assert len(exports) == {CaptureKind.FX: 0, CaptureKind.EXPORT: 1, CaptureKind.MODULE: 2}[kind]
    if kind is CaptureKind.MODULE:
        assert graph.notes[1].split(": ", 1)[1] == graph.notes[2].split(": ", 1)[1], graph.notes
    # the executable computes what the model computes, with the model's own parameters
    torch.testing.assert_close(graph.executable(x), model(x))
    assert {id(p) for p in graph.executable.parameters()} <= {id(p) for p in model.parameters()}
    assert graph.training_modes == tuple(m.training for m in model.modules())
    # units name the user's submodules ("" for the model itself), never the capture's own wrapper
    assert {u.module_path for u in graph.units} <= set(dict(model.named_modules()))
    if kind is CaptureKind.MODULE:
        assert graph.executable is model
        # a span per submodule call, nested: each layer's span holds the spans of its children
        spans = {span.path: span for span in graph.module_spans}
        for i in range(3):
            layer = spans[f"layers.{i}"]
            for child in ("0", "1", "2"):
                inner = spans[f"layers.{i}.{child}"]
                assert layer.first_unit <= inner.first_unit <= inner.last_unit <= layer.last_unit
    else:
        assert isinstance(graph.executable, fx.GraphModule) and graph.module_spans == ()
        computing = [n for n in graph.executable.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
        assert [u.name for u in graph.units] == [n.name for n in computing]  # one unit per op, in order
    if kind is CaptureKind.EXPORT:  # no Python stack trace per node (a fifth of an export's time), the flag restored
        assert all(not node.stack_trace for node in graph.executable.graph.nodes)
        assert fx.config.do_not_emit_stack_traces is False
    if kind is CaptureKind.FX:  # fx keeps leaf modules whole: a Linear is one unit
        assert [u.module_path for u in graph.units if u.op.startswith("module:")] == ["layers.0", "layers.1", "layers.2", "head"]


# ------------------------------------------------------------------------------------------ buffers and modes


@pytest.mark.parametrize("fraction", [0.5])
def test_module_level_capture_keeps_buffers_and_dropout(fraction: float) -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Dropout(0.2), nn.Tanh()) for _ in range(10)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + block(x) if x.sum() > 0 else x - block(x)
            return x

    torch.manual_seed(0)
    plan = check_optimized(zoo.ZooCase(name="branchy", model=Branchy(), args=(torch.randn(128, 64),)), fraction)
    assert plan.capture == "module"


class _CountsItsSteps(nn.Module):
    """Buffers a forward updates: a step counter and a running mean of its output, in place or assigned anew."""

    def __init__(self, *, update: str) -> None:
        super().__init__()
        self.update = update
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(8))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.ones(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.update == "in-place":
            self.count += 1
        else:
            self.count = self.count + 1  # a new tensor each step
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.update == "assigned-from-output":
            self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)  # fx tracing left a Proxy in the buffer
        else:
            self.ema.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return x


@pytest.mark.parametrize("update", ["in-place", "assigned", "assigned-from-output"])
def test_a_graph_that_leaves_a_buffer_otherwise_than_the_model_is_not_used(update: str) -> None:
    """Capture alone: fx drops ``self.count += 1`` from the graph (it ran once, while tracing), and tracing an
    assignment from traced tensors leaves an fx Proxy in the buffer. The fx graph is refused, naming the buffer, and
    every later attempt starts from real tensors."""
    torch.manual_seed(0)
    model = _CountsItsSteps(update=update)
    graph = capture(model, (torch.randn(16, 64),), {})
    assert graph.kind is not CaptureKind.FX
    assert graph.notes[0].startswith("fx capture not used") and "buffer 'count'" in graph.notes[0]
    assert all(type(buffer) is torch.Tensor for buffer in model.buffers())  # no fx Proxy left behind
    assert model.ema.shape == (64,) and model.count.dtype == torch.long


@pytest.mark.parametrize("update", ["in-place", "assigned", "assigned-from-output"])
def test_buffers_updated_outside_the_traced_tensors_advance_as_in_the_model(update: str) -> None:
    """fx ran ``self.count += 1`` once while tracing and left it out of the graph (the counter never advanced); a
    buffer assigned anew left the original model's counter changed after planning; and an assignment from traced
    tensors left an fx Proxy in the buffer, so every later capture path failed."""
    torch.manual_seed(0)
    case = zoo.ZooCase(name="counter", model=_CountsItsSteps(update=update), args=(torch.randn(512, 64),))
    reference = twin(case)
    optimized = optimize_at(case, 0.5)
    assert int(case.model.count) == 0 and torch.equal(case.model.ema, torch.ones(64))  # planning left no trace
    assert autockpt.get_plan(optimized).capture != "fx"
    assert_same_step(optimized, reference, case)
    assert int(optimized.state_dict()["count"]) == int(reference.count) == 1


# ------------------------------------------------------------------------------------------ inputs and outputs


@needs_transformers
def test_inputs_passed_twice_are_not_merged_by_the_capture() -> None:
    """``model(ids, labels=ids)``: torch.export made the two one graph input, so the graph read the labels as token
    ids and a later batch with other labels (shifted, -100 on padding) computed something else, silently."""
    case = zoo.build("gpt2", "tiny", blocks=1)  # one layer: the inputs are the graph's, whatever its depth
    assert case.kwargs["labels"] is case.args[0]  # the example inputs share the tensor
    reference = twin(case)
    planner = planner_for(case)
    # the captured graph rewritten with a region, no program solved: the graph's inputs are what is checked (that
    # GPT-2 keeps its budget is tests/planning/test_models.py's)
    the_plan = baseline_plan(planner, "every_1")
    assert the_plan.regions and the_plan.capture == "export"
    optimized = planner.apply(the_plan)
    ids = case.args[0]
    labels = torch.roll(ids, 1, dims=1)
    labels[:, -8:] = -100
    other_batch = zoo.ZooCase(name="gpt2-other-labels", model=case.model, args=(ids,), kwargs={"labels": labels})
    assert_same_step(optimized, reference, other_batch)


@dataclasses.dataclass
class _Prediction:
    logits: torch.Tensor
    tag: str = "prediction"


class _ReturnsADataclass(nn.Module):
    """fx cannot trace it (a branch on the input's shape) and its output is a dataclass torch.export cannot return."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)) for _ in range(8))

    def forward(self, x: torch.Tensor) -> _Prediction:
        for block in self.blocks:
            x = torch.tanh(block(x)) if x.shape[0] > 1 else block(x)
        return _Prediction(logits=x)


def test_an_output_export_cannot_return_is_not_dropped() -> None:
    """The export capture replaced the whole dataclass by None and profiling then failed inside the loss function."""
    torch.manual_seed(0)
    case = zoo.ZooCase(
        name="dataclass-output", model=_ReturnsADataclass(), args=(torch.randn(512, 64),),
        loss_fn=lambda out: out.logits.square().mean(),
    )
    plan = check_optimized(case, 0.5)
    assert plan.capture == "module"
    assert any("_Prediction" in note for note in plan.notes)


# ------------------------------------------------------------------------------------------ library code paths


@needs_transformers
def test_exported_hugging_face_graphs_take_the_eager_attention_path() -> None:
    """Exported as is, transformers builds an all-True attention mask that every attention converts and saves (the
    eager model skips it): the captured step costs more than the model it replaces. Captured on the eager library
    paths, the graph's peak is the eager model's. A decoder given no mask (the zoo's Llama); the ViT, with its
    self-check, and the decoders given a mask are ``test_eager_course.py``'s (issue 46)."""
    case = tiny("llama")
    graph = capture(case.model, case.args, case.kwargs)
    assert graph.kind is CaptureKind.EXPORT
    eager = autockpt.measure_step(case.model, case.args, case.kwargs, case.loss_fn).peak_bytes
    captured = trace_step(graph, case.args, case.kwargs, case.loss_fn or default_loss).baseline_peak_bytes
    assert captured <= eager
    assert not any(op.startswith("aten.ge") for op in (u.op for u in graph.units))  # no mask built from positions


class _CheckedUnlessExporting(torch.nn.Module):
    """Checks its input's values on the eager path only, as libraries do (an export cannot trace the check)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_exporting() and not bool(torch.isfinite(x).all()):
            raise ValueError("non-finite input")
        return torch.tanh(self.fc(x))


def test_a_value_read_on_the_eager_path_only_is_exported_and_checked_at_run_time() -> None:
    """The check the model skips when it sees an export runs on the eager course: exported with the example's value,
    asserted at run time (issue 45; before, such a model was exported on its traced course)."""
    from autockpt.measure.capture import value_guards

    torch.manual_seed(0)
    model, x = _CheckedUnlessExporting(), torch.randn(4, 8)
    graph = capture(model, (x,), {})
    assert graph.kind is CaptureKind.EXPORT
    assert value_guards(graph.executable)
    assert any("reads 1 tensor value" in note for note in graph.notes)
    with pytest.raises(RuntimeError, match="Runtime assertion failed"):
        graph.executable(torch.full((4, 8), float("nan")))
    # the public functions are put back
    assert (torch.compiler.is_exporting.__name__, torch.compiler.is_compiling.__name__) == ("is_exporting", "is_compiling")
