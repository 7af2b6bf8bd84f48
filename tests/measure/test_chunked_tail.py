"""The captured graph with its loss tail in chunks (issue 48; ``measure/chunked_tail.py``): the program gives the
model's loss and gradients (fp32, to rounding) on Hugging Face decoders with tied and untied heads, padding labels
(-100), Gemma's soft-capping and ``num_items_in_batch``, and on a nanoGPT-style model (fx, a biased head,
``ignore_index=-1``); the full logits are gone from the program and from the training step's output."""

from __future__ import annotations

import copy

import pytest
import torch
from support import needs_transformers, tiny_causal_lm
from torch import nn
from torch.nn import functional as F

from autockpt.measure.capture import capture
from autockpt.measure.chunked_tail import copied_graph, with_chunked_loss
from autockpt.measure.loss_tail import find_loss_tail
from autockpt.measure.step import measure_step
from autockpt.types import CaptureKind

VOCAB = 300


def _hf(config_class: str, **extra: object) -> nn.Module:
    return tiny_causal_lm(config_class, VOCAB, 32, **extra)


def _gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(model: nn.Module, args: tuple, kwargs: dict, chunk_tokens: int, loss_of=lambda out: out) -> bool:
    """The chunked program's loss and gradients against the model's own step; returns whether logits were dropped."""
    twin = copy.deepcopy(model)
    graph = capture(model, args, kwargs)
    search = find_loss_tail(graph)
    assert search.tail is not None, search.reason
    chunked = with_chunked_loss(graph, search.tail, chunk_tokens)
    assert not any(unit.name == search.tail.projection for unit in chunked.graph.units)  # no full projection left
    expected = loss_of(twin(*args, **kwargs))
    expected.backward()
    got = loss_of(chunked.graph.executable(*args, **kwargs))
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    want, have = _gradients(twin), _gradients(model)
    assert want.keys() == have.keys()
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    return chunked.logits_dropped


@needs_transformers
@pytest.mark.parametrize(("config_class", "extra"), [
    ("LlamaConfig", {}),
    ("LlamaConfig", {"tie_word_embeddings": True}),
    ("Gemma2Config", {"head_dim": 8, "final_logit_softcapping": 5.0}),
])
def test_hugging_face_decoders_keep_their_loss_and_gradients_in_chunks(config_class, extra) -> None:
    model = _hf(config_class, **extra)
    ids = torch.randint(0, VOCAB, (2, 24))
    labels = ids.clone()
    labels[0, :7] = -100  # padding
    dropped = _assert_same_step(model, (), {"input_ids": ids, "labels": labels}, 10, loss_of=lambda out: out.loss)
    assert dropped  # CausalLMOutput.logits: None in the chunked training step


@needs_transformers
def test_num_items_in_batch_divides_the_chunked_sum_as_it_divided_the_model_s() -> None:
    model = _hf("LlamaConfig")
    ids = torch.randint(0, VOCAB, (2, 16))
    kwargs = {"input_ids": ids, "labels": ids, "num_items_in_batch": torch.tensor(37)}
    _assert_same_step(model, (), kwargs, 7, loss_of=lambda out: out.loss)


class _NanoBiased(nn.Module):
    """nanoGPT's tail with an untied, biased head and ``ignore_index=-1``, the loss inside the model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embedding(idx)))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def test_an_fx_captured_biased_head_keeps_its_loss_and_gradients_in_chunks() -> None:
    idx = torch.randint(0, VOCAB, (3, 10))
    targets = idx.clone()
    targets[1, 4:] = -1
    assert not _assert_same_step(_NanoBiased(), (idx, targets), {}, 8)


@needs_transformers
def test_under_bf16_autocast_the_chunks_keep_the_loss_and_the_head_gradient_within_one_bf16_rounding() -> None:
    """Autocast runs the chunks' projection in bf16 as it ran the model's (forward, and backward's recomputation):
    the loss is the model's to float32 rounding, every gradient but the (tied) head's is identical, and the head's is
    within 1 % (measured: 0.3 %; its chunks' products are summed in float32, the model's in one bf16 matmul)."""
    model = _hf("LlamaConfig", tie_word_embeddings=True)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 16))
    labels = ids.clone()
    labels[0, :3] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = capture(model, (ids,), {"labels": labels})
        chunked = with_chunked_loss(graph, find_loss_tail(graph).tail, 5).graph
        got, expected = chunked.executable(ids, labels=labels).loss, twin(ids, labels=labels).loss
    got.backward()
    expected.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for (name, mine), theirs in zip(model.named_parameters(), twin.parameters()):
        if name == "model.embed_tokens.weight":  # the tied head
            assert (mine.grad - theirs.grad).abs().max() <= 0.01 * theirs.grad.abs().max()
        else:
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=0, msg=name)


class _ScaledByAConstant(nn.Module):
    """A tensor made in forward (export lifts it into a constant of the graph), and a branch on a size (which fx
    cannot trace, so the capture is export's)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = x * 1.0
        return self.fc(x) * torch.tensor(3, dtype=torch.int64)


def test_a_copied_graph_keeps_the_exported_constants_plain_attributes() -> None:
    """fx registers the tensors a copied graph reads as buffers: export's lifted constants then counted in the
    module's state for MemTracker, 8 bytes over a prediction on a Gemma 2 (issue 48). The copy keeps the original's
    buffers, and measures what the original measures."""
    torch.manual_seed(0)
    model, x = _ScaledByAConstant(), torch.randn(4, 16)
    graph = capture(model, (x,), {})
    assert graph.kind is CaptureKind.EXPORT
    copied = copied_graph(graph)
    assert dict(copied.executable.named_buffers()).keys() == dict(graph.executable.named_buffers()).keys()
    torch.testing.assert_close(copied.executable(x), graph.executable(x))
    loss = lambda output: output.sum()
    assert measure_step(copied.executable, (x,), {}, loss).peak_bytes == measure_step(
        graph.executable, (x,), {}, loss).peak_bytes
