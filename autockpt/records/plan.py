"""Plan: the record of what autockpt decided (``record_types.PlanRecord``) with the methods a person calls on it.

It sits above the modules that format and store plans (``summary.py``, ``codec.py``), which read the record and never
import this module; the stages build ``Plan`` values and pass them on without calling these methods. The HTML report
is the presentation layer's (``present/report.py``, matplotlib): ``report()`` finds its writer by name when called
(``presentation_writer``), so no record imports presentation code.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autockpt.record_types import PlanRecord
from autockpt.records import codec, summary

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
        codec.save_record(self, path, codec.PLAN_SCHEMA)

    def report(self, path: str | os.PathLike[str], *, depth: int = 2) -> None:
        """Write a self-contained report: HTML when ``path`` ends in .html/.htm, markdown otherwise."""
        presentation_writer("autockpt.present.report:write_report")(self, path, depth=depth)


def presentation_writer(qualified_name: str) -> Callable[..., Any]:
    """The presentation layer's function ``"module:function"``, imported when a report is asked for (it loads
    matplotlib), by name so that the records layer does not depend on the layer that reads it."""
    module, _, function = qualified_name.partition(":")
    return getattr(importlib.import_module(module), function)


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan written by ``Plan.save`` (or ``autockpt plan --out``), of any schema version since 1."""
    return codec.read_record(path, Plan, codec.PLAN_SCHEMA)
