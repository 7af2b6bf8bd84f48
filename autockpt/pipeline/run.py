"""Running a pipeline plan on ``torch.distributed.pipelining``, on every rank (under torchrun).

    schedule = autockpt.pipeline_schedule(model, pplan, rank=rank, device=device, loss_fn=loss_fn)
    schedule.step(batch, target=target, losses=losses)   # on rank 0 the inputs, on the last rank the target

Each rank captures the model again (on inputs rebuilt from what the plan records), checks it against the plan's
fingerprint, cuts out its own stage (``stage_graphs.py``), applies the stage's recompute plan (``api.apply_plan``)
and wraps it in a ``PipelineStage``. The stage module holds the model's own ``Parameter`` objects under their
original names: ``stage.submod.parameters()`` are what this rank's optimizer steps. A parameter held by several
stages (tied weights) has its gradient summed across them at the end of every ``step``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from autockpt.errors import PlanMismatchError
from autockpt.measure.capture import capture
from autockpt.pipeline.last_stage import ReceivedAsOutput, StageWithLoss
from autockpt.pipeline.stage_graphs import build_stage_graphs
from autockpt.planning.api import apply_plan
from autockpt.records.fingerprint import model_fingerprint
from autockpt.records.pipeline_plan import PipelinePlan
from autockpt.records.plan_inputs import recorded_inputs
from autockpt.runtime.model_state import enter_training_modes, preserved_model_state
from autockpt.types import PipelineSchedule

logger = logging.getLogger(__name__)

_SCHEDULES = {PipelineSchedule.ONE_F_ONE_B: Schedule1F1B, PipelineSchedule.GPIPE: ScheduleGPipe}


def pipeline_schedule(
    model: nn.Module,
    pplan: PipelinePlan,
    *,
    rank: int,
    device: torch.device | str,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    group: dist.ProcessGroup | None = None,
) -> Schedule1F1B | ScheduleGPipe:
    """This rank's schedule for ``pplan`` (``rank`` runs stage ``rank`` of the group). Call it on every rank, in
    the same order, after ``torch.distributed.init_process_group``."""
    if not isinstance(pplan, PipelinePlan):
        raise TypeError(f"pplan must be an autockpt.PipelinePlan (autockpt.load_pipeline_plan), got {type(pplan).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first (torchrun sets the environment)")
    world = dist.get_world_size(group)
    if world != pplan.num_stages:
        raise ValueError(
            f"the plan has {pplan.num_stages} stages but the process group has {world} ranks; run one rank per stage "
            f"(torchrun --nproc-per-node {pplan.num_stages}) or plan for {world} stages"
        )
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
    device = torch.device(device)
    stage_module = stage_module_for(model, pplan, rank, loss_fn=loss_fn)
    stage_module.to(device)
    stage = PipelineStage(stage_module, rank, pplan.num_stages, device, group=group)
    if isinstance(stage_module, ReceivedAsOutput):  # the last stage planned with its loss: the loss runs it
        loss_fn = stage_module.loss
    schedule_class = _SCHEDULES[pplan.schedule]
    tied = _tied_gradient_groups(model, pplan, rank, stage_module, group)
    if tied:
        schedule_class = type(f"{schedule_class.__name__}WithTiedGradients", (_SumsTiedGradients, schedule_class), {})
    schedule = schedule_class(stage, pplan.microbatches, loss_fn=loss_fn)
    if tied:
        schedule._autockpt_tied = tied  # type: ignore[attr-defined]
    return schedule


def stage_module_for(
    model: nn.Module, pplan: PipelinePlan, index: int, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> nn.Module:
    """Stage ``index`` of the plan as a module running its recompute plan, sharing ``model``'s parameters. A last
    stage planned with its loss (``PipelineStageRecord.with_loss``) is a ``ReceivedAsOutput`` holding the stage and
    ``loss_fn`` under their plan; its ``loss`` is the schedule's loss function."""
    with_loss = pplan.stages[index].with_loss
    if with_loss and not callable(loss_fn):
        raise TypeError(
            f"stage {index} of this plan was planned with the loss function (its loss may run in chunks): give the "
            "loss_fn the plan was made with"
        )
    args, kwargs = recorded_inputs(model, pplan)  # type: ignore[arg-type]  # reads only .fingerprint
    with preserved_model_state(model, args, kwargs):
        enter_training_modes(model)
        graph = capture(model, args, kwargs)
        found = model_fingerprint(model, graph, args, kwargs)
        if found.graph_digest != pplan.fingerprint.graph_digest or found.parameters != pplan.fingerprint.parameters:
            raise PlanMismatchError(
                f"this pipeline plan was made for another model: plan {pplan.fingerprint.model_class} with "
                f"{pplan.fingerprint.num_units} units and {len(pplan.fingerprint.parameters)} parameters, here "
                f"{found.model_class} with {found.num_units} units and {len(found.parameters)} parameters; plan it "
                "again with autockpt.plan_pipeline"
            )
        stages = build_stage_graphs(graph, pplan.cuts)
    if with_loss:
        assert loss_fn is not None
        stage, stage_plan = stages[index].module, pplan.stage_plans[index]
        with_loss_module = StageWithLoss(stage, loss_fn)
        # a target traced on fakes (a meta model planned) has no recorded range: zeros, only captured on
        args, kwargs = recorded_inputs(with_loss_module, stage_plan, unranged_as_zeros=True)
        return ReceivedAsOutput(stage, apply_plan(with_loss_module, stage_plan, example_inputs=args,
                                                  example_kwargs=kwargs))
    return apply_plan(stages[index].module, pplan.stage_plans[index])


class _SumsTiedGradients:
    """Mixed into a pipelining schedule: after ``step``, the gradients of parameters several stages hold are summed
    across those ranks (each rank's loss reaches them through its own stage only)."""

    _autockpt_tied: list[tuple[torch.nn.Parameter, dist.ProcessGroup]]

    def step(self, *args: Any, **kwargs: Any) -> Any:
        result = super().step(*args, **kwargs)  # type: ignore[misc]
        for parameter, group in self._autockpt_tied:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(parameter.grad, group=group)
        return result


def _tied_gradient_groups(
    model: nn.Module, pplan: PipelinePlan, rank: int, stage_module: nn.Module, group: dist.ProcessGroup | None
) -> list[tuple[torch.nn.Parameter, dist.ProcessGroup]]:
    """Per parameter held by several stages, this rank's copy and a process group of the ranks holding it. Every
    rank creates every group (``new_group`` is collective), in the plan's order."""
    ranks_of = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    mine = {name: p for name, p in stage_module.named_parameters(remove_duplicate=False)}
    found = []
    for shared in pplan.shared_parameters:
        holders = [ranks_of[s] for s in shared.stages]
        tied_group = dist.new_group(holders)
        if rank in shared.stages:
            parameter = _parameter_named(mine, model, shared.name)
            found.append((parameter, tied_group))
    return found


def _parameter_named(mine: dict[str, torch.nn.Parameter], model: nn.Module, name: str) -> torch.nn.Parameter:
    """This stage's copy of a shared parameter: by its name here, else the model's parameter of that name (the
    same object under another name in this stage: a tied embedding seen from the head)."""
    if name in mine:
        return mine[name]
    wanted = dict(model.named_parameters(remove_duplicate=False)).get(name)
    for parameter in mine.values():
        if parameter is wanted:
            return parameter
    raise PlanMismatchError(f"the plan says this stage holds parameter {name!r}, but its stage module does not")


