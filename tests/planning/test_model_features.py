"""Models that break naive checkpointing, end to end (plan, rewrite, measure, compare with PyTorch): frozen
parameters, in-place writes after a region, tied weights, dict and tuple outputs, outputs holding tensors in other
containers (a distribution, a dataclass), keyword-only inputs, and a model with nothing to checkpoint."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from edge_models import Chain, WritesIntoAnEarlierTensor
from support import check_optimized
from torch import nn

import autockpt
from autockpt.present import zoo


def test_partly_frozen_model() -> None:
    torch.manual_seed(0)
    model = Chain()
    for layer in model.layers[:4]:
        layer.requires_grad_(False)
    check_optimized(zoo.ZooCase(name="frozen", model=model, args=(torch.randn(256, 128),)))


def test_in_place_write_after_a_region_into_its_input() -> None:
    torch.manual_seed(0)
    check_optimized(zoo.ZooCase(name="inplace", model=WritesIntoAnEarlierTensor(), args=(torch.randn(256, 128),)), 0.4)


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
    plan = check_optimized(case)
    assert plan.static_bytes > 0


class _TupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.chain = Chain(depth=10)

    def forward(self, *, features: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.chain(features) * scale
        return out, out.detach().abs()


def test_keyword_only_inputs_and_tuple_output() -> None:
    torch.manual_seed(0)
    case = zoo.ZooCase(
        name="kw", model=_TupleOut(), args=(), kwargs={"features": torch.randn(256, 128), "scale": 2.0},
        loss_fn=lambda out: out[0].square().mean(),
    )
    check_optimized(case)


def test_a_model_with_nothing_to_checkpoint() -> None:
    """One layer: no candidate region. The solver built a region 0..-1 and raised a ValueError from inside."""
    x = torch.randn(128, 64)
    plan = autockpt.plan(nn.Linear(64, 64), budget_bytes=10**15, example_inputs=(x,))
    assert plan.status == "identity" and not plan.regions
    with pytest.raises(autockpt.InfeasibleBudgetError) as raised:
        autockpt.plan(nn.Linear(64, 64), budget_bytes=plan.baseline_peak_bytes - 1, example_inputs=(x,))
    assert raised.value.min_feasible_bytes == plan.baseline_peak_bytes


@dataclasses.dataclass
class _Prediction:  # not registered with torch's pytree: its tensors sit in a plain class and a dict
    mean: torch.Tensor
    extra: dict


class _Heads(nn.Module):
    def __init__(self, returns: str) -> None:
        super().__init__()
        self.returns = returns
        self.body = nn.Sequential(*(m for _ in range(6) for m in (nn.Linear(128, 128), nn.GELU())))
        self.head = nn.Linear(128, 16)

    def forward(self, x: torch.Tensor) -> object:
        y = self.head(self.body(x))
        if self.returns == "distribution":
            return torch.distributions.Normal(y[:, :8], y[:, 8:].exp())
        return _Prediction(mean=y[:, :8], extra={"scale": y[:, 8:].exp()})


@pytest.mark.parametrize("returns", ["distribution", "dataclass"])
def test_outputs_holding_tensors_in_other_containers(returns: str) -> None:
    """Issue 46, item 3: a ``torch.distributions.Normal`` (export refuses it: module-level capture) and an unregistered
    dataclass holding a dict (fx) are planned, keep the budget and train like the model."""
    torch.manual_seed(0)
    target = torch.zeros(256, 8)

    def loss_fn(output: object) -> torch.Tensor:
        if isinstance(output, torch.distributions.Normal):
            return -output.log_prob(target).mean()
        return output.mean.square().mean() + output.extra["scale"].mean()

    check_optimized(zoo.ZooCase(name=returns, model=_Heads(returns), args=(torch.randn(256, 128),), loss_fn=loss_fn))
