"""The loss tail found from the captured graph (issue 48, item 2; ``measure/loss_tail.py``): a projection whose output
reaches one cross-entropy through per-logit ops, on Hugging Face decoders (untied and tied heads, Gemma's
soft-capping, ``num_items_in_batch``) and a nanoGPT-style model captured by fx; and the reasons where there is none."""

from __future__ import annotations

import pytest
import torch
from support import needs_transformers, tiny_causal_lm
from torch import nn
from torch.nn import functional as F

from autockpt.measure.capture import capture
from autockpt.measure.loss_tail import find_loss_tail

VOCAB = 256


def _hf(config_class: str, **extra: object) -> nn.Module:
    return tiny_causal_lm(config_class, VOCAB, 64, **extra)


@needs_transformers
@pytest.mark.parametrize(("config_class", "extra", "tied", "softcap"), [
    ("LlamaConfig", {}, False, None),
    ("LlamaConfig", {"tie_word_embeddings": True}, True, None),
    ("Gemma2Config", {"head_dim": 16, "final_logit_softcapping": 30.0}, True, 30.0),
])
def test_a_hugging_face_decoder_s_head_and_loss_are_found(config_class, extra, tied, softcap) -> None:
    model = _hf(config_class, **extra)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = torch.randint(0, VOCAB, (2, 16))
    search = find_loss_tail(capture(model, (), {"input_ids": ids, "labels": ids}))
    tail = search.tail
    assert search.reason == "" and tail is not None
    assert tail.weight == "model.lm_head.weight" and not tail.has_bias
    assert (tail.vocabulary, tail.tokens, tail.logits_bytes) == (VOCAB, 32, 32 * VOCAB * 4)
    assert (tail.softcap, tail.reduction, tail.ignore_index, tail.divisor) == (softcap, "mean", -100, None)
    assert tail.logits_returned  # CausalLMOutput.logits: the full logits leave the model too


@needs_transformers
def test_hugging_face_s_num_items_in_batch_divides_the_summed_loss() -> None:
    model = _hf("LlamaConfig")
    ids = torch.randint(0, VOCAB, (2, 16))
    tail = find_loss_tail(capture(model, (), {"input_ids": ids, "labels": ids, "num_items_in_batch": torch.tensor(30)})).tail
    assert tail is not None and tail.reduction == "sum" and tail.divisor is not None


class _Nano(nn.Module):
    """nanoGPT's tail: a tied head, the loss inside the model, ignore_index=-1; ``aux`` adds a z-loss on the logits."""

    def __init__(self, aux: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(100, 32)
        self.head = nn.Linear(32, 100, bias=False)
        self.head.weight = self.embedding.weight
        self.aux = aux

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embedding(idx)))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return loss + 1e-4 * logits.logsumexp(-1).pow(2).mean() if self.aux else loss


def test_an_fx_capture_s_head_and_loss_are_found_and_an_auxiliary_term_refuses_it() -> None:
    idx = torch.randint(0, 100, (2, 8))
    graph = capture(_Nano(), (idx, idx), {})
    tail = find_loss_tail(graph).tail
    assert graph.kind.value == "fx" and tail is not None
    assert (tail.weight, tail.vocabulary, tail.ignore_index, tail.logits_returned) == ("head.weight", 100, -1, False)
    refused = find_loss_tail(capture(_Nano(aux=True), (idx, idx), {}))
    assert refused.tail is None and "read besides the loss" in refused.reason


def test_a_loss_outside_the_model_and_a_per_token_loss_are_named_as_such() -> None:
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(16, 50))
    outside = find_loss_tail(capture(head, (torch.randn(4, 16),), {}))
    assert outside.tail is None and "the loss is outside the model" in outside.reason

    class PerToken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(16, 50)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.head(x), y, reduction="none").sum()

    per_token = find_loss_tail(capture(PerToken(), (torch.randn(4, 16), torch.randint(0, 50, (4,))), {}))
    assert per_token.tail is None and "a per-token loss" in per_token.reason
