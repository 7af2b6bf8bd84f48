"""experiments/common/results_readme.write_section: a script rewrites its own section of its results folder's README
and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.common.results_readme import RESULTS_DIR, RESULTS_INDEX, folder_readme, write_section

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


def test_without_a_readme_the_section_goes_to_the_output_folders_own(tmp_path: Path) -> None:
    assert folder_readme(tmp_path / "sweep") == tmp_path / "sweep" / "README.md"  # a folder not made yet
    assert folder_readme(tmp_path / "budget" / "bench_budget_small.csv") == tmp_path / "budget" / "README.md"
    assert write_section("sweep", "trial run", output=tmp_path / "sweep")
    assert (tmp_path / "sweep" / "README.md").read_text() == (
        "## sweep\n\n<!-- BEGIN sweep -->\n\ntrial run\n\n<!-- END sweep -->\n"
    )
    with pytest.raises(ValueError, match="readme= or output="):
        write_section("sweep", "x")
    with pytest.raises(ValueError, match="kept by hand"):  # --out experiments/results: the index, not a folder
        write_section("sweep", "x", output=RESULTS_DIR)


# each script's section -> the results folder (under experiments/results) whose README it is written into
SECTIONS = {
    "sweep": "sweep", "sweep_cuda": "sweep_cuda", "sweep_hf_peak": "sweep_hf_peak",
    "bench_budget_gpt2": "budget", "bench_budget_small": "budget",
    "bench_target1_bound": "target1_bound", "bench_checkpoint": "checkpoint_kinds",
    "bench_optimality": "optimality", "bench_optimality_measured": "optimality",
    "bench_scale": "scale", "bench_scale_llama": "scale", "bench_scale_real": "scale",
    "bench_offload_cpu": "offload_bench_cpu", "bench_offload_cuda": "offload_bench_cuda",
    "offload_runtime_cuda": "offload_cuda", "bench_min_feasible": "min_feasible", "bench_loop": "loop",
    "bench_autocast": "autocast", "probe_dynamo_segments": "dynamo_segments", "bench_pipeline": "pipeline",
    "bench_compile": "compile", "bench_cuda_prediction": "cuda_prediction", "bench_roofline": "roofline",
    "bench_fsdp": "fsdp", "bench_output_loop": "output_loop",
}


def test_each_results_folder_readme_has_its_scripts_sections_once() -> None:
    for name, folder in SECTIONS.items():
        text = (RESULTS_DIR / folder / "README.md").read_text()
        assert text.count(f"<!-- BEGIN {name} -->") == 1 and text.count(f"<!-- END {name} -->") == 1, name
        assert text.index(f"<!-- BEGIN {name} -->") < text.index(f"<!-- END {name} -->"), name


def test_the_results_index_names_every_results_folder_and_no_script_writes_it() -> None:
    index = RESULTS_INDEX.read_text()
    assert "<!-- BEGIN" not in index
    for path in sorted(RESULTS_DIR.iterdir()):
        if path.name not in ("README.md", "HISTORY.md", "tmp"):
            link = f"]({path.name}/" if path.is_dir() else f"]({path.name})"
            assert link in index, f"experiments/results/README.md has no row linking {path.name}"
