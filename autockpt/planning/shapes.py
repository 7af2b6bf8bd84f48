"""Shapes: a step whose inputs are no larger than the example's runs under the same plan, captured at its shapes.

A captured graph (export in particular) is specialised to the example's shapes, so a batch padded to another
sequence length cannot run through it. Running the original model instead would be an unplanned step, over the budget
by the whole saved activations. Here such a call is captured again at its own shapes (under ``torch.no_grad``,
leaving the model as it was), checked to have the planned graph's units in the same order, and rewritten with the
plan's policy; the result is cached per input signature (least recently used first out). The same regions on smaller
tensors keep less alive, so the planned budget holds.

Only a call with a tensor *larger* than the example's (or of another dtype, rank or device, or other non-tensor
values) gets no variant: the optimized module then warns once with the numbers, or raises ``UnplannedStepError`` in
strict mode.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import enum
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autockpt.measure.chunked_tail import captured_program
from autockpt.record_types import PlanRecord
from autockpt.runtime.call_form import CallForm, input_signature
from autockpt.runtime.model_state import preserved_model_state
from autockpt.runtime.offload import HostPool
from autockpt.runtime.rewrite import OptimizedModule, rewrite
from autockpt.types import CaptureKind, Graph, Placement, Policy, Region, RegionAction, Unit

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHAPES = 16  # variants kept per optimized module: each holds one captured graph


class InputFit(enum.Enum):
    """How a call's inputs compare with the example's."""

    WITHIN = "within"  # every tensor no larger in any dimension, the rest equal: the plan runs at these shapes
    LARGER = "larger"  # some tensor is larger than the example's: the plan's budget does not cover it
    OTHER = "other"  # another dtype, rank, device, structure or non-tensor value: not what the plan was made for


@dataclasses.dataclass(frozen=True, slots=True)
class InputComparison:
    fit: InputFit
    detail: str  # for messages: which input differs and how ("" when within)


@dataclasses.dataclass(frozen=True, slots=True)
class ShapeVariant:
    """One input signature the plan was applied at: its module and what capturing and rewriting it cost."""

    description: str  # the call's tensor shapes, for messages
    module: OptimizedModule
    seconds: float


def compare_inputs(call_form: CallForm, example: tuple[tuple, dict], args: tuple, kwargs: dict) -> InputComparison:
    """Compare a call with the example, argument by argument (by parameter name when the forward has a signature).

    An argument the example did not pass is within when its tensors hold at most one element (a loop's
    ``num_items_in_batch``, a loss scale): it changes no activation's size.
    """
    expected = call_form.named_values(*example)
    given = call_form.named_values(args, kwargs)
    if expected is None or given is None:
        return _compare_values("the inputs", example, (args, kwargs))
    for name, value in given.items():
        if name in expected:
            found = _compare_values(name, expected[name], value)
            if found.fit is not InputFit.WITHIN:
                return found
        elif any(isinstance(leaf, torch.Tensor) and leaf.numel() > 1 for leaf in pytree.tree_leaves(value)):
            return InputComparison(InputFit.OTHER, f"{name} was not in the example inputs")
    # an argument the example passed at its default may be left out
    missing = [name for name in expected if name not in given and not call_form.is_default(name, expected[name])]
    if missing:
        return InputComparison(InputFit.OTHER, f"{', '.join(missing)} not given (the example passed them)")
    return InputComparison(InputFit.WITHIN, "")


def describe_shapes(args: tuple, kwargs: dict) -> str:
    """The call's tensor shapes, e.g. ``(4, 192), labels=(4, 192)``."""
    parts = [str(tuple(a.shape)) for a in args if isinstance(a, torch.Tensor)]
    parts += [f"{k}={tuple(v.shape)}" for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return ", ".join(parts) or "no tensors"


class ShapeVariants:
    """Variants of one optimized module at other input shapes, built on first use and cached."""

    def __init__(
        self, module: OptimizedModule, graph: Graph, example: tuple[tuple, dict], *, max_shapes: int = DEFAULT_MAX_SHAPES
    ) -> None:
        if max_shapes < 1:
            raise ValueError(f"max_shapes must be at least 1, got {max_shapes}")
        self.model = module.original_module
        self.plan: PlanRecord = module.plan
        self.unit_keys = [_unit_key(unit) for unit in graph.units]
        self.call_form = CallForm(self.model, *example)
        self.example = example
        self.pool: HostPool | None = module.__dict__["_autockpt_pool"]  # shared: a smaller step needs no more
        # module-level captures wrap submodule calls, which run at any shape: the module itself runs smaller inputs
        self.shape_generic_module = module if graph.kind is CaptureKind.MODULE else None
        self.max_shapes = max_shapes
        self._variants: collections.OrderedDict[tuple, ShapeVariant] = collections.OrderedDict()

    def variants(self) -> list[ShapeVariant]:
        """The variants built so far, least recently used first."""
        return list(self._variants.values())

    def module_for(self, args: tuple, kwargs: dict) -> OptimizedModule | str:
        """The plan's module at these inputs' shapes (captured the first time), or why there is none (a message that
        names the input and its shapes)."""
        key = input_signature(args, kwargs)
        variant = self._variants.get(key)
        if variant is not None:
            self._variants.move_to_end(key)
            return variant.module
        comparison = compare_inputs(self.call_form, self.example, args, kwargs)
        if comparison.fit is InputFit.LARGER:
            return (
                f"{comparison.detail}. Plan with the largest inputs training uses (optimize's example_inputs): steps "
                "no larger than those run under the plan"
            )
        if comparison.fit is InputFit.OTHER:
            return (
                f"{comparison.detail}. The plan runs calls with the example's arguments, dtypes and values (tensors "
                "may be smaller): plan with example inputs passed as training passes them"
            )
        if self.shape_generic_module is not None:
            return self.shape_generic_module
        started = time.perf_counter()
        description = describe_shapes(args, kwargs)
        try:
            with preserved_model_state(self.model, args, kwargs):
                graph = captured_program(self.model, args, kwargs, self.plan.loss_chunk_tokens)
        except Exception as error:  # noqa: BLE001 - any capture failure means: no plan at these shapes
            return f"capturing the model at {description} failed ({type(error).__name__}: {error})"
        policy = remap_policy(self.plan.policy, self.unit_keys, [_unit_key(unit) for unit in graph.units])
        if isinstance(policy, str):
            return f"the graph captured at {description} {policy}"
        plan = self.plan if policy == self.plan.policy else dataclasses.replace(self.plan, policy=policy)
        module = rewrite(graph, policy, args, kwargs, plan=plan, pool=self.pool)
        module.training = self.model.training
        seconds = time.perf_counter() - started
        self._variants[key] = ShapeVariant(description, module, seconds)
        logger.info(
            "autockpt: planned regions applied at new input shapes %s (captured and rewritten in %.2f s; %d shapes "
            "cached, at most %d)", description, seconds, len(self._variants), self.max_shapes,
        )
        while len(self._variants) > self.max_shapes:
            _, dropped = self._variants.popitem(last=False)
            logger.info("autockpt: shapes %s dropped from the cache (max_shapes=%d)", dropped.description, self.max_shapes)
        return module


def remap_policy(policy: Policy, planned: Sequence[tuple[str, str]], captured: Sequence[tuple[str, str]]) -> Policy | str:
    """``policy`` on another capture of the same model, whose units may differ where the call differs (a loss that
    divides by a loop's ``num_items_in_batch`` adds ops; a slice that was a whole tensor's alias changes op). Units are
    aligned by (module path, op) with difflib; each region keeps its aligned end units and covers what lies between
    them. Returns why not when a region's end has no counterpart."""
    if list(planned) == list(captured):
        return policy
    where: dict[int, int] = {}
    matcher = difflib.SequenceMatcher(None, list(planned), list(captured), autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):  # same units, or one-for-one changes
            where.update(zip(range(i1, i2), range(j1, j2)))
    moved = []
    for region_action in policy.region_actions:
        region = region_action.region
        if region.first_unit not in where or region.last_unit not in where:
            return (
                f"has other units than the planned graph ({len(captured)} instead of {len(planned)}) and the planned "
                f"region of units {region.first_unit}..{region.last_unit} has no counterpart in it"
            )
        moved.append(RegionAction(
            region=Region(first_unit=where[region.first_unit], last_unit=where[region.last_unit]),
            action=region_action.action,
        ))
    stages = policy.placement.stages
    if len(stages) != 1:
        return "cannot take a pipeline placement to other shapes"
    return Policy(
        region_actions=tuple(moved), placement=Placement.single_device(len(captured), stages[0].device)
    )


def _unit_key(unit: Unit) -> tuple[str, str]:
    return (unit.module_path, unit.op)


def _compare_values(name: str, expected: Any, given: Any) -> InputComparison:
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    given_leaves, given_spec = pytree.tree_flatten(given)
    if expected_spec != given_spec:
        return InputComparison(InputFit.OTHER, f"{name} has another structure than in the example")
    for want, got in zip(expected_leaves, given_leaves):
        if isinstance(want, torch.Tensor) != isinstance(got, torch.Tensor):
            return InputComparison(InputFit.OTHER, f"{name}: a tensor where the example had none, or the reverse")
        if not isinstance(want, torch.Tensor):
            if not _same_value(want, got):
                return InputComparison(InputFit.OTHER, f"{name} is {got!r}, the example's was {want!r}")
            continue
        if got.dtype != want.dtype or got.device != want.device or got.dim() != want.dim():
            return InputComparison(
                InputFit.OTHER,
                f"{name} is {got.dtype} {tuple(got.shape)} on {got.device}, the example's was {want.dtype} "
                f"{tuple(want.shape)} on {want.device}",
            )
        if any(g > w for g, w in zip(got.shape, want.shape)):
            return InputComparison(
                InputFit.LARGER, f"{name} has shape {tuple(got.shape)}, larger than the planned {tuple(want.shape)}"
            )
    return InputComparison(InputFit.WITHIN, "")


def _same_value(want: Any, got: Any) -> bool:
    try:
        return bool(want is got or want == got)
    except Exception:  # noqa: BLE001 - values without a plain equality are compared by identity only
        return False


def attach_shape_variants(
    module: OptimizedModule, graph: Graph, example: tuple[tuple, dict], *, max_shapes: int = DEFAULT_MAX_SHAPES
) -> OptimizedModule:
    """``module`` with steps at inputs no larger than ``example`` running under its plan (``graph``: the capture
    the module was rewritten from)."""
    module.attach_shapes(ShapeVariants(module, graph, example, max_shapes=max_shapes))
    return module
