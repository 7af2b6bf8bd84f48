"""The sweep's plumbing (experiments/bench/sweep.py): moving a zoo case's tensors, the --device flag, and freeing one
model before the next is measured (on CUDA every measurement counts all the process holds on the device)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from autockpt.present import zoo
from experiments.bench import sweep


def _case_with_labels() -> zoo.ZooCase:
    labels = torch.randint(0, 3, (4,))

    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, labels)

    return zoo.ZooCase(name="toy", model=nn.Linear(5, 3), args=(torch.randn(4, 5),),
                       kwargs={"scale": torch.ones(4)}, loss_fn=loss_fn)


def test_map_inputs_reaches_arguments_keywords_and_the_loss_functions_tensors() -> None:
    case = _case_with_labels()
    moved = sweep._map_inputs(case, lambda value: value.double() if isinstance(value, torch.Tensor) else value)
    assert moved.args[0].dtype == torch.float64 and moved.kwargs["scale"].dtype == torch.float64
    labels_after = moved.loss_fn.__closure__[0].cell_contents
    assert labels_after.dtype == torch.float64 and case.loss_fn.__closure__[0].cell_contents.dtype == torch.int64
    assert case.args[0].dtype == torch.float32  # the case itself is left as it was


def test_rebatch_tiles_the_loss_functions_labels_with_the_inputs() -> None:
    batch = sweep.rebatch(_case_with_labels(), 10)
    assert batch.args[0].shape == (10, 5) and batch.kwargs["scale"].shape == (10,)
    assert batch.loss_fn.__closure__[0].cell_contents.shape == (10,)


@pytest.mark.parametrize(("text", "message"), [
    ("gpu", "is not a torch device"),
    ("meta", "the sweep runs on cpu or cuda"),
    pytest.param("cuda", "sees no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
])
def test_device_flag_names_what_was_given_and_what_to_give(
    text: str, message: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit):
        sweep.parse_args(["--device", text])
    error = capsys.readouterr().err
    assert f"--device {text!r}" in error and message in error


def test_free_previous_model_collects_a_model_held_only_by_a_reference_cycle() -> None:
    model = nn.Linear(4, 4)
    model.itself = [model]  # a cycle, like the planners' and captured graphs' references to the model
    parameter = weakref.ref(model.weight)
    gc.disable()  # the collector must not get there first
    try:
        del model
        assert parameter() is not None
        assert sweep.free_previous_model(torch.device("cpu")) is None
        assert parameter() is None
    finally:
        gc.enable()
