"""The limits the house keeps (issue 47, item 6), read from the repository: no library module over 550 lines (the cap
is 600: a module this long is split along a seam before it reaches it), no function over 80 lines, and every file
path that the README, ``docs/`` and the library's docstrings name exists. The import map (no circle, nothing below
``core``) is ``tests/core/test_core_imports.py``'s."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "autockpt"
MAX_MODULE_LINES = 550
MAX_FUNCTION_LINES = 80

# a relative path with at least one folder and a file extension, not inside a URL or a longer path
_PATH = re.compile(
    r"(?<![\w./:-])((?:\.\.?/)*(?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]+\.(?:py|md|sh|json|csv|png|toml|txt|html))(?![\w/])"
)
# where a path named in a text may be relative to, besides the text's own folder ("core/simulate.py" in a docstring)
_BASES = ("", "autockpt", "autockpt/core", "experiments", "tests", "docs")
# named on purpose though not in this repository, each with its reason
_ELSEWHERE = {
    "torch/distributed/fsdp/_fully_shard/_fsdp_param.py",  # torch's source, where docs/fsdp.md read a fact
}
# the team's folder beside the checkouts (its page and tools; docs/ARCHITECTURE.md says so): not in a clone
_BESIDE_THE_CHECKOUT = ("shared/", "../shared/")


def _library_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_library_module_is_within_50_lines_of_the_cap() -> None:
    lengths = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in _library_modules()}
    over = {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES}
    assert not over, f"over {MAX_MODULE_LINES} lines (split along a natural seam): {over}"


def test_no_library_function_is_over_80_lines() -> None:
    long = []
    for path in _library_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (make them a few named steps): {long}"


def _texts() -> list[tuple[Path, str]]:
    """The README, every page of docs/ up to its History section (which names what was), and every docstring."""
    texts = [(ROOT / "README.md", (ROOT / "README.md").read_text())]
    for page in sorted((ROOT / "docs").glob("*.md")):
        texts.append((page, page.read_text().split("\n## History\n")[0]))
    for module in _library_modules():
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                docstring = ast.get_docstring(node, clean=False)
                if docstring:
                    texts.append((module, docstring))
    return texts


def test_every_file_path_the_docs_and_docstrings_name_exists() -> None:
    missing = set()
    for source, text in _texts():
        for match in _PATH.finditer(text):
            named = match.group(1)
            if named in _ELSEWHERE or named.startswith(_BESIDE_THE_CHECKOUT):
                continue
            if not any((base / named).exists() for base in (source.parent, *(ROOT / b for b in _BASES))):
                missing.add(f"{source.relative_to(ROOT)}: {named}")
    assert not missing, f"paths named that do not exist (moved or removed?): {sorted(missing)}"


def test_the_path_check_finds_a_missing_path() -> None:
    """The check above is not vacuous: it sees paths in docstrings and misses the ones that are not there."""
    found = [m.group(1) for m in _PATH.finditer("see ``core/no_such_module.py`` and docs/how-it-works.md#x, not a/b")]
    assert found == ["core/no_such_module.py", "docs/how-it-works.md"]
    assert not any((ROOT / b / found[0]).exists() for b in _BASES)
    assert any((ROOT / b / found[1]).exists() for b in _BASES)
