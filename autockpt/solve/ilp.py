"""Solve: (Profile, candidate regions, budget) -> the regions to checkpoint, via a PuLP integer program.

The model, in one paragraph. Each candidate region I is scored alone by the simulator: ``gain_I(e)`` is how many
bytes fewer (or, during its recomputation, more) the step holds at event e when only I is checkpointed, and
``cost_I`` its recompute milliseconds. Effects of disjoint regions are taken as additive. Every backward event gets
its own memory constraint; forward events are grouped per segment and each group is charged its largest baseline
bytes minus the smallest gain in it, which over-estimates memory. The simulator then scores the chosen
regions exactly as a plan, and the effective budget handed to the program is moved until the simulated peak sits
just under the user's budget. Optimality is with respect to this program and the candidate regions.

*Seed plans* (the baseline policies: every_n, sqrt_n, presets) are scored by the simulator too; their regions join
the candidates, and a seed plan under the budget that adds less step time than the program's answer is returned
instead, so a solved plan is never worse than a baseline at the same budget, whatever the program's approximations
miss.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pulp

from autockpt.errors import InfeasibleBudgetError
from autockpt.report import GB, format_bytes
from autockpt.simulate import simulate
from autockpt.solve.blocks import BlockProblem, build_block_program, prepare_blocks, solve_block_chain
from autockpt.solve.candidates import elementary_pieces
from autockpt.solve.structure import RepeatedBlocks
from autockpt.types import CaptureKind, CheckpointKind, Phase, PlanStatus, Profile, Region, SolverStats, Timeline

logger = logging.getLogger(__name__)



AUTO_CHECKPOINT = "auto"  # ``SolverOptions.checkpoint``: plan for every checkpoint kind, keep the cheaper plan


class SolverName:
    AUTO = "auto"
    CBC = "cbc"
    HIGHS = "highs"


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverOptions:
    solver: str = SolverName.AUTO  # "auto": HiGHS when highspy is installed, else PuLP's bundled CBC
    time_limit_s: float = 10.0  # per program; the best incumbent is used when it runs out
    relative_gap: float = 0.01  # 1 % of the added step time: proving the last fraction optimal costs minutes
    refinement_rounds: int = 5  # re-solves that move the effective budget towards the user's
    repeated_blocks: bool = True  # find identical blocks and solve each once (False: one flat program over all units)
    write_lp_path: str | None = None  # debug: write each program as an .lp file here
    # the checkpoint the plan is made for and applied with (``CheckpointKind``, or "auto": plan for each and keep
    # the plan with the smaller predicted overhead); the profile is calibrated for it
    checkpoint: CheckpointKind | str = AUTO_CHECKPOINT

    def __post_init__(self) -> None:
        if self.solver not in (SolverName.AUTO, SolverName.CBC, SolverName.HIGHS):
            raise ValueError(f"solver must be 'auto', 'cbc' or 'highs', got {self.solver!r}")
        if self.checkpoint != AUTO_CHECKPOINT:
            try:
                object.__setattr__(self, "checkpoint", CheckpointKind(self.checkpoint))  # a plain string works too
            except ValueError:
                kinds = ", ".join(repr(k.value) for k in CheckpointKind)
                raise ValueError(
                    f"checkpoint must be {AUTO_CHECKPOINT!r} or one of {kinds} (autockpt.CheckpointKind), got "
                    f"{self.checkpoint!r}"
                ) from None
        if not (self.time_limit_s > 0) or not (0 <= self.relative_gap < 1):
            raise ValueError(
                f"need time_limit_s > 0 and 0 <= relative_gap < 1, got {self.time_limit_s}, {self.relative_gap}"
            )

    def checkpoint_kinds(self, capture: CaptureKind) -> tuple[CheckpointKind, ...]:
        """The checkpoints to plan for, in order of preference on a tie of predicted overhead.

        "auto" leaves module-level captures on torch's checkpoint: a module's forward can read tensors it is not
        given, and only torch's gives those gradients through autograd (autockpt's accumulates them into ``.grad``).
        """
        if self.checkpoint != AUTO_CHECKPOINT:
            return (CheckpointKind(self.checkpoint),)
        if capture is CaptureKind.MODULE:
            return (CheckpointKind.TORCH_NON_REENTRANT,)
        return (CheckpointKind.TORCH_NON_REENTRANT, CheckpointKind.RECOMPUTE_FUNCTION)


_RETRIES_AT_ONE_BUDGET = 2  # programs re-solved at one effective budget, each without the sets that went over


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveResult:
    regions: tuple[Region, ...]
    timeline: Timeline
    baseline: Timeline
    min_feasible_bytes: int
    status: PlanStatus
    solver: str
    solve_time_s: float
    stats: SolverStats


@dataclass(frozen=True, slots=True)
class _Candidate:
    region: Region
    cost_ms: float
    gains: dict[int, int]  # block index -> smallest gain over the block (bytes; negative = extra memory)


@dataclass(slots=True)
class PreparedProblem:
    """What every budget's program shares: candidates scored by the simulator, event blocks, the memory floor.

    Scoring simulates every candidate alone, and the floor program does not depend on the budget, so a Planner keeps
    one of these and re-solves only the budget-dependent part.
    """

    profile: Profile
    baseline: Timeline
    scored: list[_Candidate]
    block_base: list[int]  # per event block: the largest baseline bytes in it
    block_of_event: list[int]  # per event: its event block
    blocks: BlockProblem | None = None  # repeated blocks found: the block program solves budgets above its floor
    seeds: list[_Seed] = field(default_factory=list)
    floors: dict[SolverOptions, _Floor] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SeedPlan:
    """A known plan (a baseline policy's regions) the solver must not do worse than."""

    name: str
    regions: tuple[Region, ...]


@dataclass(frozen=True, slots=True)
class _Seed:
    name: str
    regions: tuple[Region, ...]
    timeline: Timeline


@dataclass(frozen=True, slots=True)
class _Floor:
    regions: tuple[Region, ...]
    timeline: Timeline
    stats: SolverStats
    greedy: bool  # the solver found nothing in time: a greedy floor
    block_peak_bytes: int | None  # the lowest peak the block program reaches (None: no block program)


def prepare(
    profile: Profile,
    segments: Sequence[Region],
    candidates: Sequence[Region],
    seed_plans: Sequence[SeedPlan] = (),
    structure: RepeatedBlocks | None = None,
) -> PreparedProblem:
    """Score what every budget's program shares. With ``structure`` (repeated blocks found in the graph), each
    distinct block is also scored once for the block program, which then solves every budget it can reach; the flat
    program still finds the memory floor (its candidates may cross block boundaries, which can reach lower)."""
    baseline = simulate(profile, ())
    seeds = [_Seed(seed.name, seed.regions, simulate(profile, seed.regions)) for seed in seed_plans if seed.regions]
    known = set(candidates)
    extra = sorted({r for seed in seeds for r in seed.regions if r not in known}, key=lambda r: (r.first_unit, r.last_unit))
    blocks = _event_blocks(profile, segments)
    scored, lowest_single = _score_candidates(profile, [*candidates, *extra], baseline, blocks)
    if lowest_single is not None:
        # regions interact (a recomputation burst can sit on another region's gain), so the programs, which add
        # gains up, can miss that one region alone lowers the peak; scoring simulated it anyway
        seeds.append(lowest_single)
    return PreparedProblem(
        profile=profile,
        baseline=baseline,
        scored=scored,
        block_base=[max(baseline.event_bytes[e] for e in block) for block in blocks],
        block_of_event=_block_of_event(blocks, len(profile.events)),
        blocks=prepare_blocks(profile, structure, [*candidates, *extra], baseline) if structure else None,
        seeds=seeds,
    )


def solve(
    profile: Profile,
    segments: Sequence[Region],
    candidates: Sequence[Region],
    budget_bytes: int,
    options: SolverOptions | None = None,
    seed_plans: Sequence[SeedPlan] = (),
) -> SolveResult:
    """Cheapest set of non-overlapping candidate regions whose simulated peak is at most ``budget_bytes``."""
    return solve_prepared(prepare(profile, segments, candidates, seed_plans), budget_bytes, options)


def solve_prepared(problem: PreparedProblem, budget_bytes: int, options: SolverOptions | None = None) -> SolveResult:
    """``solve`` on a prepared problem (candidates already scored, floor solved once per solver options)."""
    options = options or SolverOptions()
    started = time.perf_counter()
    profile, baseline, scored = problem.profile, problem.baseline, problem.scored
    solver_name = _solver_name(options)

    floor = problem.floors.get(options)
    if floor is None:
        floor_programs: list[SolverStats] = []
        lowest_seed = min(problem.seeds, key=lambda seed: seed.timeline.peak_bytes, default=None)
        # the lowest seed's peak is a cutoff: branches that cannot beat it are pruned (about twice as fast on GPT-2)
        cutoff = lowest_seed.timeline.peak_bytes if lowest_seed is not None else None
        floor_regions, _ = _solve_program(
            problem, None, options, solver_name, floor_programs, peak_cutoff_bytes=cutoff, use_blocks=False
        )
        timed_out = _no_incumbent(floor_programs[-1])
        if timed_out:
            floor_regions = greedy_regions(profile, scored, None)
        starts = [(floor_regions, simulate(profile, floor_regions))]
        starts += [(seed.regions, seed.timeline) for seed in problem.seeds]
        block_floor_bytes = None
        if problem.blocks is not None:
            block_floor_regions, _ = _solve_program(problem, None, options, solver_name, floor_programs, use_blocks=True)
            starts.append((block_floor_regions, simulate(profile, block_floor_regions)))
            block_floor_bytes = starts[-1][1].peak_bytes
        floor_regions, floor_timeline, lowest_start = _lower_floor_locally(problem, starts)
        greedy = timed_out and lowest_start == 0  # the greedy plan (or a descent from it) is the floor
        floor = _Floor(floor_regions, floor_timeline, floor_programs[0], greedy, block_floor_bytes)
        problem.floors[options] = floor
    programs: list[SolverStats] = [floor.stats]
    fallbacks: list[str] = ["memory floor"] if floor.greedy else []
    floor_regions, floor_timeline = floor.regions, floor.timeline
    min_feasible = min(floor_timeline.peak_bytes, baseline.peak_bytes)

    if budget_bytes >= baseline.peak_bytes:
        return SolveResult(
            regions=(), timeline=baseline, baseline=baseline, min_feasible_bytes=min_feasible,
            status=PlanStatus.IDENTITY, solver=solver_name, solve_time_s=time.perf_counter() - started,
            stats=_summarise(programs),
        )
    if budget_bytes < min_feasible:
        raise InfeasibleBudgetError(
            f"budget {format_bytes(budget_bytes)} is below the smallest peak autockpt can reach for this model and input, "
            f"{format_bytes(min_feasible)} (static memory alone, parameters + buffers + gradients + inputs, is "
            f"{format_bytes(profile.static_bytes)}; the unmodified step peaks at {format_bytes(baseline.peak_bytes)}). "
            f"Use a budget of at least {min_feasible} bytes, or a smaller batch or sequence.",
            budget_bytes=budget_bytes,
            min_feasible_bytes=min_feasible,
        )

    best: tuple[tuple[Region, ...], Timeline, PlanStatus] | None = None
    if floor_timeline.peak_bytes <= budget_bytes:
        best = (floor_regions, floor_timeline, PlanStatus.FEASIBLE)
    # Bisection on the budget handed to the program: below search_low the program's plans were (or would be) too
    # tight or fit, above search_high the simulated peak went over the user's budget.
    effective = float(budget_bytes)
    search_low, search_high = -math.inf, math.inf
    # a plan this close under the budget is kept: each further program (~0.5-2 s) buys little recompute time
    close_enough_bytes = 0.01 * max(baseline.peak_bytes - profile.static_bytes, 0)
    over_budget: list[tuple[Region, ...]] = []  # plans the program chose that simulated over the budget
    last_overshoot_effective, retries_here = math.nan, 0
    # the block program solves in milliseconds; below its own floor only the flat program has plans
    use_blocks = floor.block_peak_bytes is not None and budget_bytes >= floor.block_peak_bytes
    for _ in range(options.refinement_rounds):
        regions, status = _solve_program(
            problem, effective, options, solver_name, programs, excluded=over_budget, use_blocks=use_blocks
        )
        if regions is None:  # the program is infeasible: it over-estimates memory, give it more room
            search_low = max(search_low, effective)
            effective = effective + 0.01 * budget_bytes if search_high == math.inf else (effective + search_high) / 2
            continue
        timeline = simulate(profile, regions)
        if timeline.peak_bytes <= budget_bytes:
            if best is None or timeline.overhead_ms < best[1].overhead_ms:
                best = (regions, timeline, status)
            search_low = max(search_low, effective)
            slack = budget_bytes - timeline.peak_bytes
            if slack <= close_enough_bytes:
                break
            effective = effective + slack if search_high == math.inf else (effective + search_high) / 2
        else:
            # the program adds gains up, but regions interact: rule this set out and try the same effective budget
            # again (the next-cheapest set may well fit) before tightening it
            over_budget.append(regions)
            retries_here = 0 if effective != last_overshoot_effective else retries_here + 1
            last_overshoot_effective = effective
            # (the block chain answers the same at the same budget: only the MILP can rule a set out)
            if retries_here < _RETRIES_AT_ONE_BUDGET and not use_blocks:
                continue
            search_high = min(search_high, effective)
            overshoot = timeline.peak_bytes - budget_bytes
            effective = (
                effective - overshoot - 0.001 * budget_bytes if search_low == -math.inf else (effective + search_low) / 2
            )
        if search_high - search_low < 0.001 * budget_bytes:
            break
    if any(_no_incumbent(p) for p in programs[1:]):  # a plan program timed out: the greedy plan may be cheaper
        regions = greedy_regions(profile, scored, budget_bytes)
        timeline = simulate(profile, regions)
        if timeline.peak_bytes <= budget_bytes and (best is None or timeline.overhead_ms < best[1].overhead_ms):
            best = (regions, timeline, PlanStatus.FEASIBLE)
            fallbacks.append("plan")
    if best is not None:
        best = _drop_unneeded_regions(profile, *best, budget_bytes)
        best = _swap_for_cheaper(problem, *best, budget_bytes)
    cheaper_seed = min(
        (seed for seed in problem.seeds if seed.timeline.peak_bytes <= budget_bytes
         and (best is None or seed.timeline.overhead_ms < best[1].overhead_ms)),
        key=lambda seed: seed.timeline.overhead_ms, default=None,
    )
    if cheaper_seed is not None:  # the program's approximations missed a plan at least this good
        best = (cheaper_seed.regions, cheaper_seed.timeline, PlanStatus.FEASIBLE)
        solver_name = f"{solver_name} (seed plan {cheaper_seed.name} was cheaper)"
        logger.info("the %s baseline plan adds less step time than the program's plan; using it", cheaper_seed.name)
    if fallbacks:
        logger.warning(
            "the %s solver found no solution within %.1f s for the %s; used a greedy plan instead (raise "
            "SolverOptions.time_limit_s for a better one)", solver_name, options.time_limit_s, " and the ".join(fallbacks),
        )
        solver_name = f"{solver_name} + greedy fallback ({', '.join(fallbacks)})"
    if best is None:
        raise InfeasibleBudgetError(
            f"no plan found under the budget {format_bytes(budget_bytes)}; the smallest simulated peak found is "
            f"{format_bytes(floor_timeline.peak_bytes)}. Raise the budget to at least {floor_timeline.peak_bytes} bytes.",
            budget_bytes=budget_bytes,
            min_feasible_bytes=floor_timeline.peak_bytes,
        )
    regions, timeline, status = best
    return SolveResult(
        regions=regions, timeline=timeline, baseline=baseline, min_feasible_bytes=min_feasible,
        status=status, solver=solver_name, solve_time_s=time.perf_counter() - started, stats=_summarise(programs),
    )


def greedy_regions(profile: Profile, candidates: Sequence[_Candidate], budget_bytes: int | None) -> tuple[Region, ...]:
    """Fallback when the solver returns no solution in time: add candidate regions in order of recompute ms per byte
    of their largest gain, keeping each one that lowers the simulated peak, until the peak is under ``budget_bytes``
    (None: as low as this order gets it)."""
    def cost_per_byte(candidate: _Candidate) -> float:
        return candidate.cost_ms / max(1, max(candidate.gains.values(), default=0))

    chosen: list[Region] = []
    peak = simulate(profile, ()).peak_bytes
    for candidate in sorted(candidates, key=cost_per_byte):
        if budget_bytes is not None and peak <= budget_bytes:
            break
        region = candidate.region
        if any(region.overlaps(other) for other in chosen):
            continue
        trial = sorted([*chosen, region], key=lambda r: r.first_unit)
        trial_peak = simulate(profile, trial).peak_bytes
        if trial_peak < peak:
            chosen, peak = trial, trial_peak
    return tuple(chosen)


_FLOOR_SEARCH_SIMULATIONS = 120  # in all, over every starting plan: about 1-5 ms each on a 12-layer GPT-2
_FLOOR_SEARCH_ADDITIONS = 8  # candidates tried per step, those freeing most at the current peak event first


def _lower_floor_locally(
    problem: PreparedProblem, starts: Sequence[tuple[tuple[Region, ...], Timeline]]
) -> tuple[tuple[Region, ...], Timeline, int]:
    """The lowest simulated peak a descent from any of ``starts`` (the programs' floors, the seed plans) reaches,
    and the index of the start it descended from.

    One step tries dropping each region, then adding each of the candidates that free most at the current peak
    event (replacing the regions they overlap), and takes the first that lowers the simulated peak. The programs add
    gains up; where regions interact (one region's recomputation burst sits on another's gain) they can stop above a
    plan that one more region, one fewer or a swap reaches.
    """
    simulations = 0

    def lower(regions: tuple[Region, ...], timeline: Timeline) -> tuple[tuple[Region, ...], Timeline] | None:
        nonlocal simulations
        block = problem.block_of_event[timeline.peak_event]
        helpful = sorted(
            (c for c in problem.scored if c.gains.get(block, 0) > 0 and c.region not in regions),
            key=lambda c: -c.gains[block],
        )[:_FLOOR_SEARCH_ADDITIONS]
        trials = [tuple(r for r in regions if r != dropped) for dropped in regions]
        trials += [_put_in(regions, c.region) for c in helpful]
        for trial in trials:
            if simulations >= _FLOOR_SEARCH_SIMULATIONS:
                return None
            simulations += 1
            trial_timeline = simulate(problem.profile, trial)
            if trial_timeline.peak_bytes < timeline.peak_bytes:
                return trial, trial_timeline
        return None

    order = sorted(range(len(starts)), key=lambda i: starts[i][1].peak_bytes)
    best = (*starts[order[0]], order[0])
    for index in order:
        step: tuple[tuple[Region, ...], Timeline] | None = starts[index]
        while step is not None:
            regions, timeline = step
            step = lower(regions, timeline)
        if timeline.peak_bytes < best[1].peak_bytes:
            best = (regions, timeline, index)
    return best


def _put_in(regions: tuple[Region, ...], region: Region) -> tuple[Region, ...]:
    """``regions`` with ``region`` in place of the ones it overlaps, in unit order."""
    return tuple(sorted([*(r for r in regions if not r.overlaps(region)), region], key=lambda r: r.first_unit))


_SWAP_SIMULATIONS = 40  # per plan: about 1-5 ms each on a 12-layer GPT-2


def _swap_for_cheaper(
    problem: PreparedProblem, regions: tuple[Region, ...], timeline: Timeline, status: PlanStatus, budget_bytes: int
) -> tuple[tuple[Region, ...], Timeline, PlanStatus]:
    """Put a candidate in place of the plan's regions it overlaps, then drop what the plan no longer needs; keep the
    first such plan that fits and adds less step time, and go on from it.

    The programs charge forward memory per group of events at its worst, so a region can look like it does not fit
    where the simulator shows it does. Swaps that save most are tried first; a swap that costs more on its own can
    still pay when it frees enough for other regions to go.
    """
    cost = {c.region: c.cost_ms for c in problem.scored}
    simulations = 0

    def swaps(current: tuple[Region, ...]) -> list[tuple[float, Region]]:
        """(cost change, candidate) for each candidate that overlaps the plan and costs less than all of it."""
        total = sum(cost.get(r, math.inf) for r in current)
        found = []
        for candidate in problem.scored:
            region = candidate.region
            overlapped = [r for r in current if r.overlaps(region)]
            if region in current or not overlapped or candidate.cost_ms >= total:
                continue
            found.append((candidate.cost_ms - sum(cost.get(r, math.inf) for r in overlapped), region))
        return sorted(found, key=lambda swap: swap[0])

    improved = True
    while improved and simulations < _SWAP_SIMULATIONS:
        improved = False
        for _, region in swaps(regions):
            if simulations >= _SWAP_SIMULATIONS:
                break
            trial = _put_in(regions, region)
            trial_timeline = simulate(problem.profile, trial)
            simulations += 1
            if trial_timeline.peak_bytes > budget_bytes:
                continue
            if trial_timeline.overhead_ms >= timeline.overhead_ms:
                simulations += len(trial)
                trial, trial_timeline, _ = _drop_unneeded_regions(
                    problem.profile, trial, trial_timeline, status, budget_bytes
                )
            if trial_timeline.overhead_ms < timeline.overhead_ms:
                regions, timeline, status, improved = trial, trial_timeline, PlanStatus.FEASIBLE, True
                break
    return regions, timeline, status


def _drop_unneeded_regions(
    profile: Profile, regions: tuple[Region, ...], timeline: Timeline, status: PlanStatus, budget_bytes: int
) -> tuple[tuple[Region, ...], Timeline, PlanStatus]:
    """One pass, most expensive region first: drop each region whose removal keeps the simulated peak in budget.

    The program charges forward memory per group of events at its worst, so it can checkpoint a region the exact
    simulation shows is not needed; dropping it only saves time.
    """
    def forward_ms(region: Region) -> float:
        return sum(profile.units[u].forward_ms for u in range(region.first_unit, region.last_unit + 1))

    kept = list(regions)
    for region in sorted(regions, key=forward_ms, reverse=True):
        trial = [r for r in kept if r != region]
        trial_timeline = simulate(profile, trial)
        if trial_timeline.peak_bytes <= budget_bytes and trial_timeline.overhead_ms <= timeline.overhead_ms:
            kept, timeline, status = trial, trial_timeline, PlanStatus.FEASIBLE
    return tuple(kept), timeline, status


def _no_incumbent(stats: SolverStats) -> bool:
    """The solver stopped (time limit) without any solution: not the same as a proven infeasible program."""
    return stats.status == pulp.LpSolution[pulp.LpSolutionNoSolutionFound]


def _summarise(programs: list[SolverStats]) -> SolverStats:
    """The last program's figures (the floor program's when no plan program ran), with how many were solved."""
    last = programs[-1]
    return SolverStats(
        status=last.status, relative_gap=last.relative_gap, variables=last.variables, constraints=last.constraints,
        programs=len(programs),
    )


def _event_blocks(profile: Profile, segments: Sequence[Region]) -> list[list[int]]:
    """Group events for the memory constraints.

    Backward events, where the peak and the recomputation bursts are, each get a constraint of their own; forward
    events are grouped per segment (forward memory only falls when something is checkpointed); events outside the
    graph (loss, autograd start) stand alone.
    """
    segment_of = {}
    for s, segment in enumerate(segments):
        for unit in range(segment.first_unit, segment.last_unit + 1):
            segment_of[unit] = s
    grouped: dict[int, list[int]] = {}
    singles: list[list[int]] = []
    for event in profile.events:
        if event.unit < 0 or event.phase is Phase.BACKWARD:
            singles.append([event.index])
        else:
            grouped.setdefault(segment_of[event.unit], []).append(event.index)
    return list(grouped.values()) + singles


def _block_of_event(blocks: list[list[int]], num_events: int) -> list[int]:
    block_of = [0] * num_events
    for index, block in enumerate(blocks):
        for event in block:
            block_of[event] = index
    return block_of


def _score_candidates(
    profile: Profile, candidates: Sequence[Region], baseline: Timeline, blocks: list[list[int]]
) -> tuple[list[_Candidate], _Seed | None]:
    """The candidates that free anything, with their gains per event block; and the one region whose checkpointing
    alone gives the lowest simulated peak (None when no single region lowers it)."""
    scored = []
    lowest_single: _Seed | None = None
    for region in candidates:
        alone = simulate(profile, (region,))
        if alone.peak_bytes < (lowest_single.timeline if lowest_single else baseline).peak_bytes:
            lowest_single = _Seed("single region", (region,), alone)
        gains_by_event = [b - a for b, a in zip(baseline.event_bytes, alone.event_bytes)]
        if max(gains_by_event) <= 0:
            continue  # never frees anything
        gains = {}
        for index, block in enumerate(blocks):
            gain = min(gains_by_event[e] for e in block)
            if gain != 0:
                gains[index] = gain
        scored.append(_Candidate(region, alone.overhead_ms, gains))
    return scored, lowest_single


def _solve_program(
    problem: PreparedProblem,
    budget: float | None,
    options: SolverOptions,
    solver_name: str,
    programs: list[SolverStats],
    *,
    peak_cutoff_bytes: int | None = None,
    excluded: Sequence[tuple[Region, ...]] = (),
    use_blocks: bool = False,
) -> tuple[tuple[Region, ...] | None, PlanStatus]:
    """budget None: minimise the peak (the memory floor), looking only for peaks under ``peak_cutoff_bytes`` (HiGHS).
    ``excluded``: region sets the answer must not be. Returns (regions or None if infeasible, status) and appends the
    program's statistics to ``programs``. ``use_blocks``: the block program (the chain DP when it applies) instead of
    the flat one."""
    if use_blocks and problem.blocks is not None and budget is not None:
        regions = solve_block_chain(problem.blocks, int(budget))
        if regions is not NotImplemented:
            programs.append(SolverStats(
                status="Optimal Solution Found (block chain)" if regions is not None else "No Solution Exists (block chain)",
                relative_gap=0.0, variables=0, constraints=0, programs=1,
            ))
            return regions, PlanStatus.OPTIMAL
    if use_blocks and problem.blocks is not None:
        prob, chosen_regions = build_block_program(problem.blocks, budget, excluded)
    else:
        prob, chosen_regions = _flat_program(problem.scored, problem.block_base, budget, excluded)
    if options.write_lp_path:
        prob.writeLP(f"{options.write_lp_path}.{prob.name}.lp")
    floor = budget is None
    cutoff_gb = peak_cutoff_bytes / GB if floor and peak_cutoff_bytes is not None else None
    solver = _make_solver(solver_name, options, objective_cutoff=cutoff_gb)
    prob.solve(solver)
    programs.append(
        SolverStats(
            status=pulp.LpSolution.get(prob.sol_status, str(prob.sol_status)), relative_gap=_mip_gap(prob, solver_name),
            variables=len(prob.variables()), constraints=len(prob.constraints), programs=1,
        )
    )
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return ((), PlanStatus.FEASIBLE) if floor else (None, PlanStatus.FEASIBLE)
    proven = prob.sol_status == pulp.LpSolutionOptimal
    return chosen_regions(), PlanStatus.OPTIMAL if proven else PlanStatus.FEASIBLE


def _flat_program(
    candidates: list[_Candidate], block_base: list[int], budget: float | None, excluded: Sequence[tuple[Region, ...]]
) -> tuple[pulp.LpProblem, Callable[[], tuple[Region, ...]]]:
    """One variable per candidate region, one memory row per event block; and a function reading the answer."""
    prob = pulp.LpProblem("autockpt_floor" if budget is None else "autockpt_plan", pulp.LpMinimize)
    # w_i: 1 if candidate region i is checkpointed
    w = [pulp.LpVariable(f"w_{i}", cat=pulp.LpBinary) for i in range(len(candidates))]
    peak = None
    if budget is None:
        # P: the peak bytes to minimise (in GB so coefficients stay well scaled). Memory only: the floor must not
        # depend on timing noise in the profile.
        peak = pulp.LpVariable("peak_gb", lowBound=0)
        prob += peak
    else:
        prob += pulp.LpAffineExpression([(w[i], c.cost_ms) for i, c in enumerate(candidates)])

    # [Constraint] checkpoint regions do not overlap
    num_units = max((c.region.last_unit for c in candidates), default=-1) + 1
    for k, piece in enumerate(elementary_pieces(num_units, [c.region for c in candidates])):
        covering = [w[i] for i, c in enumerate(candidates) if piece.first_unit in c.region]
        if len(covering) > 1:
            prob += pulp.lpSum(covering) <= 1, f"no_overlap_piece_{k}"

    # [Constraint] not a set already simulated over the budget (a no-good cut: at least one of its regions changes)
    position = {c.region: i for i, c in enumerate(candidates)}
    for k, regions in enumerate(excluded):
        if regions and all(r in position for r in regions):
            inside = {position[r] for r in regions}
            terms = [(v, 1 if i in inside else -1) for i, v in enumerate(w)]
            prob += pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintLE, f"not_plan_{k}", len(inside) - 1)

    # [Constraint] predicted bytes of every event block under the budget
    by_block: dict[int, list[tuple[int, int]]] = {}
    for i, c in enumerate(candidates):
        for block, gain in c.gains.items():
            by_block.setdefault(block, []).append((i, gain))
    for block, base in enumerate(block_base):
        terms = by_block.get(block, [])
        if budget is not None and base + sum(-gain for _, gain in terms if gain < 0) <= budget:
            continue  # holds whatever is chosen: leaving it out keeps the program small
        # base - sum(gain_i * w_i) <= budget (or <= P GB for the floor); built as one affine expression, which is
        # much faster in PuLP than summing products
        expression = pulp.LpAffineExpression([(w[i], -gain) for i, gain in terms], constant=base)
        if peak is not None:
            expression.addterm(peak, -GB)
        prob += pulp.LpConstraint(expression, pulp.LpConstraintLE, f"memory_block_{block}", budget or 0)

    def chosen_regions() -> tuple[Region, ...]:
        chosen = (c.region for i, c in enumerate(candidates) if (w[i].value() or 0) > 0.5)
        return tuple(sorted(chosen, key=lambda r: r.first_unit))

    return prob, chosen_regions


def _mip_gap(prob: pulp.LpProblem, solver_name: str) -> float | None:
    """The proven relative gap; HiGHS reports it through its model object, PuLP's CBC command does not."""
    model = getattr(prob, "solverModel", None)
    if solver_name != SolverName.HIGHS or model is None:
        return None
    try:
        gap = float(model.getInfo().mip_gap)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
    return gap if math.isfinite(gap) else None


def _solver_name(options: SolverOptions) -> str:
    if options.solver != SolverName.AUTO:
        return options.solver
    return SolverName.HIGHS if pulp.HiGHS(msg=False).available() else SolverName.CBC


def _make_solver(name: str, options: SolverOptions, *, objective_cutoff: float | None = None) -> pulp.LpSolver:
    """``objective_cutoff``: HiGHS prunes every branch whose bound is above it (CBC through PuLP: ignored)."""
    if name == SolverName.HIGHS:
        cutoff = {} if objective_cutoff is None else {"objective_bound": objective_cutoff}
        solver = pulp.HiGHS(msg=False, timeLimit=options.time_limit_s, gapRel=options.relative_gap, **cutoff)
        if not solver.available():
            raise ValueError("solver='highs' needs the highspy package: pip install highspy (or use solver='cbc')")
        return solver
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=options.time_limit_s, gapRel=options.relative_gap)


