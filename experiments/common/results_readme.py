"""Each results folder's README is written by its script: a script rewrites its own section of it when it runs.

A section is the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` (HTML comments, invisible when the
markdown is rendered); everything outside the markers is left as it is. A script calls it where it writes its own
markdown, with the folder (or file) it just wrote::

    from experiments.common.results_readme import write_section
    write_section("bench_checkpoint", text, output=out)

which rewrites ``out/README.md`` (``output``'s folder when ``output`` is a file). A trial run (``--out /tmp/x``)
writes its README there, beside its own CSVs, and leaves the recorded results alone. The index of the recorded
results is ``experiments/results/README.md``, kept by hand; no script writes it. The dated, hand-written reading of
earlier runs is ``experiments/results/HISTORY.md``, which no script writes either.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "experiments" / "results"
RESULTS_INDEX = RESULTS_DIR / "README.md"
RESULTS_HISTORY = RESULTS_DIR / "HISTORY.md"


def _markers(name: str) -> tuple[str, str]:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"section name {name!r}: use letters, digits, '_', '-' or '.'")
    return f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"


def folder_readme(output: Path | str) -> Path:
    """The README a script's section goes to: ``output``'s own when it is a folder (or has no suffix: a folder not
    made yet), else the README of the folder ``output`` (a file) lies in."""
    output = Path(output)
    folder = output if output.is_dir() or not output.suffix else output.parent
    return folder / "README.md"


def write_section(name: str, markdown: str, *, readme: Path | str | None = None,
                  output: Path | str | None = None) -> bool:
    """Replace the text between ``name``'s markers in ``readme`` with ``markdown``, or append the section (a
    ``## name`` heading and the markers) at the end when the file has no such markers; the rest of the file is kept
    byte for byte. Without ``readme``, the README of ``output``'s folder (``folder_readme``): one of the two is
    needed. With both, only when ``output`` lies inside ``readme``'s folder. Returns whether the file was written.
    A BEGIN marker without its END, a marker that appears twice, or the results index or history as ``readme`` (both
    kept by hand: give a results folder as ``--out``) raises ``ValueError``."""
    if readme is None:
        if output is None:
            raise ValueError("write_section needs readme= or output=")
        readme = folder_readme(output)
    readme = Path(readme)
    if readme.resolve() in (RESULTS_INDEX, RESULTS_HISTORY):
        raise ValueError(f"{readme} is kept by hand: write into a results folder (--out experiments/results/<folder>)")
    if output is not None and not Path(output).resolve().is_relative_to(readme.resolve().parent):
        return False
    begin, end = _markers(name)
    body = markdown.strip("\n")
    text = readme.read_text() if readme.exists() else ""
    for marker in (begin, end):
        if text.count(marker) > 1:
            raise ValueError(f"{readme}: {marker} appears {text.count(marker)} times")
    start = text.find(begin)
    if start < 0:
        if end in text:
            raise ValueError(f"{readme}: {end} without {begin}")
        if text:
            text += "\n" if text.endswith("\n") else "\n\n"  # one blank line before the new section
        text += f"## {name}\n\n{begin}\n\n{body}\n\n{end}\n"
    else:
        stop = text.find(end, start)
        if stop < 0:
            raise ValueError(f"{readme}: {begin} without {end} after it")
        text = text[: start + len(begin)] + f"\n\n{body}\n\n" + text[stop:]
    readme.parent.mkdir(parents=True, exist_ok=True)
    readme.write_text(text)
    return True


def write_csv(path: Path | str, rows: Sequence[Any]) -> None:
    """``rows`` (dataclass instances of one type) as CSV, one column per field, a header first."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[f.name for f in dataclasses.fields(rows[0])])
        writer.writeheader()
        writer.writerows(dataclasses.asdict(r) for r in rows)


def markdown_table(table: Any) -> str:
    """A pandas DataFrame as a markdown table: floats to 3 decimals, whole floats of 1 or more as integers, NaN empty."""
    def cell(value: object) -> str:
        if isinstance(value, float):
            if math.isnan(value):
                return ""
            return str(int(value)) if value.is_integer() and abs(value) >= 1 else f"{value:.3f}"
        return str(value)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)

