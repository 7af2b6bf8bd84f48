"""The solver contract: the problem every algorithm reads and the result the solver returns.

A ``Problem`` is one measured step (``StepTrace``), the prices of the actions (``CostModel``), the action the plan is
made for, and the candidate regions scored alone by the simulator (``prepare.py`` builds it). The default solver
(``default.solve_prepared``) turns a problem and a budget into a ``SolveResult``: the regions, their simulated
timeline, and how they were found. It combines the algorithms of this package (``milp``, ``blocks``, ``greedy``,
``baselines``), each a ``Program`` or a function over a ``Problem``, and the simulator (``problem.simulate``) judges
them all; ``exact`` is the reference the tests and experiments judge them by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from autockpt.core.simulate import machinery_ms, simulate
from autockpt.core.solve.block_types import BlockProblem
from autockpt.types import (
    Action,
    CaptureKind,
    CostModel,
    PlanStatus,
    Region,
    RegionAction,
    SolverStats,
    StepTrace,
    Timeline,
)

AUTO_CHECKPOINT = "auto"  # the checkpoint choice that plans for every recompute action and keeps the cheaper plan


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
    # Deprecated here: the checkpoint choice steers profiling and rewriting, so it is an argument of
    # optimize/plan/Planner (``checkpoint=``). Still read when that argument is not given.
    checkpoint: Action | str = AUTO_CHECKPOINT

    def __post_init__(self) -> None:
        if self.solver not in (SolverName.AUTO, SolverName.CBC, SolverName.HIGHS):
            raise ValueError(f"solver must be 'auto', 'cbc' or 'highs', got {self.solver!r}")
        object.__setattr__(self, "checkpoint", checked_checkpoint(self.checkpoint))
        if not (self.time_limit_s > 0) or not (0 <= self.relative_gap < 1):
            raise ValueError(
                f"need time_limit_s > 0 and 0 <= relative_gap < 1, got {self.time_limit_s}, {self.relative_gap}"
            )


def checked_checkpoint(choice: Action | str) -> Action | str:
    """``"auto"`` or a recompute action (a plain string such as ``"recompute_function"`` works too)."""
    if choice == AUTO_CHECKPOINT:
        return AUTO_CHECKPOINT
    try:
        action = Action(choice)
    except ValueError:
        action = None
    if action is None or not action.recomputes:
        kinds = ", ".join(repr(a.value) for a in Action if a.recomputes)
        raise ValueError(
            f"checkpoint must be {AUTO_CHECKPOINT!r} or one of {kinds} (autockpt.Action), got {choice!r}"
        ) from None
    return action


def recompute_actions(choice: Action | str, capture: CaptureKind) -> tuple[Action, ...]:
    """The recompute actions to plan for, in order of preference on a tie of predicted overhead.

    "auto" leaves module-level captures on torch's checkpoint: a module's forward can read tensors it is not given,
    and only torch's gives those gradients through autograd (autockpt's accumulates them into ``.grad``).
    """
    choice = checked_checkpoint(choice)
    if choice != AUTO_CHECKPOINT:
        return (Action(choice),)
    if capture is CaptureKind.MODULE:
        return (Action.RECOMPUTE_TORCH,)
    return (Action.RECOMPUTE_TORCH, Action.RECOMPUTE_OWN)


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveResult:
    region_actions: tuple[RegionAction, ...]  # in unit order: each chosen region and what happens to what it saves
    action: Action  # the recompute action planned for (with a pool, regions may recompute the other way or offload)
    timeline: Timeline
    baseline: Timeline
    min_feasible_bytes: int
    status: PlanStatus
    solver: str
    solve_time_s: float
    stats: SolverStats
    floor_complete: bool = True  # False: min_feasible_bytes is the quick floor's (``solve/default.py``)
    # the plan whose peak is min_feasible_bytes (() when none lowers the unmodified peak; None: not known, a joint
    # program's floor): what the plan's summary says sets the floor
    floor_region_actions: tuple[RegionAction, ...] | None = None

    @property
    def regions(self) -> tuple[Region, ...]:
        return tuple(ra.region for ra in self.region_actions)


@dataclass(frozen=True, slots=True)
class ScoredCandidate:
    region: Region
    cost_ms: float
    gains: dict[int, int]  # event block index -> smallest gain over the block (bytes; negative = extra memory)
    pool_bytes: int = 0  # host pool bytes the region needs alone (offload; 0 for recompute)


@dataclass(frozen=True, slots=True)
class SeedPlan:
    """A known plan (a baseline policy's regions) the solver must not do worse than."""

    name: str
    regions: tuple[Region, ...]


@dataclass(frozen=True, slots=True)
class Seed:
    """A seed plan with its simulated timeline."""

    name: str
    regions: tuple[Region, ...]
    timeline: Timeline


@dataclass(frozen=True, slots=True)
class Floor:
    """The lowest simulated peak found for a problem, once per solver options."""

    regions: tuple[Region, ...]
    timeline: Timeline
    stats: SolverStats
    greedy: bool  # the solver found nothing in time: a greedy floor
    block_peak_bytes: int | None  # the lowest peak the block program reaches (None: no block program)
    block_start: tuple[tuple[Region, ...], Timeline] | None = None  # the block program's floor plan, simulated
    complete: bool = True  # False: the quick floor (no flat program solved), ``solve/default.py``


@dataclass(frozen=True, slots=True)
class Scorer:
    """The simulator for plans whose every region gets ``action``: how every algorithm's plans are judged."""

    trace: StepTrace
    costs: CostModel
    action: Action

    def simulate(self, regions: Sequence[Region]) -> Timeline:
        return simulate(self.trace, self.costs, region_actions(regions, self.action))

    def machinery_ms(self, regions: Sequence[Region]) -> float:
        return machinery_ms(self.trace, self.costs, region_actions(regions, self.action))


@dataclass(slots=True)
class Problem:
    """What every budget's program shares: candidates scored by the simulator, event blocks, the memory floor.

    Scoring simulates every candidate alone, and the floor does not depend on the budget, so a Planner keeps one of
    these per action and re-solves only the budget-dependent part.
    """

    scorer: Scorer
    baseline: Timeline
    scored: list[ScoredCandidate]
    block_base: list[int]  # per event block: the largest baseline bytes in it
    block_of_event: list[int]  # per event: its event block
    blocks: BlockProblem | None = None  # repeated blocks found: the block program solves budgets above its floor
    seeds: list[Seed] = field(default_factory=list)
    floors: dict[SolverOptions, Floor] = field(default_factory=dict)

    @property
    def trace(self) -> StepTrace:
        return self.scorer.trace

    @property
    def action(self) -> Action:
        return self.scorer.action

    def simulate(self, regions: Sequence[Region]) -> Timeline:
        """The simulator's timeline of ``regions`` under this problem's action."""
        return self.scorer.simulate(regions)

    def fits(self, timeline: Timeline, budget_bytes: int) -> bool:
        """A plan fits when its simulated peak is within the budget."""
        return timeline.peak_bytes <= budget_bytes

    @staticmethod
    def region_of(item: Region) -> Region:
        """The region of one element of a plan (a plan of this problem is its regions)."""
        return item

    @property
    def items(self) -> list[Region]:
        """Per scored candidate, the plan item it stands for: its region."""
        return [c.region for c in self.scored]


class PlanSearch(Protocol):
    """What ``refine`` and the local passes need from a problem: a plan is a sequence of items (regions under the
    problem's one action, or regions with their own action, ``joint.JointProblem``) that the simulator scores."""

    @property
    def baseline(self) -> Timeline: ...

    @property
    def trace(self) -> StepTrace: ...

    def simulate(self, plan: Sequence[Any]) -> Timeline: ...

    def fits(self, timeline: Timeline, budget_bytes: int) -> bool: ...

    def region_of(self, item: Any) -> Region: ...


class FloorSearch(PlanSearch, Protocol):
    """What the floor's local descent also needs: the candidates, each with the plan item it stands for, and the
    event block of each event."""

    scored: list[ScoredCandidate]
    block_of_event: list[int]

    @property
    def items(self) -> Sequence[Any]: ...


def region_actions(regions: Sequence[Region], action: Action) -> tuple[RegionAction, ...]:
    return tuple(RegionAction(region=r, action=action) for r in regions)


@dataclass(frozen=True, kw_only=True, slots=True)
class ProgramAnswer:
    """What one program (at one effective budget, or for the floor) chose."""

    regions: tuple[Region, ...] | tuple[RegionAction, ...] | None  # None: no solution at that budget
    status: PlanStatus  # OPTIMAL when the program's answer is proven optimal (for the program, not the simulator)
    stats: SolverStats


class Program(Protocol):
    """One integer program over a problem: at ``budget`` (bytes the program's memory model must fit; None: the lowest
    peak it can reach), not any of the ``excluded`` region sets."""

    def __call__(
        self,
        problem: Any,
        budget: float | None,
        options: SolverOptions,
        solver: str,
        *,
        excluded: Sequence[tuple[Any, ...]] = (),
    ) -> ProgramAnswer: ...


def summarise_programs(programs: list[SolverStats]) -> SolverStats:
    """The last program's figures (the floor program's when no plan program ran), with how many were solved."""
    last = programs[-1]
    return SolverStats(
        status=last.status, relative_gap=last.relative_gap, variables=last.variables, constraints=last.constraints,
        programs=len(programs),
    )


NO_PROGRAM = SolverStats(status="no program", relative_gap=None, variables=0, constraints=0, programs=0)
