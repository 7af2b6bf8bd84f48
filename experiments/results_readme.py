"""Keep ``experiments/results/README.md`` current: each experiment script rewrites its own section when it runs.

A section is the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` (HTML comments, invisible when the
markdown is rendered); everything outside the markers (the dated, hand-written reading of the results) is left as it
is. A script calls it where it writes its own markdown::

    from results_readme import write_section
    write_section("bench_checkpoint", text, output=out)

``output`` is the file or folder the script just wrote: a run whose output went elsewhere (``--out /tmp/x``) leaves
the README alone, so trial runs do not overwrite the recorded results.
"""

from __future__ import annotations

import csv
import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESULTS_README = RESULTS_DIR / "README.md"


def _markers(name: str) -> tuple[str, str]:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"section name {name!r}: use letters, digits, '_', '-' or '.'")
    return f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"


def write_section(name: str, markdown: str, *, readme: Path | str = RESULTS_README,
                  output: Path | str | None = None) -> bool:
    """Replace the text between ``name``'s markers in ``readme`` with ``markdown``, or append the section (a
    ``## name`` heading and the markers) at the end when the file has no such markers; the rest of the file is kept
    byte for byte. With ``output``, only when that path lies inside ``readme``'s folder. Returns whether the file was
    written. A BEGIN marker without its END, or a marker that appears twice, raises ``ValueError``."""
    readme = Path(readme)
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
    readme.write_text(text)
    return True


def write_csv(path: Path | str, rows: Sequence[Any]) -> None:
    """``rows`` (dataclass instances of one type) as CSV, one column per field, a header first."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[f.name for f in dataclasses.fields(rows[0])])
        writer.writeheader()
        writer.writerows(dataclasses.asdict(r) for r in rows)
