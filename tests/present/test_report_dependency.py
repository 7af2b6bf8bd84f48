"""Reports after a plain ``pip install autockpt`` (issue 23): matplotlib is a core dependency, so the HTML report has
its plots; where it cannot be imported anyway (a broken environment) the report is still written and says why."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest
from cli_models import mlp_inputs, small_mlp
from click.testing import CliRunner

import autockpt
from autockpt.present.cli import main
from autockpt.units import format_bytes

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
MISSING = "No plots: matplotlib could not be imported"


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def _core_dependencies() -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: read the one-line `dependencies = [...]` list by hand
        text = PYPROJECT.read_text()
        match = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.MULTILINE | re.DOTALL)
        assert match is not None, "no `dependencies = [...]` in pyproject.toml"
        return re.findall(r"""["']([^"']+)["']""", match.group(1))
    with PYPROJECT.open("rb") as handle:
        return tomllib.load(handle)["project"]["dependencies"]


@pytest.fixture(scope="module")
def plan() -> autockpt.Plan:
    # the CLI tests' small MLP: a plan with regions and a Pareto curve in well under a second once torch is warm
    planner = autockpt.Planner.from_model(small_mlp(), example_inputs=mlp_inputs())
    return planner.plan(budget_bytes=360_000, pareto_points=3)


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib unimportable, whatever this environment has installed: None in sys.modules makes `import` fail
    with ModuleNotFoundError, for the package and every submodule already loaded (monkeypatch puts them back)."""
    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError):
        import matplotlib.figure  # noqa: F401


def test_matplotlib_is_a_core_dependency_not_only_an_extra() -> None:
    # the test extras must not be what brings matplotlib: a plain `pip install autockpt` writes reports with plots
    assert "matplotlib" in _requirement_names(_core_dependencies())


# with matplotlib, the HTML report embeds its two plots inline (timeline and Pareto curve):
# tests/records/test_saved_plans_and_reports.py::test_the_report_timeline_and_tables_match_the_plan


def test_without_matplotlib_the_html_report_is_written_and_says_why(
    plan: autockpt.Plan, tmp_path: Path, no_matplotlib: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="autockpt.present.page"):
        plan.report(tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" not in page and "data:image" not in page
    assert page.count(MISSING) == 1 and "pip install matplotlib" in page  # once, at the top, with the fix
    assert page.count("Plot left out: matplotlib could not be imported") == 2  # timeline and Pareto curve
    assert format_bytes(plan.predicted_peak_bytes) in page and f"Decisions: {len(plan.regions)} regions" in page
    assert page.count("<tr>") > len(plan.regions) + len(plan.pareto)  # the tables are all there
    assert any(MISSING in record.getMessage() for record in caplog.records if record.name == "autockpt.present.page")
    plan.report(tmp_path / "r.md")  # markdown never needed matplotlib
    assert format_bytes(plan.predicted_peak_bytes) in (tmp_path / "r.md").read_text()


def test_without_matplotlib_the_cli_writes_its_report_and_sweep(tmp_path: Path, no_matplotlib: None) -> None:
    model = ["cli_models:small_mlp", "--input", "float32[128,64]"]
    result = CliRunner().invoke(main, ["--quiet", "plan", *model, "--budget", "360kB", "--pareto", "0",
                                       "--report", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output
    assert MISSING in (tmp_path / "r.html").read_text()
    result = CliRunner().invoke(main, ["--quiet", "sweep", *model, "--budgets", "360kB,10MB", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "sweep.csv").exists() and not (tmp_path / "pareto.png").exists()
    assert f"no pareto.png: {MISSING}" in result.stderr
