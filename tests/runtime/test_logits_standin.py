"""The logits stand-in (``runtime/logits_standin.py``, issue 48's loss for eager models: the FSDP2 root unit): a
projection made to return it gives the loss and every gradient of the model as written (fp32, the recompute actions'
tolerances) through Hugging Face's own loss (mean over labels that are not -100, ``num_items_in_batch``), a
torchtitan-style ``loss_fn`` on the returned logits, tied and untied heads, Gemma 2's soft-capping; the chunked
cross-entropy runs (no full logits made) and a read of the returned logits computes them in full."""

from __future__ import annotations

import copy

import pytest
import torch
from support import needs_transformers
from torch import nn
from torch.nn import functional as F

from autockpt.runtime import chunked_loss, logits_standin
from autockpt.runtime.logits_standin import LogitsStandIn, chunk_projection

VOCAB, TOKENS = 512, 48


def _llama(tied: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False, tie_word_embeddings=tied,
    ))


def _gemma2() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, use_cache=False, final_logit_softcapping=30.0,
    ))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=generator)
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt: no loss there
    return ids, labels


LOSSES = {
    "hf-labels": lambda model, ids, labels: model(input_ids=ids, labels=labels).loss,
    "hf-num-items": lambda model, ids, labels: model(input_ids=ids, labels=labels, num_items_in_batch=17).loss,
    "loss-fn-on-logits": lambda model, ids, labels: F.cross_entropy(
        model(input_ids=ids).logits.flatten(0, 1).float(), labels.flatten(0, 1)),
}


@needs_transformers
@pytest.mark.parametrize(("build", "loss"), [
    (_llama, "hf-labels"), (_llama, "hf-num-items"), (_llama, "loss-fn-on-logits"),
    (lambda: _llama(tied=True), "hf-labels"), (_gemma2, "hf-labels"),
], ids=["llama-labels", "llama-num-items", "llama-loss-fn", "llama-tied", "gemma2-softcap"])
def test_the_loss_and_every_gradient_are_the_models(build, loss, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build()
    reference = copy.deepcopy(model)
    ids, labels = _batch()
    want = LOSSES[loss](reference, ids, labels)
    want.backward()
    chunked_calls = []
    original = chunked_loss.chunked_linear_cross_entropy
    monkeypatch.setattr(logits_standin, "chunked_linear_cross_entropy",
                        lambda *a, **k: chunked_calls.append(k) or original(*a, **k))
    monkeypatch.setattr(LogitsStandIn, "materialized", lambda self: pytest.fail("the logits were made in full"))
    undo = chunk_projection(model.lm_head, 7)  # a chunk no token count divides
    got = LOSSES[loss](model, ids, labels)
    got.backward()
    undo()
    assert len(chunked_calls) == 1 and chunked_calls[0]["chunk_tokens"] == 7
    if build is _gemma2:
        assert chunked_calls[0]["softcap"] == 30.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert "forward" not in model.lm_head.__dict__  # undone


@needs_transformers
def test_the_returned_logits_are_computed_in_full_where_read_and_as_written_without_gradients() -> None:
    model = _llama()
    ids, labels = _batch()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    chunk_projection(model.lm_head, 8)
    output = model(input_ids=ids, labels=labels)
    assert isinstance(output.logits, LogitsStandIn)
    assert (output.logits.shape, output.logits.dtype) == (want.shape, want.dtype)
    read = output.logits[:, -1] * 1.0  # a read the stand-in cannot keep lazy: the logits made in full
    assert type(read) is torch.Tensor
    torch.testing.assert_close(read, want[:, -1], rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation loops read the logits: the projection runs as written
        assert type(model(input_ids=ids).logits) is torch.Tensor
    model.eval()
    assert type(model(input_ids=ids).logits) is torch.Tensor


def test_a_projection_that_is_not_a_linear_or_a_bad_chunk_is_refused() -> None:
    with pytest.raises(TypeError, match="must be an nn.Linear"):
        chunk_projection(nn.Embedding(4, 4), 8)
    with pytest.raises(ValueError, match="chunk_tokens must be a positive integer"):
        chunk_projection(nn.Linear(4, 4), 0)
