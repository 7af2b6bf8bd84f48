"""The zoo's ``blocks=``: a model's repeated blocks set apart from its size's widths and inputs (the tests' small
models, ``support.tiny``)."""

from __future__ import annotations

import pytest
import torch
from support import needs_transformers

from autockpt.present import zoo


def test_blocks_set_the_repeated_blocks_and_keep_the_sizes_widths_and_inputs() -> None:
    sized, fewer = zoo.build("cnn", "tiny"), zoo.build("cnn", "tiny", blocks=2)
    assert (len(sized.model.blocks), len(fewer.model.blocks)) == (12, 2)
    assert fewer.model.head.in_features == sized.model.head.in_features
    assert [a.shape for a in fewer.args] == [a.shape for a in sized.args]
    assert len(zoo.build("transformer", "tiny", blocks=1).model.blocks) == 1
    assert len([m for m in zoo.build("mlp", "tiny", blocks=3).model if isinstance(m, torch.nn.Linear)]) == 4


@needs_transformers
@pytest.mark.parametrize("name", ["gpt2", "bert", "t5", "llama", "vit"])
def test_a_hugging_face_model_gets_the_layers_asked_for(name: str) -> None:
    config, sized = zoo.build(name, "tiny", blocks=1).model.config, zoo.build(name, "tiny").model.config
    assert config.num_hidden_layers == 1 < sized.num_hidden_layers  # each config's own name for it (n_layer, ...)
    assert getattr(config, "num_decoder_layers", 1) == 1  # T5's decoder too
    assert config.hidden_size == sized.hidden_size


@pytest.mark.parametrize(
    ("name", "blocks", "message"),
    [("cnn", 0, "blocks must be an integer >= 1"), ("cnn", True, "blocks must be an integer >= 1"),
     ("mlp", 2.0, "blocks must be an integer >= 1"), ("unet", 2, "has no repeated blocks to set")],
)
def test_blocks_a_model_cannot_have_are_refused(name: str, blocks: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        zoo.build(name, "tiny", blocks=blocks)  # type: ignore[arg-type]
