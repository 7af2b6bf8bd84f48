"""The chunked projection and cross-entropy (issue 48's runtime, ``runtime/chunked_loss.py``): the loss and every
gradient equal the dense ``F.cross_entropy`` of the full logits (fp32, the recompute actions' tolerances), whatever
the chunk; bias, tied weights, ignored labels, Gemma's soft-capping and the three reductions; under bf16 autocast
within the tolerance stated here; a step that holds one chunk of logits instead of all of them (MemTracker)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autockpt.measure.step import measure_step
from autockpt.runtime.chunked_loss import chunked_linear_cross_entropy

TOKENS, HIDDEN, VOCAB = 37, 16, 101  # a token count no chunk divides


def _inputs(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator, dtype=dtype)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=dtype) * 0.3
    bias = torch.randn(VOCAB, generator=generator, dtype=dtype) * 0.1
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    labels[::5] = -100  # padding: no loss there
    return hidden, weight, bias, labels


def _dense(hidden, weight, bias, labels, *, reduction="mean", num_items=None, softcap=None):
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    loss = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum" if num_items else reduction)
    return loss / num_items if num_items else loss


def _grads(loss_of, *tensors):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]
    loss = loss_of(*leaves)
    loss.backward()
    return loss.detach(), [leaf.grad if leaf is not None else None for leaf in leaves]


@pytest.mark.parametrize("chunk_tokens", [1, 8, TOKENS, 64])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("reduction", "num_items", "softcap"), [
    ("mean", None, None), ("sum", None, None), ("sum", 23, None), ("mean", None, 2.5),
])
def test_the_loss_and_every_gradient_are_the_dense_ones(chunk_tokens, with_bias, reduction, num_items, softcap) -> None:
    hidden, weight, bias, labels = _inputs()
    bias = bias if with_bias else None
    options = {"reduction": reduction, "num_items": num_items, "softcap": softcap}
    want, want_grads = _grads(lambda h, w, b: _dense(h, w, b, labels, **options), hidden, weight, bias)
    got, got_grads = _grads(
        lambda h, w, b: chunked_linear_cross_entropy(h, w, labels, bias=b, chunk_tokens=chunk_tokens, **options),
        hidden, weight, bias,
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, g, w in zip(("hidden", "weight", "bias"), got_grads, want_grads):
        if w is None:
            assert g is None, name
            continue
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_a_tied_head_sums_its_two_gradients_as_the_dense_loss_does() -> None:
    """Llama-3.2 and GPT-2 tie the head to the embedding: one Parameter read twice, gradients summed."""
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, HIDDEN)
    ids = torch.randint(0, VOCAB, (2, 19))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # shifted, the last position ignored

    def step(chunked: bool) -> tuple[torch.Tensor, torch.Tensor]:
        embedding.zero_grad(set_to_none=True)
        hidden = torch.tanh(embedding(ids))
        if chunked:
            loss = chunked_linear_cross_entropy(hidden, embedding.weight, labels, chunk_tokens=5)
        else:
            loss = F.cross_entropy(F.linear(hidden, embedding.weight).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        return loss.detach(), embedding.weight.grad.clone()

    want_loss, want_grad = step(False)
    got_loss, got_grad = step(True)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)


def test_under_bf16_autocast_the_chunks_are_the_dense_logits_to_rounding() -> None:
    """The projection runs in bf16 as autocast runs it in forward, and again so in backward: the loss matches the
    dense loss under the same autocast to float32 rounding of the sum, the gradients to bf16 rounding."""
    hidden, weight, bias, labels = _inputs(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = _grads(lambda h, w, b: _dense(h, w, b, labels), hidden, weight, bias)
        got, got_grads = _grads(
            lambda h, w, b: chunked_linear_cross_entropy(h, w, labels, bias=b, chunk_tokens=8), hidden, weight, bias,
        )
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-3)


class _Head(nn.Module):
    """The tail of a language model: a projection and the cross-entropy, dense or in chunks."""

    def __init__(self, chunk_tokens: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(64, 8000, bias=False)
        self.chunk_tokens = chunk_tokens

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.chunk_tokens is None:
            return F.cross_entropy(self.proj(hidden).float(), labels)
        return chunked_linear_cross_entropy(hidden, self.proj.weight, labels, chunk_tokens=self.chunk_tokens)


def test_the_step_holds_one_chunk_of_logits_instead_of_all_of_them() -> None:
    tokens = 512
    hidden = torch.randn(tokens, 64, requires_grad=True)
    labels = torch.randint(0, 8000, (tokens,))
    dense = measure_step(_Head(None), (hidden, labels), {}, lambda loss: loss).peak_bytes
    chunked = measure_step(_Head(64), (hidden, labels), {}, lambda loss: loss).peak_bytes
    logits_bytes = tokens * 8000 * 4
    # the dense step holds the logits and their gradient at once (two full copies); the chunked one an eighth of them
    assert chunked <= dense - logits_bytes, (dense, chunked, logits_bytes)


def test_fake_tensors_run_the_chunked_step_with_the_dense_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        hidden = torch.randn(TOKENS, HIDDEN, requires_grad=True)
        weight = torch.randn(VOCAB, HIDDEN, requires_grad=True)
        labels = torch.randint(0, VOCAB, (TOKENS,))
        loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=8)
        loss.backward()
        assert loss.shape == () and hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape


@pytest.mark.parametrize(("change", "says"), [
    ({"chunk_tokens": 0}, "chunk_tokens must be a positive integer"),
    ({"reduction": "none"}, "reduction must be one of"),
    ({"num_items": 4}, "give reduction='sum' with it"),
    ({"softcap": -1.0}, "softcap must be a positive number"),
    ({"labels": torch.zeros(TOKENS)}, "labels must be integers"),
    ({"labels": torch.zeros(TOKENS - 1, dtype=torch.long)}, "shift the labels"),
    ({"weight": torch.zeros(VOCAB, HIDDEN + 1)}, r"must be \(vocabulary, hidden size\)"),
])
def test_bad_arguments_say_what_was_expected(change: dict, says: str) -> None:
    hidden, weight, _, labels = _inputs()
    arguments = {"weight": weight, "labels": labels, "chunk_tokens": 8} | change
    with pytest.raises((TypeError, ValueError), match=says):
        chunked_linear_cross_entropy(hidden, arguments.pop("weight"), arguments.pop("labels"), **arguments)
