"""What core may import (issue 35, item 1), read from the source with ``ast``.

``autockpt.core`` (simulator, offload model, structure, solvers) sits at the top of the pipeline: it works on the
values of ``types.py`` and imports torch only inside the functions that need it, and nothing of the packages below it
(measure, runtime, planning, pipeline, records, present), not even inside a function. The length limits are
``tests/house/test_limits.py``'s.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "autockpt"  # the source beside these tests, wherever it is installed
CORE = PACKAGE / "core"
BELOW_CORE = ("runtime", "measure", "planning", "pipeline", "fsdp", "present", "records")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Full names of what ``node`` imports (``from a import b`` gives ``a`` and ``a.b``: b may be a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _load_time_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: anywhere but inside a function or an ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    for statement in body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(statement, ast.If) and _is_type_checking(statement):
            found += _load_time_imports(statement.orelse)
            continue
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            found.append(statement)
        for field in ("body", "orelse", "finalbody"):  # class bodies, if/try/with/for/while blocks
            found += _load_time_imports(getattr(statement, field, []))
        for clause in [*getattr(statement, "handlers", []), *getattr(statement, "cases", [])]:  # except, match case
            found += _load_time_imports(clause.body)
    return found


def core_import_problems(source: str, module: str, is_package: bool = False) -> list[str]:
    """What ``source`` (the module ``module`` of core) imports that core must not."""
    tree = ast.parse(source)
    problems = []
    for node in _load_time_imports(tree.body):
        for name in _imported(node, module, is_package):
            if name == "torch" or name.startswith("torch."):
                problems.append(f"{module}:{node.lineno}: imports {name} when loaded (import it inside the function)")
                break
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in _imported(node, module, is_package):
                below = [p for p in BELOW_CORE if name == f"autockpt.{p}" or name.startswith(f"autockpt.{p}.")]
                if below:
                    problems.append(f"{module}:{node.lineno}: imports {name} (core imports nothing of {below[0]})")
                    break
    return problems


def test_core_imports_no_torch_when_loaded_and_nothing_below_it() -> None:
    paths = sorted(CORE.rglob("*.py"))
    assert len(paths) > 10, paths  # the scan sees the package
    problems = [
        problem
        for path in paths
        for problem in core_import_problems(path.read_text(), _module_name(path), path.name == "__init__.py")
    ]
    assert not problems, "\n".join(problems)


def test_the_scan_finds_each_kind_of_forbidden_import() -> None:
    module = "autockpt.core.solve.some"
    forbidden = [
        "import torch",
        "from torch import nn",
        "import torch.nn.functional as F",
        "class A:\n    import torch",
        "try:\n    import torch\nexcept ImportError:\n    pass",
        "if TYPE_CHECKING:\n    pass\nelse:\n    import torch",
        "from autockpt.runtime.rewrite import x",
        "from autockpt import measure",
        "import autockpt.planning.api",
        "def f():\n    from autockpt.present import report",
        "if TYPE_CHECKING:\n    from autockpt.records.plan import Plan",
        "from ...records import plan",
        "from ...pipeline.plan import x",
    ]
    for source in forbidden:
        assert core_import_problems(source, module), source
    allowed = [
        "def f():\n    import torch",
        "if TYPE_CHECKING:\n    import torch",
        "from autockpt.types import Action",
        "from autockpt.record_types import PlanRecord",
        "from autockpt.core.simulate import simulate",
        "from ..simulate import simulate",
        "import numpy as np",
    ]
    for source in allowed:
        assert not core_import_problems(source, module), source


def test_the_architecture_page_names_every_module() -> None:
    """docs/ARCHITECTURE.md lists every module with one line: a module added without its line fails here."""
    page = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    modules = [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    unnamed = sorted(str(m) for m in modules if f"`{m.name}`" not in page)
    assert not unnamed, f"docs/ARCHITECTURE.md names no line for {unnamed}"
