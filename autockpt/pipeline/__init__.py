"""Pipeline stages: ``plan_pipeline`` (``plan.py``) splits a model across devices and plans each stage;
``PipelinePlanner`` answers several budgets from one capture and profile; ``run.py`` runs a plan on
``torch.distributed.pipelining``."""

from __future__ import annotations

from autockpt.pipeline.plan import PipelinePlanner

__all__ = ["PipelinePlanner"]
