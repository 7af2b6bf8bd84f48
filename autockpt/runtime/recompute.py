"""Recompute: the runtime of the two recompute actions, which the rewriter puts around every planned region.

``run_checkpointed`` runs a callable under a region's action: ``Action.RECOMPUTE_TORCH`` is
``torch.utils.checkpoint(use_reentrant=False, preserve_rng_state=True)``; ``Action.RECOMPUTE_OWN`` is autockpt's own
checkpoint, below. ``CheckpointedRegion`` is one outlined fx region under its action (the cost calibration runs the
same wrapper, ``costs.py``).

Under ``Action.RECOMPUTE_OWN`` a region runs as one autograd Function:

* forward runs the region with autograd recording but with every saved tensor dropped on the spot, so nothing the
  region computes outlives its forward use, and the recorded graph says exactly which outputs need gradients
  (masks and index tensors stay non-differentiable, as in the original model);
* backward re-runs the region with the same RNG and autocast state and differentiates it with
  ``torch.autograd.grad``, returning gradients for the region's tensor inputs *and* for the parameters it reads,
  which are inputs of the Function. Parameter gradients therefore reach the outer backward like any other: hooks,
  ``torch.autograd.grad(loss, params)`` and gradient accumulation behave as without checkpointing.

Why not ``torch.utils.checkpoint``: the non-reentrant version passes every saved tensor through Python hooks three
times (a holder in forward, a repack while recomputing, an unpack in backward): about 0.012 ms per saved tensor on a
2-core CPU, against about 0.003 ms here; the same GPT-2 plan at Hugging Face's peak ran 1.24x instead of 1.32x
(``experiments/bench/bench_checkpoint.py``). But the whole region is re-run, so on conv nets, where early stop skips a
region's last convolution, torch's is often faster: this is an action of its own (``Action.RECOMPUTE_OWN``). The reentrant version
avoids the hooks but accumulates parameter gradients inside its own backward, so ``torch.autograd.grad`` fails and a
region whose inputs need no gradient loses its parameters' gradients.

What the simulator models (``simulate.py``): a region is re-run whole when backward reaches it (there is no early
stop), and the gradients of its outputs stay alive until its backward returns.

Under autocast both actions re-run a region inside the step's autocast context, so its low-precision weights come
from autocast's cache (made once per context, kept until the context exits): a recomputation makes no new copies of
them. Every planned step starts with that cache empty (``model_state.start_autocast_step``), as the first step of a context does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.autograd.graph import get_gradient_edge
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from autockpt.runtime.model_state import autocast_state
from autockpt.types import Action

logger = logging.getLogger(__name__)

_FLAT_LEAVES = (torch.Tensor, int, float, bool, str, type(None))


def checkpointed_call(
    run: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    parameters: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    *,
    closed: bool,
) -> Any:
    """``run(*args, **kwargs)``, recomputed in backward instead of keeping what it saves for backward.

    ``parameters``: every tensor requiring gradients that ``run`` reads other than through its arguments.
    ``buffers``: the buffers it may update in place (BatchNorm statistics); they are put back after the
    recomputation, so they advance once per step.
    ``closed=False`` when that list may be incomplete (a module's forward can read any tensor it can reach): the
    recorded graph is then searched for other leaves, which get their gradients accumulated directly.
    """
    if not kwargs and all(isinstance(a, _FLAT_LEAVES) for a in args):  # the fx regions' case: skip pytree's cost
        leaves, spec = list(args), None
    else:
        leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    inputs = [leaves[i] for i in positions]
    trainable = [p for p in parameters if p.requires_grad]
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (*inputs, *trainable)):
        return run(*args, **kwargs)  # nothing will flow back: nothing to save or recompute
    call = _Call(
        run=run, leaves=leaves, spec=spec, positions=positions, parameters=trainable, buffers=list(buffers),
        closed=closed,
    )
    outputs = _RecomputedRegion.apply(call, *inputs, *trainable)
    return call.rebuild_outputs(outputs)


def run_checkpointed(
    action: Action,
    run: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    *,
    parameters: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    closed: bool,
) -> Any:
    """``run(*args, **kwargs)`` under a recompute ``action``; ``parameters``, ``buffers`` and ``closed`` are what
    autockpt's own checkpoint needs to know (``checkpointed_call``).

    While ``torch.compile`` traces the step (``torch.compiler.is_compiling()``), every recompute action is
    ``compiled_checkpoint``: the form Dynamo keeps inside the step's graph."""
    if not action.recomputes:
        raise ValueError(f"run_checkpointed runs the recompute actions, got {action.value!r}")
    if torch.compiler.is_compiling():
        return compiled_checkpoint(run, args, kwargs)
    if action is Action.RECOMPUTE_OWN:
        return checkpointed_call(run, args, kwargs, parameters, buffers, closed=closed)

    def restoring_run(*inner_args: Any, **inner_kwargs: Any) -> Any:
        if torch._C._current_graph_task_id() == -1:  # the forward: statistics advance as usual
            return run(*inner_args, **inner_kwargs)
        with buffers_put_back(buffers):  # the recomputation, inside backward
            return run(*inner_args, **inner_kwargs)

    return checkpoint(restoring_run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def compiled_checkpoint(run: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """A region as ``torch.compile`` sees it: ``torch.utils.checkpoint(use_reentrant=False)`` around the bare
    ``run``, which Dynamo traces as one higher-order op (``tag_activation_checkpoint``) inside the step's graph instead
    of breaking the graph at the region. The ops inside are tagged for recomputation and the partitioner (AOTAutograd's
    min-cut) recomputes them in the compiled backward instead of saving them; what the region's boundary carries is
    saved, as in eager.

    The eager machinery is left out because compiled code does not need it and Dynamo cannot trace it: there is no
    recomputation at run time to put buffers back around (a compiled graph writes a BatchNorm's running statistics
    once, at its end; the backward recomputes values, never mutations), no saved-tensor hook to spare (so autockpt's
    own checkpoint has nothing to gain over torch's), and the RNG state is the compiler's to keep (random ops that
    the compiled backward recomputes run with the forward's state, ``run_with_rng_state`` in its graph). Measured
    (``tests/runtime/test_compile.py``): outputs, gradients and BatchNorm buffers equal to the compiled original's
    with the Inductor and aot_eager backends. Not with ``backend="eager"`` (Dynamo without AOTAutograd), which runs the
    checkpoint op eagerly: a region updating BatchNorm statistics then fails in backward, and dropout inside a region
    gave other gradients.
    """
    return checkpoint(run, *args, use_reentrant=False, **kwargs)


class CheckpointedRegion:
    """One planned region: its nodes as a GraphModule, run under the region's recompute action.

    A plain callable, not an ``nn.Module``: module hooks (MemTracker's ModTracker, user hooks) would otherwise see
    the region as a module and could hold on to its inputs and outputs. ``__name__``/``__module__`` let fx codegen
    call it from the rewritten graph.
    """

    def __init__(self, body: fx.GraphModule, name: str, action: Action) -> None:
        self.body = body
        self.action = action
        self.buffers = list(body.buffers())  # the same tensor objects as the model's (BatchNorm statistics)
        # the body reads tensors only through get_attr and its inputs, so these are all it can need gradients for
        self.parameters = list(body.parameters())
        self.__name__ = self.__qualname__ = name
        self.__module__ = __name__

    def __call__(self, *inputs: Any) -> Any:
        return run_checkpointed(
            self.action, self.body.forward, inputs, {}, parameters=self.parameters, buffers=self.buffers, closed=True
        )


@dataclass(eq=False)
class _Call:
    """One call of a checkpointed region: how to run it again, and how to rebuild its output structure."""

    run: Callable[..., Any]
    leaves: list[Any]  # the arguments, flattened (tensors are replaced on every run)
    spec: pytree.TreeSpec | None  # None: ``leaves`` are the positional arguments themselves
    positions: list[int]  # where the tensor arguments sit in ``leaves``
    parameters: list[torch.Tensor]
    buffers: list[torch.Tensor]
    closed: bool
    output_leaves: list[Any] = field(default_factory=list)  # non-tensor output leaves (tensors: None)
    output_spec: pytree.TreeSpec | None = None  # None: the outputs were a plain tuple of tensors

    def run_on(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run the region on ``inputs``; returns its tensor outputs, flattened, and remembers the rest."""
        leaves = list(self.leaves)
        for position, tensor in zip(self.positions, inputs):
            leaves[position] = tensor
        if self.spec is None:
            result = self.run(*leaves)
        else:
            args, kwargs = pytree.tree_unflatten(leaves, self.spec)
            result = self.run(*args, **kwargs)
        if isinstance(result, tuple) and all(isinstance(leaf, torch.Tensor) for leaf in result):
            self.output_leaves, self.output_spec = [None] * len(result), None  # the fx regions' case
            return list(result)
        flat, self.output_spec = pytree.tree_flatten(result)
        self.output_leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in flat]
        return [leaf for leaf in flat if isinstance(leaf, torch.Tensor)]

    def rebuild_outputs(self, tensors: Sequence[torch.Tensor]) -> Any:
        if self.output_spec is None:
            return tuple(tensors)
        supply = iter(tensors)
        flat = [next(supply) if leaf is None else leaf for leaf in self.output_leaves]
        return pytree.tree_unflatten(flat, self.output_spec)


@dataclass(frozen=True, slots=True)
class _ReplayState:
    """RNG and autocast state at the region's forward, so the recomputation draws the same dropout masks."""

    cpu_rng: torch.Tensor
    cuda_devices: list[int]
    cuda_rng: list[torch.Tensor]
    autocast: list[tuple[str, bool, torch.dtype]]
    autocast_cache: bool

    @classmethod
    def capture(cls, tensors: Sequence[torch.Tensor]) -> _ReplayState:
        devices = sorted({t.get_device() for t in tensors if t.is_cuda})
        return cls(
            cpu_rng=torch.get_rng_state(),
            cuda_devices=devices,
            cuda_rng=[torch.cuda.get_rng_state(d) for d in devices],
            autocast=list(autocast_state()),
            autocast_cache=torch.is_autocast_cache_enabled(),
        )

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Run with the forward's RNG and autocast state; the RNG state outside is left as it was."""
        outside_cpu = torch.get_rng_state()
        outside_cuda = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]
        torch.set_rng_state(self.cpu_rng)
        for device, state in zip(self.cuda_devices, self.cuda_rng):
            torch.cuda.set_rng_state(state, device)
        try:
            with contextlib.ExitStack() as stack:
                for device_type, enabled, dtype in self.autocast:
                    now = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
                    if (enabled, dtype) != now:
                        stack.enter_context(
                            torch.autocast(device_type, enabled=enabled, dtype=dtype, cache_enabled=self.autocast_cache)
                        )
                yield
        finally:
            torch.set_rng_state(outside_cpu)
            for device, state in zip(self.cuda_devices, outside_cuda):
                torch.cuda.set_rng_state(state, device)


def _drop(_: torch.Tensor) -> None:
    return None


def _never_unpacked(_: None) -> torch.Tensor:
    raise RuntimeError("autockpt: a region's forward graph was used for backward; its saved tensors were dropped")


def _detached(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Leaves that share the inputs' storage, so the recomputed graph ends at them and not in the outer graph."""
    return [t.detach().requires_grad_(t.requires_grad) for t in inputs]


def _fed(leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What the recomputation runs on: a view of each leaf that requires gradients, not the leaf itself. Module hooks
    that register gradient hooks on a module's inputs (torch's ModTracker, which MemTracker uses) raise when handed
    a leaf inside ``torch.autograd.grad``."""
    return [t.view_as(t) if t.requires_grad else t for t in leaves]


class _RecomputedRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = tensors[: len(call.positions)]
        ctx.call = call
        ctx.save_for_backward(*inputs)
        for position in call.positions:  # the graph keeps ctx (and call) until the step ends; saved inputs go earlier
            call.leaves[position] = None
        ctx.set_materialize_grads(False)  # an output nobody differentiated gets None: nothing to propagate
        ctx.replay = _ReplayState.capture([*inputs, *call.parameters])
        # record the graph (to learn which outputs need gradients) but keep none of the tensors it would save
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _never_unpacked):
            outputs = call.run_on(inputs)
        ctx.foreign = [] if call.closed else _foreign_leaves(outputs, inputs, call.parameters)
        ctx.differentiable = [t.requires_grad for t in outputs]
        results = tuple(t.detach() for t in outputs)
        ctx.mark_non_differentiable(*[r for r, d in zip(results, ctx.differentiable) if not d])
        return results

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call: _Call = ctx.call
        # a backward that builds a graph (double backward, ``create_graph=True``) differentiates the recomputation
        # on views of the real inputs, so second-order gradients flow back through them (one view per argument: a
        # tensor passed twice gets each use's gradient once); otherwise the recomputed graph ends at detached leaves
        create_graph = torch.is_grad_enabled()
        inputs = [t.view_as(t) for t in ctx.saved_tensors] if create_graph else _detached(ctx.saved_tensors)
        with buffers_put_back(call.buffers), ctx.replay.replayed(), torch.enable_grad():
            outputs = call.run_on(_fed(inputs))
        roots, root_grads = _roots(outputs, grads)
        del outputs  # the recomputed outputs' memory can go now; their gradient functions stay in ``roots``
        wanted = [t for t in (*inputs, *call.parameters, *ctx.foreign) if t.requires_grad]
        found: dict[int, torch.Tensor | None] = {}
        if roots and wanted:
            gradients = torch.autograd.grad(roots, wanted, root_grads, allow_unused=True, create_graph=create_graph)
            found = {id(t): g for t, g in zip(wanted, gradients)}
        for leaf in ctx.foreign:
            _accumulate(leaf, found.get(id(leaf)))
        return (None, *(found.get(id(t)) for t in (*inputs, *call.parameters)))


@contextlib.contextmanager
def buffers_put_back(buffers: Sequence[torch.Tensor]) -> Iterator[None]:
    """Put the buffers' values back on exit: a recomputation updates running statistics a second time, and they must
    advance once per step. Through ``.data``, which leaves the version counter alone: batch_norm's backward saved the
    buffers during the recomputation and checks they were not modified since (it does not read their values in
    training)."""
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        for buffer, value in zip(buffers, saved):
            buffer.data.copy_(value)


def _roots(
    outputs: list[torch.Tensor], grads: Sequence[torch.Tensor | None]
) -> tuple[list[Any], list[torch.Tensor]]:
    """Where the inner backward starts: an edge (not the tensor) per output that has a gradient to propagate."""
    roots, root_grads = [], []
    for output, grad in zip(outputs, grads):
        if grad is not None and output.requires_grad:
            roots.append(output if output.grad_fn is None else get_gradient_edge(output))
            root_grads.append(grad)
    return roots, root_grads


_warned_foreign = False  # warn once per process, not once per step


def _foreign_leaves(
    outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], parameters: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Leaves requiring gradients that the region's graph reaches other than its inputs and ``parameters``.

    The walk stops where the region's inputs come from, so it covers the region's own graph only.
    """
    known_ids = {id(t) for t in (*inputs, *parameters)}
    seen = {id(t.grad_fn) for t in inputs if t.grad_fn is not None}
    foreign: list[torch.Tensor] = []
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if variable is not None:
            if id(variable) not in known_ids and variable.requires_grad:
                foreign.append(variable)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    global _warned_foreign
    if foreign and not _warned_foreign:
        _warned_foreign = True
        logger.warning(
            "autockpt: a checkpointed module reads %d tensor(s) requiring gradients that are neither its arguments "
            "nor its parameters; their gradients are accumulated directly into .grad (torch.autograd.grad will not "
            "see them)", len(foreign),
        )
    return foreign


def _accumulate(leaf: torch.Tensor, gradient: torch.Tensor | None) -> None:
    if gradient is None:
        return
    with torch.no_grad():
        leaf.grad = gradient.detach() if leaf.grad is None else leaf.grad + gradient
