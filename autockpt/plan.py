"""Plan: the record of what autockpt decided (``types.PlanRecord``) with the methods a person calls on it.

It sits above the modules that format and store plans (``summary.py``, ``plan_io.py``, ``report.py``), which read the
record and never import this module; the stages build ``Plan`` values and pass them on without calling these methods.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autockpt import plan_io, summary
from autockpt.types import PlanRecord

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True, kw_only=True, slots=True, repr=False)  # PlanRecord.__repr__: the short one
class Plan(PlanRecord):
    """What autockpt decided for one model, inputs and budget, with its predictions. It *has* a policy
    (``Plan.policy``: per region an action, and the placement), which is all the rewriter reads.

    Bytes are exact integers; ``summary()`` prints them in GB (10^9 bytes) and GiB (2^30 bytes).
    """

    def summary(self) -> str:
        return summary.plan_summary(self)

    def to_dataframe(self) -> pd.DataFrame:
        return summary.plan_dataframe(self)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON (schema-versioned, no pickle); ``autockpt.load_plan`` reads it back."""
        plan_io.save_plan(self, path)

    def report(self, path: str | os.PathLike[str], *, depth: int = 2) -> None:
        """Write a self-contained report: HTML when ``path`` ends in .html/.htm, markdown otherwise."""
        from autockpt.report import write_report  # the presentation layer (matplotlib), loaded when asked for

        write_report(self, path, depth=depth)


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan written by ``Plan.save`` (or ``autockpt plan --out``); schema versions 1 and 2."""
    return plan_io.read_plan(path, Plan)
