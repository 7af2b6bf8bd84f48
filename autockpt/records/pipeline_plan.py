"""``PipelinePlan``: what ``plan_pipeline`` decided (``record_types.PipelineRecord``: the split, each stage's plan
and predictions) with the methods a person calls on it; ``load_pipeline_plan`` reads its file (``codec.py``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from autockpt.record_types import PipelineRecord
from autockpt.records import codec
from autockpt.records.plan import Plan, presentation_writer
from autockpt.types import Placement, Stage
from autockpt.units import format_bytes


@dataclass(frozen=True, kw_only=True, slots=True, repr=False)
class PipelinePlan(PipelineRecord):
    """What ``plan_pipeline`` decided (``record_types.PipelineRecord``) with the methods a person calls on it."""

    # the stages' plans are Plans (records with their methods): a plan file reads them back as such
    stage_plans: tuple[Plan, ...]

    @property
    def placement(self) -> Placement:
        """Where each part of the step runs: one stage of units per pipeline rank (``rank i`` runs stage i)."""
        return Placement(stages=tuple(
            Stage(first_unit=stage.first_unit, last_unit=stage.last_unit, device=f"rank {stage.index}")
            for stage in self.stages
        ))

    def summary(self) -> str:
        lines = [(
            f"pipeline plan ({self.strategy}): {self.num_stages} stages, {self.microbatches} microbatches, "
            f"schedule {self.schedule.value}; predicted step {self.predicted_step_ms:.2f} ms "
            f"(link priced at {self.link_gb_per_s:.1f} GB/s)"
        )]
        for stage, the_plan in zip(self.stages, self.stage_plans):
            modules = ", ".join(stage.module_paths[:4]) + (" ..." if len(stage.module_paths) > 4 else "")
            lines.append(
                f"  stage {stage.index}: units {stage.first_unit}-{stage.last_unit} ({modules}); parameters "
                f"{format_bytes(stage.parameter_bytes)}; budget {format_bytes(stage.budget_bytes)}; predicted peak "
                f"{format_bytes(stage.predicted_peak_bytes)} ({stage.microbatches_in_flight} microbatches in flight x "
                f"{format_bytes(stage.retained_bytes)} kept for backward, schedule buffers "
                f"{format_bytes(stage.schedule_buffer_bytes)}); {len(the_plan.regions)} regions recomputed; "
                + (f"the loss in chunks of {the_plan.loss_chunk_tokens} tokens; " if the_plan.loss_chunk_tokens else "")
                + f"{stage.predicted_microbatch_ms:.2f} ms per microbatch"
            )
        if self.provenance is not None:
            lines.append(f"  made from: {self.provenance.describe()} (every stage alike)")
        for shared in self.shared_parameters:
            lines.append(
                f"  parameter {shared.name} ({format_bytes(shared.nbytes)}) is held by stages "
                f"{', '.join(map(str, shared.stages))}: its gradients are summed across them after each step"
            )
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON (no pickle); ``autockpt.load_pipeline_plan`` reads it back."""
        codec.save_record(self, path, codec.PIPELINE_SCHEMA)

    def report(self, path: str | os.PathLike[str]) -> None:
        """Write a self-contained report: HTML when ``path`` ends in .html/.htm (one memory timeline per stage and
        the schedule's chart), markdown otherwise."""
        presentation_writer("autockpt.present.pipeline_report:write_pipeline_report")(self, path)

    def __repr__(self) -> str:
        return (
            f"PipelinePlan(strategy={self.strategy!r}, cuts={self.cuts}, schedule={self.schedule.value}, "
            f"predicted_step_ms={self.predicted_step_ms:.2f}, predicted_peaks="
            f"{[s.predicted_peak_bytes for s in self.stages]})"
        )


def load_pipeline_plan(path: str | os.PathLike[str]) -> PipelinePlan:
    """Read a plan written by ``PipelinePlan.save``."""
    return codec.read_record(path, PipelinePlan, codec.PIPELINE_SCHEMA)
