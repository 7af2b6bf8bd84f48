"""Models that break naive checkpointing: frozen parameters, in-place writes after a region, tied weights,
a loss that saves activations, an eval-mode model, tuple and dict outputs, keyword-only inputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import autockpt
from autockpt import zoo
from autockpt.capture import capture
from autockpt.profile import profile
from autockpt.rewrite import rewrite
from autockpt.simulate import simulate
from autockpt.solve.candidates import candidate_regions
from autockpt.types import Region
from conftest import assert_same_step, budget_at, needs_transformers, probe, run_step, twin


def _optimize_at(case: zoo.ZooCase, fraction: float) -> nn.Module:
    """Optimize at ``fraction`` of the way from static to peak, or half-way above the floor if that is lower."""
    base = probe(case)
    budget = max(budget_at(base, fraction), (base.min_feasible_bytes + base.baseline_peak_bytes) // 2)
    return autockpt.optimize(
        case.model, budget_bytes=budget, example_inputs=case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn
    )


def _check(case: zoo.ZooCase, fraction: float = 0.5) -> autockpt.Plan:
    reference = twin(case)
    optimized = _optimize_at(case, fraction)
    plan = autockpt.get_plan(optimized)
    assert plan.regions
    assert_same_step(optimized, reference, case)
    measured = autockpt.measure_step(optimized, case.args, case.kwargs, case.loss_fn).peak_bytes
    assert measured <= plan.budget_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * measured
    return plan


class _Chain(nn.Module):
    def __init__(self, width: int = 128, depth: int = 12) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def test_partly_frozen_model() -> None:
    torch.manual_seed(0)
    model = _Chain()
    for layer in model.layers[:4]:
        layer.requires_grad_(False)
    _check(zoo.ZooCase(name="frozen", model=model, args=(torch.randn(256, 128),)))


class _WritesIntoAnEarlierTensor(nn.Module):
    """Each block reads h and later writes into h in place; fine for autograd, fatal if h were a checkpoint input."""

    def __init__(self, width: int = 128, depth: int = 8) -> None:
        super().__init__()
        self.inner = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.outer = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for inner, outer in zip(self.inner, self.outer):
            h = inner(x)
            y = outer(torch.sigmoid(h) * 2)
            h.mul_(0.5)  # in place, after h was read above; Linear saved its input x, not h
            x = torch.tanh(y + h)
        return x


def test_in_place_write_after_a_region_into_its_input() -> None:
    torch.manual_seed(0)
    _check(zoo.ZooCase(name="inplace", model=_WritesIntoAnEarlierTensor(), args=(torch.randn(256, 128),)), 0.4)


class _TiedLM(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(depth)])
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.body(self.embed(ids))
        logits = self.head(hidden)
        return {"logits": logits, "loss": logits.logsumexp(-1).mean()}


def test_tied_weights_and_dict_output_with_loss_key() -> None:
    torch.manual_seed(0)
    model = _TiedLM()
    case = zoo.ZooCase(name="tied", model=model, args=(torch.randint(0, 64, (8, 64)),))
    plan = _check(case)
    assert plan.static_bytes > 0


class _TupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.chain = _Chain(depth=10)

    def forward(self, *, features: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.chain(features) * scale
        return out, out.detach().abs()


def test_keyword_only_inputs_and_tuple_output() -> None:
    torch.manual_seed(0)
    case = zoo.ZooCase(
        name="kw", model=_TupleOut(), args=(), kwargs={"features": torch.randn(256, 128), "scale": 2.0},
        loss_fn=lambda out: out[0].square().mean(),
    )
    _check(case)


def test_loss_function_that_saves_activations_is_accounted() -> None:
    """exp() in the loss saves the model's output; a region that ends the graph must not drop that hold."""
    torch.manual_seed(0)
    model, x = _Chain(depth=6), torch.randn(512, 128)
    model.head = nn.Linear(128, 2048)  # a wide output, so the loss's saved copy of it dominates the peak
    loss_fn = lambda out: out.exp().mean()  # noqa: E731
    plan = autockpt.plan(model, budget_bytes=10**15, example_inputs=(x,), loss_fn=loss_fn)
    measured_profile = profile(capture(model, (x,), {}), (x,), {}, loss_fn)
    last = len(plan.nodes) - 1
    for first in (last - 2, last - 4):
        region = Region(first_unit=first, last_unit=last)
        predicted = simulate(measured_profile, (region,)).peak_bytes
        module = rewrite(capture(model, (x,), {}), dataclasses.replace(plan, regions=(region,)), (x,), {})
        measured = autockpt.measure_step(module, (x,), None, loss_fn).peak_bytes
        assert abs(predicted - measured) <= 0.01 * measured, (region, predicted, measured)


def test_optimizing_an_eval_mode_model_keeps_its_mode() -> None:
    case = zoo.build("cnn")
    case.model.eval()
    optimized = _optimize_at(case, 0.5)
    assert not optimized.training and not case.model.training
    optimized.train()
    assert optimized.training and case.model.training and case.model.blocks[0].bn1.training


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
    plan = _check(zoo.ZooCase(name="branchy", model=Branchy(), args=(torch.randn(128, 64),)), fraction)
    assert plan.capture == "module"


def test_candidates_exclude_regions_whose_input_is_written_later() -> None:
    torch.manual_seed(0)
    model, x = _WritesIntoAnEarlierTensor(depth=2), torch.randn(64, 128)
    measured = profile(capture(model, (x,), {}), (x,), {}, lambda out: out.sum())
    _, candidates = candidate_regions(capture(model, (x,), {}), measured)
    written = [s for s in measured.storages if any(m > s.producer_unit for m in s.mutator_units)]
    assert written
    for storage in written:
        for region in candidates:
            reads = any(region.first_unit <= u <= region.last_unit for u in storage.user_units)
            if storage.producer_unit < region.first_unit and reads:
                assert not any(m > region.last_unit for m in storage.mutator_units), region

    # the hazard is real: checkpointing the first reader of such a tensor breaks backward
    storage = written[0]
    reader = min(u for u in storage.user_units if u > storage.producer_unit and u not in storage.mutator_units)
    plan = autockpt.plan(model, budget_bytes=10**15, example_inputs=(x,))
    module = rewrite(capture(model, (x,), {}), dataclasses.replace(plan, regions=(Region(first_unit=reader, last_unit=reader),)), (x,), {})
    with pytest.raises(RuntimeError, match="inplace"):
        module(x).sum().backward()


class _ShapeBranchConvNet(nn.Module):
    """BatchNorm conv net with a branch on the input shape: fx cannot trace it, export can (shapes are static)."""

    def __init__(self, channels: int = 16, blocks: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()) for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x) if x.shape[0] > 1 else block(x)
        return x.mean()


def test_batchnorm_statistics_update_once_through_the_export_path() -> None:
    torch.manual_seed(0)
    case = zoo.ZooCase(name="bn-export", model=_ShapeBranchConvNet(), args=(torch.randn(8, 3, 16, 16),), loss_fn=lambda out: out)
    plan = _check(case, 0.4)
    assert plan.capture == "export"
    assert int(case.model.blocks[0][1].num_batches_tracked) == 2  # the checked step and the measured step, once each


def _frozen_batchnorm_case() -> zoo.ZooCase:
    """A model in train mode whose first BatchNorm layers are frozen (eval): fine-tuning with frozen statistics."""
    torch.manual_seed(0)
    model = _ShapeBranchConvNet(blocks=6)
    for block in model.blocks:
        block[1].running_mean.uniform_(-0.5, 0.5)
        block[1].running_var.uniform_(0.5, 2.0)
    model.train()
    for block in model.blocks[:3]:
        block[1].eval()
    return zoo.ZooCase(name="frozen-bn", model=model, args=(torch.randn(8, 3, 16, 16),), loss_fn=lambda out: out)


def test_frozen_batchnorm_in_a_training_model_stays_frozen() -> None:
    """The export graph bakes each BatchNorm's mode in: planning must capture the user's flags, not model.train()'s
    (it did: the frozen layers normalised with batch statistics and updated their running statistics)."""
    case = _frozen_batchnorm_case()
    plan = _check(case, 0.5)
    assert plan.capture == "export"
    assert [block[1].training for block in case.model.blocks] == [False] * 3 + [True] * 3
    assert int(case.model.blocks[0][1].num_batches_tracked) == 0
    assert int(case.model.blocks[3][1].num_batches_tracked) == 2  # the checked step and the measured step


def _unfreeze(module: nn.Module) -> None:
    module.train()  # unfreezes every BatchNorm


def _round_trip_dtype(module: nn.Module) -> None:
    module.double().float()  # new buffer tensor objects, same values and dtype


def _load_assigning(module: nn.Module) -> None:
    module.load_state_dict({name: value.clone() for name, value in module.state_dict().items()}, assign=True)


@pytest.mark.parametrize(
    "change, reason",
    [
        (_unfreeze, "train/eval flags of 3 submodule(s) differ"),
        (_round_trip_dtype, "another tensor object than when planned"),
        (_load_assigning, "another tensor object than when planned"),
    ],
    ids=["train-unfreezes", "double-then-float", "load-state-dict-assign"],
)
def test_changes_after_planning_run_the_original_model(change, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    """The export graph reads the tensor objects and flags it was captured with: after these changes it computed
    with stale buffers (BatchNorm statistics advanced twice), missed new parameters' gradients or failed on dtypes."""
    case = _frozen_batchnorm_case()
    reference = twin(case)
    optimized = _optimize_at(case, 0.5)
    change(optimized)
    change(reference)
    with caplog.at_level("WARNING", logger="autockpt.rewrite"):
        assert_same_step(optimized, reference, case)
    assert "running the original model without the plan" in caplog.text and reason in caplog.text


@needs_transformers
def test_a_model_converted_after_planning_runs_the_original_model(caplog: pytest.LogCaptureFixture) -> None:
    """GPT-2 in float64 after planning in float32 (its inputs, token ids, are unchanged): the export graph failed."""
    case = zoo.build("gpt2")
    reference = twin(case)
    optimized = _optimize_at(case, 0.5)
    optimized.double()
    reference.double()
    with caplog.at_level("WARNING", logger="autockpt.rewrite"):
        actual, actual_grads = run_step(optimized, case)
    expected, expected_grads = run_step(reference, case)
    torch.testing.assert_close(actual.logits, expected.logits)
    torch.testing.assert_close(actual_grads, expected_grads)
    assert "is now torch.float64 on cpu, planned as torch.float32 on cpu" in caplog.text


def test_a_step_under_another_autocast_state_runs_the_original_model(caplog: pytest.LogCaptureFixture) -> None:
    """Planned without autocast, trained under bfloat16 autocast: the export graph's baked-in casts failed."""
    case = _frozen_batchnorm_case()
    reference = twin(case)
    optimized = _optimize_at(case, 0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16), caplog.at_level("WARNING", logger="autockpt.rewrite"):
        assert_same_step(optimized, reference, case)
    assert "autocast is on (cpu bfloat16), planned off" in caplog.text


@needs_transformers
def test_inputs_passed_twice_are_not_merged_by_the_capture() -> None:
    """``model(ids, labels=ids)``: torch.export made the two one graph input, so the graph read the labels as token
    ids and a later batch with other labels (shifted, -100 on padding) computed something else, silently."""
    case = zoo.build("gpt2")
    assert case.kwargs["labels"] is case.args[0]  # the example inputs share the tensor
    reference = twin(case)
    optimized = _optimize_at(case, 0.5)
    assert autockpt.get_plan(optimized).capture == "export"
    ids = case.args[0]
    labels = torch.roll(ids, 1, dims=1)
    labels[:, -8:] = -100
    other_batch = zoo.ZooCase(name="gpt2-other-labels", model=case.model, args=(ids,), kwargs={"labels": labels})
    assert_same_step(optimized, reference, other_batch)


def test_a_model_with_nothing_to_checkpoint() -> None:
    """One layer: no candidate region. The solver built a region 0..-1 and raised a ValueError from inside."""
    x = torch.randn(128, 64)
    plan = autockpt.plan(nn.Linear(64, 64), budget_bytes=10**15, example_inputs=(x,))
    assert plan.status == "identity" and not plan.regions
    with pytest.raises(autockpt.InfeasibleBudgetError) as raised:
        autockpt.plan(nn.Linear(64, 64), budget_bytes=plan.baseline_peak_bytes - 1, example_inputs=(x,))
    assert raised.value.min_feasible_bytes == plan.baseline_peak_bytes


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
def test_buffers_updated_outside_the_traced_tensors_advance_as_in_the_model(update: str) -> None:
    """fx ran ``self.count += 1`` once while tracing and left it out of the graph (the counter never advanced); a
    buffer assigned anew left the original model's counter changed after planning; and an assignment from traced
    tensors left an fx Proxy in the buffer, so every later capture path failed."""
    torch.manual_seed(0)
    case = zoo.ZooCase(name="counter", model=_CountsItsSteps(update=update), args=(torch.randn(512, 64),))
    reference = twin(case)
    optimized = _optimize_at(case, 0.5)
    assert int(case.model.count) == 0 and torch.equal(case.model.ema, torch.ones(64))  # planning left no trace
    assert autockpt.get_plan(optimized).capture != "fx"
    assert_same_step(optimized, reference, case)
    assert int(optimized.state_dict()["count"]) == int(reference.count) == 1


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
    plan = _check(case, 0.5)
    assert plan.capture == "module"
    assert any("_Prediction" in note for note in plan.notes)


@needs_transformers
def test_the_same_inputs_passed_another_way_keep_the_plan(caplog: pytest.LogCaptureFixture) -> None:
    """input_ids by keyword instead of positionally, keywords in another order, an explicit None: the plan was
    dropped (the step ran unplanned, over the budget) because the call's structure differed from the example's."""
    case = zoo.build("gpt2")
    reference = twin(case)
    optimized = _optimize_at(case, 0.5)
    plan = autockpt.get_plan(optimized)
    ids = case.args[0]
    labels = ids.clone()
    calls = [((), {"input_ids": ids, "labels": labels}), ((), {"labels": labels, "input_ids": ids, "attention_mask": None})]
    with caplog.at_level("WARNING", logger="autockpt"):
        for args, kwargs in calls:
            other_form = zoo.ZooCase(name="gpt2-keywords", model=case.model, args=args, kwargs=kwargs)
            assert autockpt.measure_step(optimized, args, kwargs).peak_bytes <= plan.budget_bytes
            assert_same_step(optimized, reference, other_form)
    assert "inputs differ" not in caplog.text
    # a value the example did not pass (a mask tensor) has no input in the graph: the original model runs, warned
    masked = zoo.ZooCase(
        name="gpt2-masked", model=case.model, args=(ids,), kwargs={"labels": labels, "attention_mask": torch.ones_like(ids)}
    )
    with caplog.at_level("WARNING", logger="autockpt"):
        actual, actual_grads = run_step(optimized, masked)
    expected, expected_grads = run_step(reference, masked)
    assert "which arguments are given" in caplog.text
    torch.testing.assert_close(actual.loss, expected.loss)
    assert actual_grads.keys() == expected_grads.keys()
    for name, want in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], want, msg=f"gradient of {name}")
