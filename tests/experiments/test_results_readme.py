"""experiments/results_readme.write_section: a script rewrites its own section of the results log and nothing else."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "experiments"))
from results_readme import RESULTS_README, write_section

LOG = """# Results

Hand-written reading, dated.

<!-- BEGIN sweep -->

| old | table |
|---|---|
| 1 | 2 |

<!-- END sweep -->

More prose that stays.

<!-- BEGIN bench_scale -->

kept as is

<!-- END bench_scale -->
"""


def test_replaces_an_existing_section_and_leaves_the_rest_untouched(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(LOG)
    assert write_section("sweep", "| new | table |\n|---|---|\n| 3 | 4 |\n", readme=readme)
    expected = LOG.replace("| old | table |\n|---|---|\n| 1 | 2 |", "| new | table |\n|---|---|\n| 3 | 4 |")
    assert readme.read_text() == expected
    write_section("sweep", "| new | table |\n|---|---|\n| 3 | 4 |", readme=readme)  # same again: no drift
    assert readme.read_text() == expected


def test_adds_a_missing_section_at_the_end(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(LOG)
    write_section("bench_checkpoint", "Command: `x`\n\n| a |\n|---|\n| 1 |", readme=readme)
    text = readme.read_text()
    assert text.startswith(LOG)
    assert text[len(LOG):] == (
        "\n## bench_checkpoint\n\n<!-- BEGIN bench_checkpoint -->\n\nCommand: `x`\n\n| a |\n|---|\n| 1 |\n\n"
        "<!-- END bench_checkpoint -->\n"
    )
    write_section("bench_checkpoint", "| b |", readme=readme)  # from now on it is replaced in place
    assert readme.read_text().count("<!-- BEGIN bench_checkpoint -->") == 1 and "| b |" in readme.read_text()
    assert readme.read_text().startswith(LOG)


def test_creates_the_file_when_missing(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    write_section("sweep", "text", readme=readme)
    assert readme.read_text() == "## sweep\n\n<!-- BEGIN sweep -->\n\ntext\n\n<!-- END sweep -->\n"


def test_output_elsewhere_leaves_the_readme_alone(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    readme = results / "README.md"
    readme.write_text(LOG)
    assert not write_section("sweep", "trial run", readme=readme, output=tmp_path / "elsewhere" / "sweep")
    assert readme.read_text() == LOG
    assert write_section("sweep", "real run", readme=readme, output=results / "sweep")
    assert "real run" in readme.read_text()


def test_broken_markers_raise(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("<!-- BEGIN sweep -->\nno end\n")
    with pytest.raises(ValueError, match="without"):
        write_section("sweep", "x", readme=readme)
    readme.write_text(LOG + LOG)
    with pytest.raises(ValueError, match="appears 2 times"):
        write_section("sweep", "x", readme=readme)
    with pytest.raises(ValueError, match="section name"):
        write_section("two words", "x", readme=readme)


def test_the_results_log_has_each_scripts_section_once() -> None:
    text = RESULTS_README.read_text()
    for name in ("sweep", "sweep_cuda", "bench_budget_gpt2", "bench_budget_small", "bench_target1_bound",
                 "bench_checkpoint", "bench_optimality", "bench_optimality_measured", "bench_scale"):
        assert text.count(f"<!-- BEGIN {name} -->") == 1 and text.count(f"<!-- END {name} -->") == 1, name
        assert text.index(f"<!-- BEGIN {name} -->") < text.index(f"<!-- END {name} -->"), name
