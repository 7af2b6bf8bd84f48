"""The stage table: every candidate stage (a run of units between two legal cuts) planned once with the
single-device Planner on its own step, what it keeps for backward and its schedule buffers; and the cuts: block
boundaries, baseline splits (even layers, parameter-balanced) and given cuts checked. The whole step's values, unit
times and crossing tensors come from ``whole_step.py`` (real, or fake for a step no device runs); every stage planner
is built as the whole step was traced (``WholeStep.planner_arguments``)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autockpt.core.simulate import memory_curve
from autockpt.core.solve.split import SplitProblem, StageOption
from autockpt.errors import InfeasibleBudgetError
from autockpt.measure.loss_tail import returned_projection
from autockpt.measure.trace import unique_storage_bytes
from autockpt.pipeline.last_stage import planner_with_loss, received_tensors, runs_with_loss, the_output
from autockpt.pipeline.request import PipelineRequest, tensors_in
from autockpt.pipeline.stage_graphs import (
    StageGraph,
    crossing,
    cut_problem,
    stage_graph,
    unit_positions,
)
from autockpt.pipeline.whole_step import FakesBeside, WholeStep, meta_of
from autockpt.planning.loss_chunks import NOT_CHUNKED, logits_negligible
from autockpt.planning.options import PlanOptions
from autockpt.planning.planner import Planner
from autockpt.record_types import PipelineStageRecord
from autockpt.records.plan import Plan
from autockpt.types import (
    Graph,
    Phase,
    RegionAction,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageEntry:
    """A stage's best plan for one run of units at one position (None plan: no plan keeps the budget)."""

    plan: Plan
    retained_bytes: int
    buffer_bytes: int
    predicted_peak_bytes: int
    microbatch_ms: float


class StageTable:
    """Candidate cuts, and per run of units between them and stage position, the stage's best plan."""

    def __init__(
        self, request: PipelineRequest, graph: Graph, max_candidates: int, options: PlanOptions, whole: WholeStep
    ) -> None:
        self.request = request
        self.graph = graph
        self.whole = whole
        self.options = options
        self.solver_options = options.solver
        self.num_units = len(graph.units)
        values = whole.values
        assert isinstance(graph.executable, fx.GraphModule)
        self.values = values
        boundaries = block_boundaries(graph)
        self.legal_cuts = tuple(p for p in boundaries if not cut_problem(graph.executable, values, p))
        if len(self.legal_cuts) < request.num_stages - 1:
            raise ValueError(
                f"{type(request.model).__name__} has {len(self.legal_cuts)} places to cut between its blocks where "
                f"only tensors cross ({len(boundaries)} block boundaries); {request.num_stages} stages need "
                f"{request.num_stages - 1}"
            )
        # the splits given by name or by cuts, over every legal cut (the program and the exhaustive search choose
        # among the candidates, which include these)
        self.given_cuts: dict[str | tuple[int, ...], tuple[int, ...]] = {
            split: checked_cuts(split, graph, values, self.legal_cuts) if isinstance(split, tuple)
            else baseline_cuts(self, split)
            for split in request.splits if split not in ("autockpt", "exhaustive")
        }
        given = {cut for cuts in self.given_cuts.values() for cut in cuts}
        self.candidates = tuple(sorted({*spread(list(self.legal_cuts), max_candidates), *given}))
        self._crossing = whole.crossing_tensors(self.candidates)
        # stage times come from the whole step's unit times: timings of tiny stages traced one by one are noisy,
        # and every split must be compared on the same numbers
        self.unit_ms = list(whole.unit_ms)
        self.backward_ratio = whole.backward_ratio
        self._planners: dict[tuple[int, int], Planner] = {}
        self._entries: dict[tuple[int, int, int], StageEntry | None] = {}
        self._output_bytes: dict[int, tuple[int, int]] = {}  # per stage planner (live as long as the table)
        self._floors: dict[tuple[int, int, int], int | None] = {}  # per stage position and units
        self.loss_unit = loss_unit(graph, whole, options)

    # the runs a stage may take: from one candidate boundary (or the start) to a later one (or the end)
    def runs(self) -> list[tuple[int, int]]:
        starts = [0, *(c + 1 for c in self.candidates)]
        ends = [*self.candidates, self.num_units - 1]
        return [(a, b) for a in starts for b in ends if a <= b]

    def can_hold(self, stage: int, first: int, last: int) -> bool:
        """Whether stage position ``stage`` may run units ``first .. last``: the first stage starts at unit 0, the last
        ends at the last unit, and no other does either."""
        return (stage == 0) == (first == 0) and (stage == self.request.num_stages - 1) == (last == self.num_units - 1)

    def at_budget(self, budget: int) -> StageTable:
        """This table with every device's budget ``budget`` (``with_budgets``)."""
        return self.with_budgets((budget,) * self.request.num_stages)

    def with_budgets(self, budgets: tuple[int, ...]) -> StageTable:
        """This table with one budget per stage: the same capture, crossings and stage planners (their floors
        found once), its stage plans solved again."""
        trial = copy.copy(self)
        trial.request = dataclasses.replace(self.request, budgets_bytes=tuple(budgets))
        trial._entries = {}
        return trial

    def graph_of(self, first: int, last: int, *, index: int = 0) -> StageGraph:
        return stage_graph(self.graph, first, last, index=index)

    def trains_parameters(self, first: int, last: int) -> bool:
        return any(p.requires_grad for p in self.graph_of(first, last).module.parameters())

    def planner(self, first: int, last: int) -> Planner:
        key = (first, last)
        if key not in self._planners:
            stage = self.graph_of(first, last)
            args, kwargs = self.stage_inputs(stage)
            module = self.whole.stage_module(stage.module)
            # every microbatch after the first runs its backward with the step's gradients alive, and each
            # accumulation makes a new gradient beside the old one: the loop of gradient accumulation; on fakes
            # when the whole step was, for the same device
            options = dataclasses.replace(self.options, gradient_accumulation_steps=self.request.microbatches,
                                          **self.whole.planner_arguments())
            planner, not_chunked = None, ""
            if last == self.num_units - 1 and self.loss_unit is not None and first <= self.loss_unit:
                # the stage returns a projection's output its loss reads: planned with the loss, it may chunk it
                # the target microbatch in a storage of its own (a view would hold the batch's), the batch's
                # counted once beside it (``buffer_bytes``)
                target = pytree.tree_map_only(
                    torch.Tensor, meta_of if self.whole.fake else torch.clone, self.request.microbatch_target,
                )
                planner, not_chunked = planner_with_loss(module, args, target, self.request.loss_fn, options)
            if planner is None:
                planner = Planner.from_model(
                    module, example_inputs=args, example_kwargs=kwargs, loss_fn=self.stage_loss(stage),
                    options=options,
                )
            if not_chunked:  # the reason found with the loss, not the stage alone's ("the loss is outside")
                planner.notes = (*(n for n in planner.notes if not n.startswith(NOT_CHUNKED)), not_chunked)
            self._planners[key] = planner
        return self._planners[key]

    def stage_inputs(self, stage: StageGraph) -> tuple[tuple, dict]:
        if stage.first_unit == 0:
            return self.request.microbatch_args, self.request.microbatch_kwargs
        return tuple(self._crossing[name] for name in stage.input_names), {}

    def stage_loss(self, stage: StageGraph) -> Callable[[Any], torch.Tensor]:
        if stage.last_unit == self.num_units - 1:
            target, loss_fn = FakesBeside(self.request.microbatch_target), self.request.loss_fn
            return lambda output: loss_fn(output, target(output))
        return seeded_backward(stage_outputs=[self._crossing[name] for name in stage.output_names])

    def entry(self, option: StageOption) -> StageEntry:
        found = self.entry_at(option.stage, option.first_unit, option.last_unit)
        assert found is not None
        return found

    def entry_at(self, stage: int, first: int, last: int) -> StageEntry | None:
        """Stage position ``stage`` running units ``first .. last``: its best plan at its budget (None: none keeps
        it), solved once."""
        key = (stage, first, last)
        if key not in self._entries:
            self._entries[key] = self._solve(stage, first, last)
        return self._entries[key]

    def _solve(self, stage: int, first: int, last: int) -> StageEntry | None:
        """The fastest plan whose peak for one microbatch, plus the other microbatches in flight, plus the
        schedule's buffers, stays under the stage's budget. What a microbatch in flight keeps depends on the plan,
        so the budget left for one microbatch is found by a short fixed point, starting from what the unmodified
        stage keeps (the most any plan keeps: the first answer always fits)."""
        request = self.request
        if not self.trains_parameters(first, last):
            # nothing to train there (e.g. only the position encodings before the first layer): torch's pipelining
            # could run it, but it holds a device for no parameters; the Planner has no training step to plan
            logger.debug("no stage runs units %d..%d alone: they train no parameter", first, last)
            return None
        planner = self.planner(first, last)
        in_flight = request.schedule.in_flight(stage, request.num_stages, request.microbatches)
        buffers = self.buffer_bytes(first, last, planner)
        budget = request.budgets_bytes[stage]
        kept = retained_bytes(planner, ())  # the unmodified stage: the most any plan keeps
        best: StageEntry | None = None
        for _ in range(3):
            target = budget - buffers - (in_flight - 1) * kept
            try:
                the_plan = planner.plan(budget_bytes=target) if target > 0 else None
            except InfeasibleBudgetError:
                the_plan = None
            if the_plan is None:
                break
            kept_now = retained_bytes(planner, the_plan.policy.region_actions)
            peak = max(the_plan.predicted_peak_bytes + (in_flight - 1) * kept_now + buffers, self.end_of_step_bytes(first, last, planner))
            if peak <= budget:
                ms = self.microbatch_ms(first, last, the_plan)
                if best is None or ms < best.microbatch_ms:
                    best = StageEntry(
                        plan=the_plan, retained_bytes=kept_now, buffer_bytes=buffers, predicted_peak_bytes=peak,
                        microbatch_ms=ms,
                    )
            if kept_now == kept:
                break
            kept = kept_now
        return best

    def microbatch_ms(self, first: int, last: int, the_plan: Plan) -> float:
        """Forward, backward and recomputation of one microbatch on units ``first .. last``, in the whole step's
        unit times (the stage's units are the whole graph's, in order) plus the plan's checkpoint machinery."""
        forward = sum(self.unit_ms[first:last + 1])
        if runs_with_loss(self.planner(first, last)):
            # its plan's units are those of the stage and the loss (chunked or not), not the whole graph's: what its
            # plan adds (recomputation, machinery, the logits made again in backward), in its own trace's times
            return forward * (1 + self.backward_ratio) + the_plan.predicted_overhead * the_plan.baseline_step_ms
        recomputed = sum(
            self.unit_ms[first + node.index] for node in the_plan.nodes
            if node.recompute_ms > 0 and first + node.index <= last
        )
        return forward * (1 + self.backward_ratio) + recomputed + the_plan.machinery_ms

    def floor_at(self, stage: int, first: int, last: int) -> int | None:
        """The least budget this stage position keeps: its plan's smallest one-microbatch peak, its buffers and the
        other microbatches in flight at what the unmodified stage keeps (None: units that train nothing are no
        stage, as in ``_solve``)."""
        key = (stage, first, last)
        if key not in self._floors:  # no budget enters it: trial tables share it (``at_budget``)
            self._floors[key] = self._floor(stage, first, last)
        return self._floors[key]

    def _floor(self, stage: int, first: int, last: int) -> int | None:
        request = self.request
        if not self.trains_parameters(first, last):
            return None
        planner = self.planner(first, last)
        in_flight = request.schedule.in_flight(stage, request.num_stages, request.microbatches)
        try:
            one = planner.plan(budget_bytes=1).predicted_peak_bytes
        except InfeasibleBudgetError as error:
            one = error.min_feasible_bytes
        return max(
            one + self.buffer_bytes(first, last, planner) + (in_flight - 1) * retained_bytes(planner, ()),
            self.end_of_step_bytes(first, last, planner),
        )

    def buffer_bytes(self, first: int, last: int, planner: Planner) -> int:
        """The schedule's tensors on this stage beside one microbatch's step: receive buffers for the inputs of every
        microbatch (the stage's own trace counts one as its input), the gradients of its inputs from the previous
        microbatch's backward (1F1B keeps them referenced in its list of sends until the next send: measured +16 384 B
        on a GPT-2-style last stage without them), receive buffers for the gradients of what it sends, the rest of
        the batch on stage 0, the target, the losses and (when returned) the outputs of every other microbatch on
        the last stage."""
        request = self.request
        m = request.microbatches
        stage = self.graph_of(first, last)
        total = 0
        received = planner.trace.input_bytes
        if runs_with_loss(planner):  # the target is an input of its step: the batch's is counted below
            received -= self.target_bytes(planner)
            total -= self.target_bytes(planner)
        if first == 0:
            total += request.batch_input_bytes - planner.trace.input_bytes
        else:
            total += (m - 1) * received
            total += sum(
                self._crossing[name].untyped_storage().nbytes() for name in stage.input_names
                if self._crossing[name].requires_grad
            )
        if last < self.num_units - 1:
            total += m * sum(
                self._crossing[name].untyped_storage().nbytes() for name in stage.output_names
                if self._crossing[name].is_floating_point()
            )
        else:
            total += request.batch_target_bytes
            # the schedule keeps every earlier microbatch's loss until the step ends (``losses=`` given or not); the
            # stage's trace counts its own
            total += (m - 1) * self.loss_bytes(planner)
            # the schedule keeps every microbatch's output to return them (a stage planned with its loss returns
            # the receive buffers, counted above)
            if request.return_outputs and not runs_with_loss(planner):
                total += (m - 1) * self.output_bytes(planner)
        return max(total, 0)

    def end_of_step_bytes(self, first: int, last: int, planner: Planner) -> int:
        """The last stage's bytes when ``step`` returns the outputs: the schedule concatenates every microbatch's
        output into the batch's while it still holds them (twice the outputs, beside parameters and gradients; once
        beside the receive buffers where the stage was planned with its loss: they are its outputs), and the list
        given as ``losses=`` (as PyTorch documents the step) already holds every microbatch's loss."""
        if last < self.num_units - 1 or not self.request.return_outputs:
            return 0
        m = self.request.microbatches
        target = self.target_bytes(planner) if runs_with_loss(planner) else 0  # the batch's is counted here
        return (
            planner.trace.static_bytes + (m - 1) * (planner.trace.input_bytes - target)
            + self.request.batch_target_bytes - target
            + (1 if target else 2) * m * self.output_bytes(planner) + m * self.loss_bytes(planner)
        )

    @staticmethod
    def target_bytes(planner: Planner) -> int:
        """Bytes of the target microbatch a stage-and-loss planner's step takes as its second input."""
        return unique_storage_bytes(tensors_in(planner.request.args[1]))

    def output_bytes(self, planner: Planner) -> int:
        """Bytes of the last stage's output for one microbatch (what the schedule keeps to return)."""
        return self._last_stage_bytes(planner)[0]

    def loss_bytes(self, planner: Planner) -> int:
        """Bytes of one microbatch's loss (a 0-dim tensor: 4 B in fp32), which the schedule keeps to the end of the
        step."""
        return self._last_stage_bytes(planner)[1]

    def _last_stage_bytes(self, planner: Planner) -> tuple[int, int]:
        """The last stage's output and loss bytes for one microbatch; one forward per stage planner, remembered:
        every budget tried asks again."""
        if id(planner) not in self._output_bytes and runs_with_loss(planner):  # it returns what it receives
            _, loss = self.whole.stage_forward(planner.graph, planner.request, the_output)
            self._output_bytes[id(planner)] = (
                unique_storage_bytes(received_tensors(planner)), unique_storage_bytes(tensors_in(loss))
            )
        if id(planner) not in self._output_bytes:
            target, loss_fn = FakesBeside(self.request.microbatch_target), self.request.loss_fn
            output, loss = self.whole.stage_forward(
                planner.graph, planner.request, lambda output: loss_fn(output, target(output))
            )
            self._output_bytes[id(planner)] = (
                unique_storage_bytes(tensors_in(output)), unique_storage_bytes(tensors_in(loss))
            )
        return self._output_bytes[id(planner)]

    def problem(self, link_gb_per_s: float, cuts: tuple[int, ...] | None = None) -> SplitProblem:
        """Every stage a split may use, with its time (given cuts: their own stages only)."""
        options = []
        runs = self.runs() if cuts is None else unit_pieces(list(cuts), self.num_units)
        for (first, last), stage in itertools.product(runs, range(self.request.num_stages)):
            if not self.can_hold(stage, first, last):
                continue
            entry = self.entry_at(stage, first, last)
            if entry is not None:
                options.append(StageOption(stage=stage, first_unit=first, last_unit=last, microbatch_ms=entry.microbatch_ms))
        transfer = {c: 2 * self.sent_bytes(c) / (link_gb_per_s * 1e6) for c in self.candidates}
        return SplitProblem(
            num_units=self.num_units, num_stages=self.request.num_stages, microbatches=self.request.microbatches,
            options=tuple(options), transfer_ms=transfer,
        )

    def sent_bytes(self, after_unit: int) -> int:
        assert isinstance(self.graph.executable, fx.GraphModule)
        return sum(
            self._crossing[node.name].untyped_storage().nbytes()
            for node in crossing(self.graph.executable, after_unit) if node.name in self._crossing
        )

    def record(self, option: StageOption) -> PipelineStageRecord:
        entry = self.entry(option)
        stage = self.graph_of(option.first_unit, option.last_unit, index=option.stage)
        parameters = {id(p): p for p in stage.module.parameters()}
        return PipelineStageRecord(
            index=option.stage, first_unit=option.first_unit, last_unit=option.last_unit,
            module_paths=stage.module_paths, parameter_names=stage.parameter_names,
            parameter_bytes=sum(p.nbytes for p in parameters.values()),
            budget_bytes=self.request.budgets_bytes[option.stage],
            microbatches_in_flight=self.request.schedule.in_flight(option.stage, self.request.num_stages, self.request.microbatches),
            retained_bytes=entry.retained_bytes, schedule_buffer_bytes=entry.buffer_bytes,
            predicted_peak_bytes=entry.predicted_peak_bytes, predicted_microbatch_ms=entry.microbatch_ms,
            input_names=stage.input_names, output_names=stage.output_names,
            sent_bytes=0 if option.last_unit == self.num_units - 1 else self.sent_bytes(option.last_unit),
            with_loss=runs_with_loss(self.planner(option.first_unit, option.last_unit)),
        )


def loss_unit(graph: Graph, whole: WholeStep, options: PlanOptions) -> int | None:
    """The unit of the projection whose output the model returns, where a last stage holding it is planned with its
    loss (``pipeline/last_stage.py``): None when the option turns chunking off, or under "auto" when its logits are
    too small a share of the whole step's peak to matter (as ``planning/loss_chunks.py`` weighs a loss's chunks)."""
    assert isinstance(graph.executable, fx.GraphModule)
    projection = returned_projection(graph.executable)
    if projection is None or options.loss_chunk_tokens == 0:
        return None
    if options.loss_chunk_tokens == "auto" and logits_negligible(
        whole.values[projection.name].nbytes, whole.baseline_peak_bytes
    ):
        return None
    return unit_positions(graph.executable)[projection.name]


def retained_bytes(planner: Planner, region_actions: Sequence[RegionAction]) -> int:
    """Bytes a microbatch's forward leaves alive for its backward under these regions (none: the unmodified stage):
    the forward tensors alive at the end of the last forward event, by the simulator (they wait there while other
    microbatches run)."""
    curve = memory_curve(planner.trace, planner.costs, region_actions)
    forward = [i for i, phase in enumerate(curve.phases) if phase is Phase.FORWARD]
    return curve.activation_bytes[forward[-1]] if forward else 0


class SeededBackward(torch.autograd.Function):
    """A scalar whose backward hands the given gradients to the stage's outputs: the backward a middle stage runs
    when the next stage sends gradients back (``torch.autograd.backward(outputs, grads)``), with no extra tensor."""

    @staticmethod
    def forward(ctx: Any, grads: tuple[torch.Tensor, ...], *outputs: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return outputs[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[Any, ...]:
        return (None, *ctx.grads)


def seeded_backward(stage_outputs: Sequence[torch.Tensor]) -> Callable[[Any], torch.Tensor]:
    """A loss function for a stage that is not the last: backward starts from gradients of its outputs."""
    generator = torch.Generator().manual_seed(0)
    grads = tuple(
        None if not t.is_floating_point()
        else torch.empty(t.shape, dtype=t.dtype, device="meta") if t.device.type == "meta"  # a fake trace's stage
        else torch.randn(t.shape, generator=generator, dtype=t.dtype).to(t.device)
        for t in stage_outputs
    )
    seeds = FakesBeside(grads)

    def loss(output: Any) -> torch.Tensor:
        flat = output if isinstance(output, tuple) else (output,)
        pairs = [(o, g) for o, g in zip(flat, seeds(flat)) if g is not None and o.requires_grad]
        return SeededBackward.apply(tuple(g for _, g in pairs), *(o for o, _ in pairs))

    return loss


def baseline_cuts(table: StageTable, strategy: str) -> tuple[int, ...]:
    """The cuts of a baseline split over every legal cut: as many layers per stage ("even-layers", torchtitan's
    default: what precedes the first layer stays with it, what follows the last with it), or as many parameter
    bytes per stage ("parameter-balanced", DeepSpeed's default)."""
    num_stages = table.request.num_stages
    legal = list(table.legal_cuts)
    pieces = unit_pieces(legal, table.num_units)
    if strategy == "even-layers":
        blocks = unit_blocks(table.graph)
        weights = [float(len({blocks[u].path for u in range(a, b + 1) if blocks[u].is_layer})) for a, b in pieces]
        if not any(weights):  # no stack of layers: every piece between blocks counts as one
            weights = [1.0] * len(pieces)
    else:
        weights = [float(parameter_bytes(table, first, last)) for first, last in pieces]
    total = sum(weights)
    cuts, running = [], 0.0
    for index, weight in enumerate(weights[:-1]):
        running += weight
        if len(cuts) < num_stages - 1 and running >= total * (len(cuts) + 1) / num_stages - 1e-9:
            cuts.append(legal[index])
    while len(cuts) < num_stages - 1:  # too few pieces reached a share: take the last cuts left
        cuts.append(next(c for c in reversed(legal) if c not in cuts))
        cuts.sort()
    return tuple(cuts)


def checked_cuts(cuts: tuple[int, ...], graph: Graph, values: dict, legal: tuple[int, ...]) -> tuple[int, ...]:
    """Cuts the user gave: ascending, inside the graph, and where only tensors cross (else a ValueError that says
    why and where the model can be cut)."""
    num_units = len(graph.units)
    if list(cuts) != sorted(set(cuts)) or cuts[0] < 0 or cuts[-1] >= num_units - 1:
        raise ValueError(
            f"split cuts must be ascending unit indices from 0 to {num_units - 2} (cut after that unit), got "
            f"{list(cuts)}; the model's block boundaries where it can be cut: {list(legal)}"
        )
    assert isinstance(graph.executable, fx.GraphModule)
    for cut in cuts:
        if problem := cut_problem(graph.executable, values, cut):
            raise ValueError(
                f"the model cannot be cut after unit {cut}: {problem} (torch.distributed.pipelining sends only "
                f"tensors between stages); block boundaries where it can be cut: {list(legal)}"
            )
    return cuts


def unit_pieces(cuts: list[int], num_units: int) -> list[tuple[int, int]]:
    bounds = [-1, *cuts, num_units - 1]
    return [(a + 1, b) for a, b in itertools.pairwise(bounds)]


def parameter_bytes(table: StageTable, first: int, last: int) -> int:
    stage = table.graph_of(first, last)
    return sum(p.nbytes for p in {id(p): p for p in stage.module.parameters()}.values())


@dataclass(frozen=True, slots=True)
class Block:
    path: str  # module path of the block a unit runs in ("" for glue ops at the root)
    is_layer: bool  # one of a stack's layers (a child of a ModuleList/Sequential), not a top-level module


def unit_blocks(graph: Graph) -> list[Block]:
    """The block each unit runs in: the outermost child of a ``ModuleList``/``Sequential`` on its module path (a
    transformer layer, a ResNet stage's block, a UNet's down block: the MLP ``Sequential`` inside a layer is part of
    the layer), else the top-level module it runs in; glue ops at the root are their own block."""
    model = graph.model
    containers = {name for name, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))}

    def block_of(path: str) -> Block:
        parts = path.split(".") if path else []
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if ".".join(parts[: depth - 1]) in containers and prefix not in containers:
                return Block(prefix, True)
        return Block(parts[0] if parts else "", False)

    return [block_of(unit.module_path) for unit in graph.units]


def block_boundaries(graph: Graph) -> list[int]:
    """Unit boundaries between blocks (``unit_blocks``). Cut after unit p = between units p and p+1."""
    keys = [block.path for block in unit_blocks(graph)]
    return [p for p in range(len(keys) - 1) if keys[p] != keys[p + 1]]


def spread(points: list[int], limit: int) -> list[int]:
    """At most ``limit`` of the points, evenly spaced (all of them when few; the middle one for a limit of 1)."""
    if len(points) <= limit:
        return points
    if limit == 1:
        return [points[len(points) // 2]]
    step = (len(points) - 1) / (limit - 1)
    return sorted({points[round(i * step)] for i in range(limit)})
