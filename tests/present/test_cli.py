"""The command line: every user mistake gives one line and a non-zero exit; the commands write what they say."""

from __future__ import annotations

import json
import re
import runpy
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from click.testing import CliRunner
from support import budget_at, needs_transformers

import autockpt
from autockpt.present import zoo
from autockpt.present.cli import main
from autockpt.present.workload import parse_budget, parse_input_spec
from autockpt.units import format_bytes

MLP = ["cli_models:small_mlp", "--input", "float32[128,64]"]


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["--quiet", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def one_line_error(*args: str) -> str:
    code, out, err = run(*args)
    assert code == 1, (code, out, err)
    lines = err.strip().splitlines()
    assert lines[0].startswith("error: ") and "Traceback" not in err
    assert lines[1:] == ["(run with --debug for the traceback)"]
    return lines[0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GB", 8 * 10**9), ("7.5GiB", int(7.5 * 2**30)), ("500MB", 500 * 10**6), ("123456789", 123456789),
     ("1e9", 10**9), ("64 KiB", 65536), ("2gb", 2 * 10**9)],
)
def test_budgets_take_explicit_units(text: str, expected: int) -> None:
    assert parse_budget(text) == expected


def test_input_specs() -> None:
    spec = parse_input_spec("input_ids=int64[4,512]:high=50257")
    assert (spec.name, spec.dtype, spec.shape, spec.fill) == ("input_ids", "int64", (4, 512), "high=50257")
    assert parse_input_spec("float32[8, 3, 224, 224]").name is None
    assert parse_input_spec("mask=bool[2,3]:ones").fill == "ones"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "no_such_package.models:make", "--budget", "1MB"], "cannot import 'no_such_package.models'"),
        (["plan", "cli_models:missing", "--budget", "1MB"], "has no attribute 'missing'"),
        (["plan", "cli_models:raising_factory", "--budget", "1MB"], "raised RuntimeError: weights file missing"),
        (["plan", "cli_models:not_a_module", "--budget", "1MB"], "returned a int, not a torch.nn.Module"),
        (["plan", "resnet", "--budget", "1MB"], "neither a built-in example"),
        (["plan", "cli_models:small_mlp", "--budget", "1MB"], "no example inputs"),
        (["plan", *MLP, "--inputs", "cli_models:mlp_inputs", "--budget", "1MB"], "not both"),
        (["plan", "cli_models:small_mlp", "--inputs", "cli_models:string_inputs", "--budget", "1MB"], "returned a str"),
        (["plan", "cli_models:small_mlp", "--input", "x=float32[8,a]", "--budget", "1MB"], "not understood"),
        (["plan", "cli_models:small_mlp", "--input", "x=complex7[8]", "--budget", "1MB"], "unknown dtype"),
        (["plan", "cli_models:small_mlp", "--input", "x=int64[8]:randn", "--budget", "1MB"], "does not fit dtype"),
        (["plan", "cli_models:small_mlp", "--input", "x=float32[0,4]", "--budget", "1MB"], "positive integer"),
        (["plan", *MLP, "--budget", "8 gigs"], "budget '8 gigs' not understood"),
        (["plan", *MLP, "--budget", "0.1B"], "less than one byte"),
        (["plan", *MLP, "--budget", "1kB"], "below the smallest peak"),
        (["sweep", *MLP, "--budgets", ",", "--out", "unused"], "lists no budget"),
        (["plan", *MLP, "--input", "x=float32[3,64]", "--budget", "1MB"], "forward"),
        (["plan", *MLP], "give --budget"),
        (["plan", *MLP, "--target", "h900"], "unknown device 'h900'"),
    ],
)
def test_user_mistakes_give_one_line_and_exit_1(args: list[str], message: str) -> None:
    assert message in one_line_error(*args)


def test_debug_shows_the_traceback() -> None:
    result = CliRunner().invoke(main, ["--quiet", "--debug", "plan", *MLP, "--budget", "8 gigs"])
    assert result.exit_code != 0 and isinstance(result.exception, ValueError)


def test_estimate_prints_the_breakdown(tmp_path: Path) -> None:
    code, out, _ = run("estimate", *MLP, "--optimizer", "adamw", "--depth", "1", "--csv", str(tmp_path / "e.csv"))
    assert code == 0
    assert "activations saved for backward" in out and "optimizer state (adamw)" in out
    params = list(__import__("cli_models").small_mlp().parameters())
    parameter_bytes = sum(p.numel() * 4 for p in params)
    assert re.search(rf"^\s*parameters\s+{parameter_bytes:,d} B", out, re.MULTILINE)
    # measured: exp_avg and exp_avg_sq per parameter, and a 0-d float32 step counter each
    state = re.search(r"^\s*optimizer state \(adamw\)\s+([0-9,]+) B", out, re.MULTILINE)
    assert state is not None and int(state.group(1).replace(",", "")) == 2 * parameter_bytes + 4 * len(params)
    assert "training step peak (optimizer states and step included)" in out
    assert (tmp_path / "e.csv").read_text().startswith("kind,name,bytes")


def test_plan_writes_a_plan_and_a_report_that_apply_elsewhere(tmp_path: Path) -> None:
    code, out, _ = run("plan", *MLP, "--budget", "360kB", "--out", str(tmp_path / "p.json"),
                       "--report", str(tmp_path / "r.html"), "--pareto", "3")
    assert code == 0 and "predicted peak" in out
    saved = autockpt.load_plan(tmp_path / "p.json")
    assert saved.budget_bytes == 360_000 and saved.predicted_peak_bytes <= 360_000 and saved.regions
    assert len(saved.pareto) == 3
    html = (tmp_path / "r.html").read_text()
    assert "<svg" in html and "Pareto" in html
    assert json.loads((tmp_path / "p.json").read_text())["schema"] == "autockpt.plan"


def test_a_model_built_on_meta_is_planned_for_a_target_without_a_real_step(tmp_path: Path) -> None:
    """Issue 36 item 4: --meta builds the factory's model on the meta device, --target names the device planned for
    (its memory the budget), --device-memory the memory; the plan file and summary say how the plan was made."""
    code, out, _ = run("plan", *MLP, "--meta", "--target", "l4", "--optimizer", "adamw", "--out", str(tmp_path / "p.json"))
    assert code == 0 and re.search(r"^\s*budget\s+24\.000 GB", out, re.MULTILINE)
    saved = autockpt.load_plan(tmp_path / "p.json")
    assert saved.budget_bytes == 24 * 10**9
    assert saved.provenance is not None and saved.provenance.trace == "fake" and saved.provenance.device == "l4"
    code, out, _ = run("estimate", *MLP, "--meta", "--device-memory", "1GB")
    assert code == 0 and "made from: fake trace" in out


@pytest.mark.parametrize("checkpoint", ["recompute_function", "torch_non_reentrant"])
def test_the_checkpoint_flag_reaches_the_plan(tmp_path: Path, checkpoint: str) -> None:
    code, out, _ = run("plan", *MLP, "--budget", "360kB", "--pareto", "0", "--checkpoint", checkpoint,
                       "--out", str(tmp_path / "p.json"))
    assert code == 0 and f"checkpoint={checkpoint}" in out
    assert autockpt.load_plan(tmp_path / "p.json").planned_action.value == checkpoint


def test_sweep_writes_csv_markdown_and_png(tmp_path: Path) -> None:
    code, _out, _ = run("sweep", *MLP, "--budgets", "1kB,360kB,10MB", "--out", str(tmp_path))
    assert code == 0
    rows = (tmp_path / "sweep.csv").read_text().splitlines()
    assert len(rows) == 4 and rows[1].split(",")[2] == "False"  # 1 kB is infeasible
    assert (tmp_path / "pareto.png").stat().st_size > 1000 and "infeasible" in (tmp_path / "sweep.md").read_text()


def test_keyword_inputs_from_a_function() -> None:
    code, out, _ = run("plan", "cli_models:small_mlp", "--inputs", "cli_models:keyword_inputs", "--budget", "600kB",
                       "--pareto", "0")
    assert code == 0 and "kwargs['input']" not in out  # summary, not the fingerprint


def test_python_dash_m_and_the_console_script_run_the_same_cli(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture) -> None:
    """The installed console script (the entry point pip writes the ``autockpt`` script from, under the name the
    script's file gives it; in a pytest process click would name it after pytest's ``-m``) and ``python -m autockpt``
    as Python runs it (``runpy``, ``__main__``), both in this process: a second interpreter would only import torch
    again (the console script in a process of its own: 3.8 s of the suite, issue 46); the few lines pip writes around
    the entry point are pip's."""
    (script,) = entry_points(group="console_scripts", name="autockpt")
    monkeypatch.setattr(sys, "argv", ["autockpt", "--help"])
    with pytest.raises(SystemExit) as exited:
        script.load()(prog_name="autockpt")
    console = capsys.readouterr().out
    assert exited.value.code == 0 and "estimate" in console and "sweep" in console
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("autockpt", run_name="__main__", alter_sys=True)
    assert exited.value.code == 0 and capsys.readouterr().out == console


def test_demo_runs_a_built_in_example() -> None:
    """The budget the demo sets is the fraction asked of the way from the step's static bytes to its unmodified peak,
    and the module it optimizes checkpoints something and keeps it."""
    code, out, _ = run("demo", "--model", "mlp", "--size", "tiny", "--fraction", "0.6")
    assert code == 0 and "within budget" in out
    case = zoo.build("mlp", "tiny")
    planner = autockpt.Planner.from_model(case.model, example_inputs=case.args, example_kwargs=case.kwargs,
                                          loss_fn=case.loss_fn)
    assert f"budget: {format_bytes(budget_at(planner, 0.6))} (60% of the way" in out
    assert re.search(r"recomputed\s+\d+ of \d+ units in [1-9]\d* checkpointed region", out), out


@needs_transformers
def test_a_hugging_face_config_is_planned_on_the_meta_device(tmp_path: Path) -> None:
    """Issue 48, item 6: ``--hf-config`` builds the model from its config alone, on the meta device, in the config's
    dtype, with token ids of --batch x --seq (labels = ids): the estimate is the API's on the same meta model."""
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=1000)
    config.dtype = "bfloat16"
    config.to_json_file(tmp_path / "config.json")
    code, out, _ = run("estimate", "--hf-config", str(tmp_path / "config.json"), "--batch", "2", "--seq", "32",
                       "--optimizer", "adamw", "--depth", "0")
    assert code == 0 and "made from: fake trace" in out
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    ids = torch.randint(0, 1000, (2, 32))
    api = autockpt.estimate(model, example_kwargs={"input_ids": ids, "labels": ids}, optimizer="adamw", depth=0)
    for name, value in api.rows():
        assert re.search(rf"{re.escape(name)}\s+{value:,d} B", out), (name, value, out)
    code, out, _ = run("plan", "--hf-config", str(tmp_path), "--seq", "32", "--budget", "2MB", "--pareto", "0")
    assert code == 0 and "trace: fake" in out
    assert "give MODEL" in one_line_error("estimate", "gpt2", "--hf-config", str(tmp_path))
    assert "give MODEL" in one_line_error("estimate")
    assert "no Hugging Face config there" in one_line_error("estimate", "--hf-config", str(tmp_path / "missing"))
    assert "--batch and --seq size the token ids" in one_line_error("estimate", "gpt2", "--seq", "8")
