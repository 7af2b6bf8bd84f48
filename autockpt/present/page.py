"""The parts every autockpt page shares: the HTML/markdown writer, tables, inline SVG figures, the style sheet,
and what a page says when matplotlib cannot be imported."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable
from html import escape as html_escape
from pathlib import Path
from typing import Any

_LOG = logging.getLogger(__name__)

MEMORY_CATEGORIES = (  # (MemoryCurve field, label, colour)
    ("parameter_bytes", "parameters, buffers, inputs", "#4c72b0"),
    ("gradient_bytes", "gradients", "#55a868"),
    ("activation_bytes", "activations (forward tensors alive)", "#dd8452"),
    ("recomputed_bytes", "recomputed", "#c44e52"),
    ("temporary_bytes", "temporaries", "#8c8c8c"),
)



def write_page(path: str | os.PathLike[str], html: Callable[[], str], markdown: Callable[[], str]) -> None:
    """Write ``html()`` when ``path`` ends in .html/.htm, else ``markdown()``."""
    target = Path(path)
    target.write_text(html() if target.suffix.lower() in (".html", ".htm") else markdown())



def matplotlib_import_error() -> str | None:
    """Why matplotlib cannot be imported here, or None when it can. matplotlib is a dependency of autockpt, so this is
    a broken or partial environment: the report (and a sweep) is still written, without plots, instead of failing
    after the plan was solved."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError as error:  # also a broken install: a missing shared library, a numpy ABI mismatch
        return str(error) or type(error).__name__
    return None



def plots_missing_text(reason: str) -> str:
    """One sentence for a page or a terminal: plots are missing, why, and the fix."""
    return (f"No plots: matplotlib could not be imported ({reason}). It is a dependency of autockpt, so this "
            "environment is incomplete: pip install matplotlib (or reinstall autockpt) and run again.")



def plot_notices() -> tuple[list[str], str]:
    """For an HTML page: the note at its top and the text in place of each plot when matplotlib cannot be imported
    (a warning is logged), else nothing."""
    missing = matplotlib_import_error()
    if missing is None:
        return [], ""
    _LOG.warning("%s", plots_missing_text(missing))
    return (
        [f"<p class='missing'>{html_escape(plots_missing_text(missing))}</p>"],
        "<p class='missing'>Plot left out: matplotlib could not be imported (see the note at the top).</p>",
    )



def figure_svg(figure: Any) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg")
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and doctype: the SVG sits inside the HTML page



def axis_scale(top_bytes: float) -> tuple[float, str]:
    """The unit a plot's byte axis is drawn in for values up to ``top_bytes``: (bytes per unit, its label)."""
    for size, name, power in ((10**9, "GB", 9), (10**6, "MB", 6), (10**3, "kB", 3)):
        if top_bytes >= size:
            return float(size), f"{name} (10^{power} bytes)"
    return 1.0, "bytes"


def md_table(header: list[str], rows: list[tuple[str, ...]]) -> list[str]:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines



def html_table(
    columns: list[str], rows: list[tuple[str, ...]], *, show_header: bool = True, css: str = "", escape: bool = True
) -> str:
    """A table; cells are escaped unless ``escape`` is False (the caller escaped them and added markup)."""
    clean = html_escape if escape else (lambda text: text)
    head = "<tr>" + "".join(f"<th>{html_escape(c)}</th>" for c in columns) + "</tr>" if show_header else ""
    body = "".join("<tr>" + "".join(f"<td>{clean(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table class='{css}'>{head}{body}</table>"



REPORT_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2em auto; max-width: 1100px;
       color: #222; line-height: 1.4; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { font-size: 1.2em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
td:not(:first-child) { font-variant-numeric: tabular-nums; }
th { background: #f3f3f3; }
table.summary td:first-child { font-weight: 600; background: #fafafa; }
figure { margin: 0.5em 0; } figure svg { max-width: 100%; height: auto; }
.units { color: #555; font-size: 0.9em; }
.missing { background: #fff3cd; border: 1px solid #e0c36c; padding: 0.5em 0.8em; }
"""
