"""Rewrite: (Graph, Policy) -> nn.Module that runs every planned region under its action.

fx/export captures: each region's nodes are moved into a sub-GraphModule that runs under the region's action
(``recompute.py``: ``torch.utils.checkpoint(use_reentrant=False, preserve_rng_state=True)`` or autockpt's own); both
re-run the region with the forward's RNG state, so dropout draws the same mask. Module-level captures: the chosen
submodules' ``forward`` is wrapped in its region's action while (and only while) the optimized module runs.

Under ``torch.compile`` (``torch.compiler.is_compiling()``, decided while Dynamo traces, so nothing to choose) every
recompute region is ``torch.utils.checkpoint(use_reentrant=False)`` around its bare body (``recompute.
compiled_checkpoint``): Dynamo keeps it in the step's graph as one checkpoint op and AOTAutograd's partitioner
recomputes its ops in the compiled backward, so ``torch.compile(optimized)`` compiles as few graphs as the original.
Offloaded regions still break the graph (saved-tensor hooks); module-level captures under compile are not measured.

During a recomputation (inside backward) the buffers the region touches are put back afterwards, so BatchNorm
running statistics advance exactly once per step. The returned module mirrors the original's children, parameters
and buffers under the same names, so ``state_dict`` keys, optimizers and checkpoints work with either module.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import operator
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autockpt.errors import UnplannedStepError, first_line
from autockpt.record_types import PlanRecord
from autockpt.runtime.call_form import CallForm
from autockpt.runtime.fx_nodes import compute_nodes
from autockpt.runtime.model_state import autocast_state, share_registries, start_autocast_step, training_modes
from autockpt.runtime.offload import HostPool, PoolStats
from autockpt.runtime.output_watch import OutputWatch
from autockpt.runtime.recompute import CheckpointedRegion, run_checkpointed
from autockpt.types import Action, CaptureKind, Graph, Policy, Region

logger = logging.getLogger(__name__)


def rewrite(
    graph: Graph, policy: Policy, args: tuple, kwargs: dict, *, plan: PlanRecord, pool: HostPool | None = None
) -> OptimizedModule:
    """Build the module that runs ``policy``; ``plan`` (whose policy it is) is attached for ``autockpt.get_plan``.
    Consumes ``graph.executable`` (it is edited in place). ``pool``: the host pool of the module this one is a shape
    variant of (None: a new pool when the plan offloads)."""
    if plan.policy != policy:
        raise ValueError("rewrite: the attached plan must be the one whose policy is applied")
    offloads = Action.OFFLOAD in policy.actions
    if graph.kind is CaptureKind.MODULE:
        if offloads:
            raise ValueError(
                "offloaded regions need a graph capture (fx or export); this model was captured per module call "
                f"({graph.notes[0] if graph.notes else 'module-level capture'}): plan it with recompute actions only"
            )
        spans = {(s.first_unit, s.last_unit): s.path for s in graph.module_spans}
        modules = [
            (graph.model.get_submodule(spans[(ra.region.first_unit, ra.region.last_unit)]), ra.action)
            for ra in policy.region_actions
        ]
        return OptimizedModule(
            graph.model, plan, CallForm(graph.model, args, kwargs), executable=None, checkpointed_modules=modules,
            conditions=None,
        )
    gm = graph.executable
    assert isinstance(gm, fx.GraphModule)
    # one pool per optimized module, allocated here once and reused by every step (and by its shape variants)
    if offloads and pool is None:
        pool = HostPool(plan.host_pool_bytes, policy.placement.stages[0].device)
    nodes = compute_nodes(gm)
    for index, region_action in enumerate(policy.region_actions):
        _outline_region(gm, nodes, region_action.region, index, region_action.action, pool)
    gm.graph.lint()
    gm.recompile()
    return OptimizedModule(
        graph.model, plan, CallForm(graph.model, args, kwargs), executable=gm, checkpointed_modules=(),
        conditions=CaptureConditions(graph), pool=pool,
    )


def _outline_region(
    gm: fx.GraphModule, nodes: list[fx.Node], region: Region, index: int, action: Action, pool: HostPool | None
) -> None:
    region_nodes = nodes[region.first_unit : region.last_unit + 1]
    inside = set(region_nodes)
    inputs: list[fx.Node] = []
    for node in region_nodes:
        for source in node.all_input_nodes:
            # parameters and buffers are read inside the body, not passed in: a buffer that BatchNorm updates in
            # place must not be a saved checkpoint input
            if source not in inside and source.op != "get_attr" and source not in inputs:
                inputs.append(source)
    body_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {source: body_graph.placeholder(source.name) for source in inputs}
    for node in region_nodes:
        for source in node.all_input_nodes:
            if source.op == "get_attr" and source not in env:
                env[source] = body_graph.get_attr(source.target)
        env[node] = body_graph.node_copy(node, lambda n: env[n])
    outputs = [node for node in region_nodes if any(user not in inside for user in node.users)]
    body_graph.output(tuple(env[node] for node in outputs))
    body = fx.GraphModule(gm, body_graph, class_name=f"Region{index}")
    with gm.graph.inserting_after(region_nodes[-1]):
        name = f"autockpt_region_{index}"
        runner = OffloadedRegion(body, name, pool, index) if pool is not None and action is Action.OFFLOAD else (
            CheckpointedRegion(body, name, action))
        call = gm.graph.call_function(runner, tuple(inputs))
    anchor = call
    for position, node in enumerate(outputs):
        with gm.graph.inserting_after(anchor):
            anchor = gm.graph.call_function(operator.getitem, (call, position))
        node.replace_all_uses_with(anchor, delete_user_cb=lambda user: user not in inside)
    for node in reversed(region_nodes):
        gm.graph.erase_node(node)


class OffloadedRegion:
    """One planned region whose saved tensors go to the host pool: its nodes as a GraphModule, run inside
    ``HostPool.offloading``. A plain callable, like ``CheckpointedRegion`` (and for the same reasons)."""

    def __init__(self, body: fx.GraphModule, name: str, pool: HostPool, index: int) -> None:
        self.body = body
        self.pool = pool
        self.index = index
        self.__name__ = self.__qualname__ = name
        self.__module__ = __name__

    def __call__(self, *inputs: Any) -> Any:
        with self.pool.offloading(self.index):
            return self.body.forward(*inputs)  # not body(...): module hooks (MemTracker's) would hold its gradients


def _checkpointed_forward(
    module: nn.Module, action: Action, forward: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    # closed=False: a module's forward may read tensors beyond its parameters; autockpt's checkpoint looks for them
    return run_checkpointed(
        action, forward, args, kwargs, parameters=list(module.parameters()), buffers=list(module.buffers()), closed=False
    )


class CaptureConditions:
    """What an fx or export graph was captured under and bakes in, so it is right only while they hold: the model's
    parameter and buffer objects (the graph reads those objects, not the model's registries: ``load_state_dict(...,
    assign=True)`` or ``.float()`` after ``.double()`` puts new ones there), their dtypes and devices (``.double()``,
    ``.to(device)``; casts and constants are baked in), the autocast state and every submodule's train/eval flag."""

    def __init__(self, graph: Graph) -> None:
        self.modes = graph.training_modes
        self.autocast = graph.autocast
        self.tensors = [
            (f"{path}.{name}" if path else name, registry, name, tensor, tensor.dtype, tensor.device)
            for path, module in graph.model.named_modules()
            for registry in (module._parameters, module._buffers)
            for name, tensor in registry.items()
            if tensor is not None
        ]

    def changed(self, model: nn.Module) -> tuple[str, str]:
        """('', '') while the graph is right; else what changed (a short key) and how (for a message)."""
        for qualified, registry, name, tensor, dtype, device in self.tensors:
            now = registry.get(name)
            if now is not tensor:
                return "tensors", f"{qualified} is another tensor object than when planned (load_state_dict(assign=True)?)"
            if now.dtype != dtype or now.device != device:
                return "tensors", f"{qualified} is now {now.dtype} on {now.device}, planned as {dtype} on {device}"
        now_modes = training_modes(model)
        if now_modes != self.modes:
            names = [path or "<root>" for (path, _), was, is_ in zip(model.named_modules(), self.modes, now_modes) if was != is_]
            listed = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            return "modes", f"the train/eval flags of {len(names)} submodule(s) differ from when planned ({listed})"
        if autocast_state() != self.autocast:
            return "autocast", f"autocast is {_autocast_text(autocast_state())}, planned {_autocast_text(self.autocast)}"
        return "", ""


def _autocast_text(state: tuple[tuple[str, bool, torch.dtype], ...]) -> str:
    on = [f"{device} {str(dtype).removeprefix('torch.')}" for device, enabled, dtype in state if enabled]
    return "on (" + ", ".join(on) + ")" if on else "off"


class ShapeSource(Protocol):
    """What the optimized module asks when a call's inputs differ from the example's (``shapes.ShapeVariants``)."""

    def module_for(self, args: tuple, kwargs: dict) -> OptimizedModule | str:
        """The module that runs the plan at these inputs (the asking module itself when its graph is shape-generic),
        or why there is none."""

    def variants(self) -> list[Any]: ...


class CourseSource(Protocol):
    """What the optimized module asks when a step's values take another course than the example's (a run-time
    check of the graph failed: ``is_other_course``); ``planning/courses.py``'s ``CourseVariants``."""

    def run(self, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """(True, output) where a plan for this course ran the step; (False, why not) otherwise."""


_COURSE_CHECK_FAILED = "Runtime assertion failed"


def is_other_course(error: BaseException) -> bool:
    """True for the error a captured graph raises when a value it was captured on (``capture.value_guards``) reads
    otherwise at run time: the eager model would take another course for these inputs."""
    return isinstance(error, RuntimeError) and str(error).startswith(_COURSE_CHECK_FAILED)


def _own_forward() -> Callable[..., Any]:
    """``OptimizedModule._forward`` with a code object of its own, for one module. Dynamo keeps compiled graphs per
    code object, at most ``torch._dynamo.config.recompile_limit`` (8) of them, and one optimized module's graph never
    passes another's guards (each has its own graph class): with the code object shared, the ninth optimized module
    compiled in a process ran eager, with a warning only (``optimize(..., compiled=True)`` compiles up to eight)."""
    shared = OptimizedModule._forward
    return types.FunctionType(shared.__code__.replace(), shared.__globals__, shared.__name__, shared.__defaults__,
                              shared.__closure__)


class _ForwardWithModelSignature:
    """``OptimizedModule.forward``: the module's ``_forward``, bound, carrying the wrapped model's ``forward``
    signature (``inspect.signature(optimized.forward)`` names the model's arguments, not ``*args, **kwargs``)."""

    def __get__(self, module: OptimizedModule | None, owner: type | None = None) -> Callable[..., Any]:
        if module is None:
            return OptimizedModule._forward
        own_forward = module.__dict__["_autockpt_forward"]
        if torch.compiler.is_compiling():  # Dynamo traces neither setting a partial's attribute nor MethodType()
            return own_forward.__get__(module, type(module))
        bound = functools.partial(own_forward, module)
        signature = module.__dict__.get("_autockpt_signature")
        if signature is not None:
            bound.__signature__ = signature  # type: ignore[attr-defined]
        return bound


# Dynamo would compile ``__get__`` as a frame of its own (it is called from ``nn.Module.__call__``, which Dynamo does not
# trace) and guard it on the module's own ``_forward``: past ``recompile_limit`` optimized modules it warned on every
# new one. It only picks a function, so Dynamo skips that frame (still tracing through it inside a compiled caller).
torch._dynamo.eval_frame.skip_code(_ForwardWithModelSignature.__get__.__code__)


class OptimizedModule(nn.Module):
    """The model, trained under a memory plan. Same parameters, buffers and state_dict keys as the original.

    In eval mode (warned once when gradients are on), under ``torch.no_grad()``, for inputs whose shapes differ from
    the ones the plan was made for, or (fx and export captures) when what the graph was captured under has changed
    (``CaptureConditions``: tensors replaced or converted, train/eval flags, autocast), it runs the original model
    unchanged, warning once per reason.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: PlanRecord,
        call_form: CallForm,
        *,
        executable: fx.GraphModule | None,
        checkpointed_modules: Sequence[tuple[nn.Module, Action]],
        conditions: CaptureConditions | None,
        pool: HostPool | None = None,
    ) -> None:
        super().__init__()
        # the model's own registries, not copies: a forward that assigns a new tensor to a buffer
        # (``self.count = self.count + 1``) is then seen through this module's state_dict too
        share_registries(self, model)
        self.training = model.training
        # plain attributes (not registered): the optimized module's state is exactly the model's
        self.__dict__["_autockpt_model"] = model
        self.__dict__["_autockpt_plan"] = plan
        self.__dict__["_autockpt_call_form"] = call_form
        self.__dict__["_autockpt_executable"] = executable
        self.__dict__["_autockpt_checkpointed"] = tuple(checkpointed_modules)
        self.__dict__["_autockpt_conditions"] = conditions  # None: the model runs live (module-level)
        self.__dict__["_autockpt_warned"] = set()  # reasons for running without the plan already logged
        self.__dict__["_autockpt_pool"] = pool  # the host pool of offloaded regions (None: nothing is offloaded)
        self.__dict__["_autockpt_variants"] = None  # steps at other input shapes (``attach_shapes``)
        self.__dict__["_autockpt_courses"] = None  # steps whose values take another course (``attach_courses``)
        self.__dict__["_autockpt_strict"] = False
        # the loop the plan counts on: the output held through backward, or dropped before it (checked at run time)
        self.__dict__["_autockpt_output_watch"] = OutputWatch(plan.loop.output_held if plan.loop is not None else True)
        self.__dict__["_autockpt_forward"] = _own_forward()
        try:  # presented as ``forward``'s signature: loops such as HF Trainer read it to choose the batch's columns
            self.__dict__["_autockpt_signature"] = inspect.signature(model.forward)
        except (TypeError, ValueError):
            self.__dict__["_autockpt_signature"] = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # nn.Module's: without a compiled call (``Module.compile()``)
        state.pop("_autockpt_forward", None)  # a function made per module: not picklable by name; made again on load
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__["_autockpt_forward"] = _own_forward()

    @property
    def original_module(self) -> nn.Module:
        return self.__dict__["_autockpt_model"]

    @property
    def plan(self) -> PlanRecord:
        return self.__dict__["_autockpt_plan"]

    def set_plan(self, plan: PlanRecord) -> None:
        """Replace the attached plan (same policy; used to record the measured peak)."""
        if plan.policy != self.plan.policy:
            raise ValueError("set_plan only updates a plan's figures; its policy must stay the same")
        self.__dict__["_autockpt_plan"] = plan

    @property
    def host_pool_bytes(self) -> int:
        """The host pool's buffer, allocated once (0: the plan offloads nothing)."""
        pool: HostPool | None = self.__dict__["_autockpt_pool"]
        return pool.capacity_bytes if pool is not None else 0

    def pool_stats(self) -> PoolStats | None:
        """The host pool's counters (bytes in and out, peak occupancy, waits on copies); None without a pool."""
        pool: HostPool | None = self.__dict__["_autockpt_pool"]
        return pool.stats() if pool is not None else None

    def train(self, mode: bool = True) -> OptimizedModule:
        super().train(mode)
        self.original_module.train(mode)
        return self

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self.original_module
        if not torch.is_grad_enabled():
            return model(*args, **kwargs)
        if not self.training:
            self._warn_once(
                "eval", "autockpt: the optimized module is in eval mode with gradients enabled; it runs the original "
                "model without the plan (made for the training step in train mode), so its peak is the unmodified "
                "one. Call .train() to train under the plan, or use torch.no_grad() to evaluate.",
            )
            return model(*args, **kwargs)
        if self.__dict__["_autockpt_executable"] is not None:
            reason, details = self.__dict__["_autockpt_conditions"].changed(model)
            if reason:
                return self._unplanned(
                    reason, f"{details}. The captured graph bakes in what it was planned under; plan again under the "
                    "conditions training runs in.", args, kwargs,
                )
        call_form: CallForm = self.__dict__["_autockpt_call_form"]
        if not call_form.matches(args, kwargs):
            arranged = call_form.arranged(args, kwargs)
            if arranged is None:
                variants: ShapeSource | None = self.__dict__["_autockpt_variants"]
                found = variants.module_for(args, kwargs) if variants is not None else (
                    "the inputs differ from the example inputs the plan was made for (shapes, dtypes, argument values "
                    "or which arguments are given)")
                if isinstance(found, str):
                    return self._unplanned("inputs", found, args, kwargs)
                if found is not self:
                    return found._run_planned(args, kwargs)
            else:
                args, kwargs = arranged
        return self._run_planned(args, kwargs)

    forward = _ForwardWithModelSignature()

    def _run_planned(self, args: tuple, kwargs: dict) -> Any:
        """One forward under the plan, inputs in the form this module's graph was captured with."""
        try:
            output = self.run_planned_step(args, kwargs)
            self.__dict__["_autockpt_output_watch"].watch(output)
            return output
        except RuntimeError as error:
            if not is_other_course(error):
                raise
            return self._on_other_course(error, args, kwargs)

    def run_planned_step(self, args: tuple, kwargs: dict) -> Any:
        """One forward under this module's plan, as captured; raises where the graph's check of a value read while
        capturing fails (``is_other_course``)."""
        # the step runs as the traced one did: autocast's casts made afresh, not reused from an earlier step of the
        # same context (whose gradient functions would wait for the end of backward, holding every weight gradient)
        start_autocast_step()
        model = self.original_module
        executable = self.__dict__["_autockpt_executable"]
        if executable is not None:
            pool: HostPool | None = self.__dict__["_autockpt_pool"]
            if pool is not None:  # what existed before the step stays: the plan moves forward-made storages only
                pool.begin_step(kept=[*pytree.tree_leaves((args, kwargs)), *model.buffers()])
            return executable(*args, **kwargs)
        with _patched_forwards(self.__dict__["_autockpt_checkpointed"]):
            return model(*args, **kwargs)

    def _on_other_course(self, error: RuntimeError, args: tuple, kwargs: dict) -> Any:
        """The graph's check of a value read while capturing failed (``CourseSource``): the plan made for that
        course runs the step, else the original model (warned) or, in strict mode, ``UnplannedStepError``. The
        check sits where the value is read, before what depends on it: nothing of the step is kept."""
        courses: CourseSource | None = self.__dict__["_autockpt_courses"]
        if courses is not None:
            ran, result = courses.run(args, kwargs)
            if ran:
                return result
            why = str(result)
        else:
            why = "this module has no way to plan another course; plan with an example batch that takes it"
        check = first_line(error) or type(error).__name__
        return self._unplanned(
            "course", f"these inputs take another course through the model than the example's ({check}): {why}",
            args, kwargs,
        )

    def attach_courses(self, courses: CourseSource) -> None:
        """Let steps whose values take another course run under a plan of their own (``courses.CourseVariants``)."""
        self.__dict__["_autockpt_courses"] = courses

    def course_variants(self) -> list[Any]:
        """The plans made for other courses than the example's (``courses.CourseVariant``), oldest first."""
        courses: Any = self.__dict__["_autockpt_courses"]
        return courses.variants() if courses is not None else []

    def _unplanned(self, reason: str, message: str, args: tuple, kwargs: dict) -> Any:
        """Run the original model without the plan (warned once per reason), or raise in strict mode."""
        if self.strict:
            raise UnplannedStepError(
                f"autockpt: this training step cannot run under the plan: {message} (strict mode: set "
                "OptimizedModule.strict = False to run such steps unplanned, over the budget)"
            )
        self._warn_once(
            reason, "autockpt: running the original model without the plan, so the step's peak is not kept under "
            "the budget: %s", message,
        )
        return self.original_module(*args, **kwargs)

    @property
    def strict(self) -> bool:
        """True: a training step that cannot run under the plan raises ``UnplannedStepError`` instead of running
        the original model with a warning."""
        return self.__dict__["_autockpt_strict"]

    @strict.setter
    def strict(self, value: bool) -> None:
        self.__dict__["_autockpt_strict"] = bool(value)

    def attach_shapes(self, variants: ShapeSource) -> None:
        """Let steps at other input shapes run under the plan (``shapes.ShapeVariants``; the api attaches it)."""
        self.__dict__["_autockpt_variants"] = variants

    def prepare_shapes(self, calls: Sequence[tuple[tuple, dict]]) -> None:
        """Capture and rewrite the plan now for each ``(args, kwargs)`` (e.g. sequence buckets), instead of at the
        first step that uses them. Raises ``UnplannedStepError`` for a call the plan cannot run."""
        variants: ShapeSource | None = self.__dict__["_autockpt_variants"]
        for args, kwargs in calls:
            found = variants.module_for(tuple(args), dict(kwargs)) if variants is not None else (
                "this module was not made by autockpt.optimize, apply_plan or Planner.apply, which let it take other "
                "shapes")
            if isinstance(found, str):
                raise UnplannedStepError(f"autockpt: cannot prepare the plan for these inputs: {found}")

    def shape_variants(self) -> list[Any]:
        """The input shapes the plan was applied at besides the example's (``shapes.ShapeVariant``: shapes, seconds
        it took), least recently used first."""
        variants: ShapeSource | None = self.__dict__["_autockpt_variants"]
        return variants.variants() if variants is not None else []

    def _warn_once(self, reason: str, message: str, *args: Any) -> None:
        """Log why the plan is not used, once per reason: training loops call forward every step."""
        warned = self.__dict__["_autockpt_warned"]
        if reason not in warned:
            warned.add(reason)
            logger.warning(message, *args)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_autockpt_model")
            if model is None:
                raise
            return getattr(model, name)  # e.g. a Hugging Face model's .config

    def extra_repr(self) -> str:
        plan = self.plan
        return f"autockpt plan: {len(plan.regions)} checkpointed regions, capture={plan.capture.value}"


@contextlib.contextmanager
def _patched_forwards(modules: Sequence[tuple[nn.Module, Action]]) -> Iterator[None]:
    patched = []
    try:
        for module, action in modules:
            had_own = "forward" in module.__dict__
            original = module.forward
            module.forward = functools.partial(_checkpointed_forward, module, action, original)
            patched.append((module, had_own, original))
        yield
    finally:
        for module, had_own, original in reversed(patched):
            if had_own:
                module.forward = original
            else:
                del module.forward
