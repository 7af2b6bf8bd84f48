"""The loss computed in chunks, as a planner weighs it (issue 48): beside the captured program, the same program with
its output projection and cross-entropy run over chunks of tokens (``measure/chunked_tail.py``).

Each chunked program is a program of its own: captured graph with the tail replaced, traced by the trace source that
traced the model (measured or fake, so its bytes are exact as any trace's), priced alike and timed on the captured
program's measurements where those are a real step's (``build.priced_against``), and planned by a planner of its
own (recompute and offload, under the same budget). The planner the user holds solves its own program and, when
the budget is under its unmodified peak, each chunked one, and returns the plans of the program whose cheapest plan
is predicted fastest (``chosen``): the chunk is part of the decision, priced by the trace (the logits made again in
backward are in the chunked program's step) and bounded by the same budget. The floor stated is the lowest of all
programs.

``PlanOptions.loss_chunk_tokens``: "auto" weighs ``AUTO_CHUNK_COUNTS`` (the tokens in 4 and in 32 chunks); a number
weighs that chunk alone, and the captured program is then not weighed; 0 weighs none. A plan records its chunk
(``Plan.loss_chunk_tokens``) and ``apply_plan`` makes the same program from the model
(``measure.chunked_tail.captured_program``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from autockpt.core.simulate import simulate
from autockpt.errors import InfeasibleBudgetError
from autockpt.measure.chunked_tail import with_chunked_loss
from autockpt.measure.loss_tail import LossTail, find_loss_tail
from autockpt.planning.build import BuiltStep, built_for_graph, priced_against
from autockpt.planning.options import PlanOptions
from autockpt.planning.policy import PlanningContext, breakdown_at
from autockpt.planning.solving import with_pool_needed
from autockpt.records.plan import Plan

AUTO_CHUNK_COUNTS = (4, 32)  # "auto": the tokens in this many chunks (each a candidate the planner weighs)
# "auto" weighs no chunk where the logits are too small to matter: chunking frees at most a few logit-sized tensors
# (the logits, their float32 upcast, log-softmax and gradient: LOSS_PHASE_COPIES of them at most), and a saving
# under NEGLIGIBLE_SHARE of the unmodified peak is not worth a trace per candidate (a classifier's 10 classes)
LOSS_PHASE_COPIES = 8
NEGLIGIBLE_SHARE = 0.01
NOT_CHUNKED = "loss: not computed in chunks"  # how a plan's note on why begins


class LossProgramsOwner(Protocol):
    """What this module reads of a ``Planner`` (a protocol: no import of planner.py, no circle)."""

    loss_chunk_tokens: int
    loss_programs: LossPrograms | None
    trace: Any
    costs: Any

    @property
    def context(self) -> PlanningContext: ...


@dataclasses.dataclass(kw_only=True, slots=True)
class LossPrograms:
    """The chunked programs a planner weighs beside its own: their chunks, how to make the planner of each (made when
    first needed: each costs one more trace), the ones made, and what is known of each program's floor: the floor
    once searched (``floors``), else a bound under it (``floor_bounds``: a refusal's, whose search was not needed)."""

    chunk_tokens: tuple[int, ...]
    make: Callable[[int], Any]  # chunk tokens -> the Planner of that program
    made: dict[int, Any] = dataclasses.field(default_factory=dict)
    floors: dict[int, int] = dataclasses.field(default_factory=dict)  # chunk tokens (0: the planner's own) -> bytes
    floor_bounds: dict[int, int] = dataclasses.field(default_factory=dict)  # chunk tokens -> its floor is at least

    def planner(self, chunk_tokens: int) -> Any:
        if chunk_tokens not in self.made:
            self.made[chunk_tokens] = self.make(chunk_tokens)
        return self.made[chunk_tokens]

    def floor_at_least(self, chunk_tokens: int) -> int:
        """What is known of the program's floor: the floor itself, a bound under it, or 0 (nothing yet)."""
        return self.floors.get(chunk_tokens, self.floor_bounds.get(chunk_tokens, 0))


def planner_of_programs(
    built: BuiltStep, options: PlanOptions, make: Callable[[BuiltStep, int], Any], *, loss_outside: bool,
    on_stage: Callable[[str], None] | None,
) -> Any:
    """The planner ``Planner.from_model`` returns for ``built`` (``make(built, chunk_tokens)`` makes one): with the
    chunked programs of its loss tail to weigh ("auto"), the program of a fixed chunk alone, or its own program with
    a note saying why the loss is not chunked where one might expect it to be."""
    search = find_loss_tail(built.graph)
    tail = search.tail if search.tail is None or search.tail.tokens else with_tokens_from_trace(search.tail, built)
    chunks = chunk_candidates(tail, options.loss_chunk_tokens, built.trace.baseline_peak_bytes)
    # the chunked programs are made when first weighed, from the captured program (which no rewrite edits: each
    # rewrite takes a copy of it, ``Planner.apply``)

    def program(chunk_tokens: int) -> Any:
        if on_stage is not None:
            on_stage("profile")
        assert tail is not None
        chunked = with_chunked_loss(built.graph, tail, chunk_tokens).graph
        program_built = built_for_graph(built, chunked, options)
        if options.loss_chunk_tokens == "auto":  # weighed against the captured program: timed on its measurements
            program_built = priced_against(built, built.graph, program_built)
        return make(program_built, chunk_tokens)

    if options.loss_chunk_tokens != "auto" and chunks:
        return program(chunks[0])
    planner = make(built, 0)
    # said where a chunked loss was asked for, or could be expected: a loss_fn, a cross-entropy the search refused
    expected = loss_outside or options.loss_chunk_tokens != "auto" or not search.reason.startswith(
        ("no cross-entropy", "captured at module level"))
    if options.loss_chunk_tokens != 0 and search.tail is None and expected:
        planner.notes += (f"{NOT_CHUNKED}: {search.reason}",)
    if chunks:
        planner.loss_programs = LossPrograms(chunk_tokens=chunks, make=program)
    return planner


def with_tokens_from_trace(tail: LossTail, built: BuiltStep) -> LossTail:
    """``tail`` with its token count read from the trace where the capture recorded no shapes (fx): the projection's
    output bytes over the vocabulary and the bytes of one logit (the weight's dtype, or autocast's)."""
    unit = next((u.index for u in built.graph.units if u.name == tail.projection), None)
    if unit is None:
        return tail
    weight = built.graph.executable.get_parameter(tail.weight)
    tokens, logits_bytes = traced_logits(built.graph, built.trace, unit, weight)
    return dataclasses.replace(tail, tokens=tokens, logits_bytes=logits_bytes)


def traced_logits(graph: Any, trace: Any, unit: int, weight: Any) -> tuple[int, int]:
    """(tokens, bytes) of the logits the projection at ``unit`` made in ``trace``, with the weight it read (rows:
    the vocabulary): its output bytes over the bytes of one row of logits, in the weight's dtype or autocast's."""
    dtype = next((dtype for device, enabled, dtype in graph.autocast
                  if enabled and device == weight.device.type), weight.dtype)
    output_bytes = trace.units[unit].output_bytes
    return output_bytes // (weight.shape[0] * dtype.itemsize), output_bytes


def chunk_candidates(tail: LossTail | None, option: int | str, baseline_peak_bytes: int) -> tuple[int, ...]:
    """The chunks (tokens) weighed for ``tail`` under ``PlanOptions.loss_chunk_tokens``, largest first; under "auto"
    none where the loss phase's logit-sized tensors are a negligible share of ``baseline_peak_bytes`` (the unmodified
    step's peak)."""
    if tail is None:
        return ()
    return chunks_for(tail.tokens, tail.logits_bytes, option, baseline_peak_bytes)


def chunks_for(tokens: int, logits_bytes: int, option: int | str, baseline_peak_bytes: int) -> tuple[int, ...]:
    """``chunk_candidates`` of a loss over ``tokens`` rows of logits of ``logits_bytes`` (any step that has them: a
    captured tail, or an FSDP2 root's projection)."""
    if option == 0:
        return ()
    if option != "auto":
        return (int(option),)
    if tokens < 2:  # an fx capture records no shapes (0), or one token: nothing to split
        return ()
    if logits_negligible(logits_bytes, baseline_peak_bytes):
        return ()
    return tuple(sorted({math.ceil(tokens / count) for count in AUTO_CHUNK_COUNTS} - {tokens}, reverse=True))


def logits_negligible(logits_bytes: int, baseline_peak_bytes: int) -> bool:
    """Whether chunking a loss over these logits frees a negligible share of the unmodified step's peak ("auto"
    then weighs no chunk): at most ``LOSS_PHASE_COPIES`` logit-sized tensors under ``NEGLIGIBLE_SHARE`` of it."""
    return LOSS_PHASE_COPIES * logits_bytes < NEGLIGIBLE_SHARE * baseline_peak_bytes


def weighs(planner: LossProgramsOwner, budget_bytes: int) -> bool:
    """Whether ``budget_bytes`` is one where chunked programs are weighed: under the unmodified program's peak (above
    it, nothing recomputed and nothing chunked is the fastest plan)."""
    return planner.loss_programs is not None and budget_bytes < planner.trace.baseline_peak_bytes


def chosen(planner: LossProgramsOwner, budget_bytes: int, solve: Callable[[Any], Sequence[Plan]]) -> list[Plan]:
    """The plans ``solve`` gives for the program (the planner's own, or one of its chunked ones) whose cheapest plan
    is predicted fastest, each stating the lowest floor of all programs; ``InfeasibleBudgetError`` from the program
    with the lowest floor when none has a plan, with the host pool that would make the budget feasible (``solve``
    leaves that out: ``solving.solve_each(pool_hint=False)``)."""
    programs = planner.loss_programs
    assert programs is not None
    candidates: list[list[Plan]] = []
    refusals: dict[int, InfeasibleBudgetError] = {}
    every = (0, *programs.chunk_tokens)
    for chunk_tokens in every:
        if programs.floor_at_least(chunk_tokens) > budget_bytes and any(
            programs.floor_at_least(other) <= budget_bytes for other in every if other != chunk_tokens
        ):
            continue  # its floor, or a bound under it, is above the budget, and another program may have a plan
        program = program_of(planner, chunk_tokens)
        try:
            plans = [as_planned_by(planner, the_plan, chunk_tokens) for the_plan in solve(program)]
        except InfeasibleBudgetError as error:
            refusals[chunk_tokens] = error
            continue
        programs.floors[chunk_tokens] = min(the_plan.min_feasible_bytes for the_plan in plans)
        candidates.append(plans)
    lowest_refusal = record_refused_floors(programs, refusals)
    floor = min(programs.floors.values())
    if not candidates:
        assert lowest_refusal is not None
        # the programs were solved without the host pool's hint (a joint solve each): the refusal raised gets it
        chunk_tokens, error = lowest_refusal
        raise with_pool_needed(program_of(planner, chunk_tokens), error, budget_bytes)
    best = min(candidates, key=lambda plans: min(the_plan.predicted_overhead for the_plan in plans))
    at_floor = next((plans[0].floor_breakdown for plans in candidates if plans[0].min_feasible_bytes == floor), None)
    return [dataclasses.replace(the_plan, min_feasible_bytes=floor, floor_breakdown=at_floor or the_plan.floor_breakdown)
            for the_plan in best]


def record_refused_floors(
    programs: LossPrograms, refusals: dict[int, InfeasibleBudgetError]
) -> tuple[int, InfeasibleBudgetError] | None:
    """Record the floor of each refused program, searching it (a refusal under the static bytes searches it when
    read) only where it may be the lowest: in the order of what is known of each, and not once a floor found is at or
    under a program's bound (a floor query then searches the program that reaches the bound alone: tens of seconds
    saved per program on billion-parameter models). The refusal with the lowest floor and its program's chunk (None:
    none refused)."""
    lowest = min(programs.floors.values(), default=None)
    lowest_refusal: tuple[int, InfeasibleBudgetError] | None = None
    # on a tie, the smallest chunk first (its logits at a time are the fewest: its floor the likeliest lowest), the
    # captured program (0) last
    order = sorted(refusals.items(), key=lambda item: (item[1].known_bound_bytes, item[0] == 0, item[0]))
    for chunk_tokens, error in order:
        if lowest is not None and error.known_bound_bytes >= lowest and not error.floor_searched:
            programs.floor_bounds[chunk_tokens] = error.known_bound_bytes  # its floor is no lower: not searched
            continue
        programs.floors[chunk_tokens] = error.min_feasible_bytes
        if lowest_refusal is None or error.min_feasible_bytes < lowest_refusal[1].min_feasible_bytes:
            lowest_refusal = (chunk_tokens, error)
        lowest = error.min_feasible_bytes if lowest is None else min(lowest, error.min_feasible_bytes)
    return lowest_refusal


def lowest_floor_program(planner: LossProgramsOwner) -> Any:
    """The program (planner) whose floor is lowest of those solved so far: the floor's own plans are its."""
    programs = planner.loss_programs
    if programs is None or not programs.floors:
        return planner
    return program_of(planner, min(programs.floors, key=programs.floors.__getitem__))


def program_of(planner: LossProgramsOwner, chunk_tokens: int) -> Any:
    """The planner of the program with the loss in chunks of ``chunk_tokens`` (0: ``planner`` itself, the captured
    program's), made when first asked for."""
    assert planner.loss_programs is not None
    return planner if chunk_tokens == 0 else planner.loss_programs.planner(chunk_tokens)


def as_planned_by(planner: LossProgramsOwner, the_plan: Plan, chunk_tokens: int) -> Plan:
    """A chunked program's plan as the user's planner states it: the unmodified step (peak, time, breakdown) is the
    model's own program, and the predicted overhead is over that step (the chunked program's own step, the logits
    made again in backward included, is part of it)."""
    if chunk_tokens == 0:
        return the_plan
    context = planner.context
    predicted_step_ms = the_plan.baseline_step_ms * (1 + the_plan.predicted_overhead)
    reference_ms = planner.trace.step_ms
    return dataclasses.replace(
        the_plan,
        loss_chunk_tokens=chunk_tokens,
        baseline_peak_bytes=simulate(planner.trace, planner.costs, ()).peak_bytes,
        baseline_step_ms=reference_ms,
        predicted_overhead=predicted_step_ms / reference_ms - 1 if reference_ms > 0 else the_plan.predicted_overhead,
        memory_before=context.memory_before,
        baseline_breakdown=breakdown_at(context, context.memory_before),
    )
