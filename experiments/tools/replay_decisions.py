"""Decisions on recorded inputs: the planner's regions, actions and predicted peaks, old code against new.

Measured times move from run to run, so a change that must not change behaviour is checked on *recorded* inputs:

    python -m experiments.tools.replay_decisions record --out experiments/results/replay/decisions.json.gz
    python -m experiments.tools.replay_decisions replay experiments/results/replay/decisions.json.gz

``record`` captures and traces every case once (the zoo models at size "small"; the offload benchmark's two decoders
at its "small" size, also with a host pool; the stage planners of the pipeline benchmark's GPT-2-style decoder at 2
stages), stores each planner's graph values, step trace and action prices, and the plans the planner made from them
at four budgets (the floor of its full search, and 10 %, 30 % and 60 % of the way from that floor to the
unmodified peak) for each recompute action the capture allows (a module-level capture: torch's checkpoint only).

``replay`` captures each case's model again (capture is deterministic: the models are built from the same seeds),
checks that the graph is the recorded one, puts the recorded trace and prices in place of the ones it measured
(``with_recorded_values``) and plans the same budgets: the regions, their actions, the planned action, the predicted
peaks, the floors and the statuses must be the same. It prints one line per case and exits with 1 on any difference.

Solves run with a time limit no program reaches on these cases (``SOLVER_OPTIONS``), so that every program ends on
its gap and the answers do not depend on the machine's speed; the default 10 s cut the transformer's off.

After a refactor of the planner's construction only ``planner_for`` and ``with_recorded_values`` should need
adapting (and ``_decisions`` if the attributes it sets move).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import autockpt
from autockpt.core.solve.base import SolverOptions, recompute_actions
from autockpt.errors import InfeasibleBudgetError
from autockpt.planning import solving
from autockpt.records import codec, fingerprint
from autockpt.types import Action, CaptureKind, CostModel, StepTrace
from experiments.common.results_readme import REPO_ROOT, write_section

FRACTIONS = (0.0, 0.1, 0.3, 0.6)
ACTIONS = (Action.RECOMPUTE_TORCH, Action.RECOMPUTE_OWN)
ZOO = ("mlp", "cnn", "transformer", "control_flow", "gpt2", "bert", "t5", "llama", "vit", "unet")
OFFLOAD = ("gpt2-medium", "llama")
OFFLOAD_POOL_BYTES = 256 * 2**20
PIPELINE = ("gpt2-style", 2, 1)  # bench_pipeline.plans(model, stages, budget): its first, smallest budget search
# the answers must not depend on how fast the machine is: no program may stop on the clock (the transformer's
# flat programs take up to 16 s on a busy 2-core machine; HiGHS is deterministic when it stops on the gap)
SOLVER_OPTIONS = SolverOptions(time_limit_s=3600.0)


# --------------------------------------------------------------------------------------------- the cases' planners


def zoo_planner(name: str) -> autockpt.Planner:
    from autockpt.present import zoo

    built = zoo.build(name, "small", seed=0)
    return autockpt.Planner.from_model(built.model, example_inputs=built.args, example_kwargs=built.kwargs,
                                       loss_fn=built.loss_fn)


def offload_planner(name: str) -> autockpt.Planner:
    from experiments.bench import bench_offload

    torch.manual_seed(0)  # bench_offload.build seeds too; the example ids are drawn after the weights
    model, ids = bench_offload.build(name, "small", torch.device("cpu"))
    return autockpt.Planner.from_model(model, example_inputs=(ids,), example_kwargs={"labels": ids})


@functools.cache
def pipeline_planners() -> tuple[tuple[autockpt.Planner, int], ...]:
    """Every stage planner (and its gradient accumulation steps) the pipeline benchmark's search makes, in order.

    Made once per process: one search builds all of them (one capture and trace of the whole step)."""
    from experiments.bench import bench_pipeline

    made: list[tuple[autockpt.Planner, int]] = []
    original_init = autockpt.Planner.__init__

    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        made.append((self, self.gradient_accumulation_steps))

    autockpt.Planner.__init__ = recording_init
    try:
        torch.manual_seed(0)  # pipeline_worker.build seeds from the config too
        bench_pipeline.plans(*PIPELINE)
    finally:
        autockpt.Planner.__init__ = original_init
    return tuple(made)


def stage_key(planner: autockpt.Planner) -> str:
    """A stage planner's identity across runs: its graph (the search may make the stages in another order)."""
    return fingerprint.graph_digest(planner.graph.kind.value, planner.graph.units)


def planner_for(case: dict[str, Any]) -> autockpt.Planner:
    """The planner of a recorded case, made again from the model (with whatever trace and prices it measures)."""
    family, name = case["name"].split(":", 1)
    if family == "zoo":
        return zoo_planner(name)
    if family == "offload":
        return offload_planner(name)
    if family == "pipeline":
        found = [planner for planner, _ in pipeline_planners() if stage_key(planner) == case["stage_key"]]
        if not found:
            raise LookupError(f"the pipeline search made no stage planner with the graph of {case['name']}")
        return found[0]
    raise ValueError(f"unknown case family {family!r}")


def with_recorded_values(planner: autockpt.Planner, trace: StepTrace, costs: CostModel) -> autockpt.Planner:
    """A planner over values (0.2: ``Planner(graph, trace, costs, options, step=...)``): the case's captured graph and
    step with the recorded trace and prices, nothing of the measured ones."""
    return autockpt.Planner(planner.graph, trace, costs, planner.options, step=planner.request)


# ------------------------------------------------------------------------------------------------------ decisions


def _module_classes(graph: Any) -> dict[str, str]:
    """Class name of every module a unit runs in or calls (what the planning core reads of the model)."""
    found: dict[str, str] = {}
    paths = {u.module_path for u in graph.units} | {s.path for s in graph.module_spans}
    paths |= {u.op.removeprefix("module:") for u in graph.units if u.op.startswith("module:")}
    for path in sorted(paths):
        for owner in (graph.model, graph.executable):
            try:
                found[path] = type(owner.get_submodule(path)).__qualname__
                break
            except AttributeError:
                continue
    return found


def _graph_values(graph: Any) -> dict[str, Any]:
    return {
        "kind": graph.kind.value,
        "units": [codec.encode(u) for u in graph.units],
        "module_spans": [codec.encode(s) for s in graph.module_spans],
        "notes": list(graph.notes),
        "module_classes": _module_classes(graph),
    }


def _settings(planner: autockpt.Planner, pool_bytes: int) -> list[tuple[Action | None, int]]:
    """The recompute actions the capture allows (a module-level capture traces no gradient lifetimes, which
    autockpt's own recompute needs), each without a pool; with ``pool_bytes``, also "auto" with that pool."""
    allowed = recompute_actions("auto", planner.graph.kind)
    settings: list[tuple[Action | None, int]] = [(action, 0) for action in ACTIONS if action in allowed]
    return settings + ([(None, pool_bytes)] if pool_bytes > 0 else [])


def _decisions(planner: autockpt.Planner, action: Action | None, pool_bytes: int) -> dict[str, Any]:
    """The planner's plans at the four budgets for one recompute action (None: "auto")."""
    planner.solver_options = SOLVER_OPTIONS
    planner.host_pool_bytes = pool_bytes
    planner.actions = (action,) if action is not None else recompute_actions("auto", planner.graph.kind)
    planner._problems.clear()  # prepared for other actions and options: made again for these
    planner._joint.clear()
    # the lowest peak found: a plan at the unmodified peak runs the full floor search and states it
    baseline = planner.trace.baseline_peak_bytes
    floor = planner.plan(budget_bytes=baseline).min_feasible_bytes
    plans = []
    for fraction in FRACTIONS:
        budget = int(floor + fraction * (baseline - floor))
        try:
            the_plan = planner.plan(budget_bytes=budget)
        except InfeasibleBudgetError as error:
            plans.append({"budget_bytes": budget, "infeasible": error.min_feasible_bytes})
            continue
        plans.append({
            "budget_bytes": budget,
            "region_actions": [[ra.region.first_unit, ra.region.last_unit, ra.action.value]
                               for ra in the_plan.policy.region_actions],
            "planned_action": the_plan.planned_action.value,
            "predicted_peak_bytes": the_plan.predicted_peak_bytes,
            "min_feasible_bytes": the_plan.min_feasible_bytes,
            "status": the_plan.status.value,
        })
    return {"action": None if action is None else action.value, "host_pool_bytes": pool_bytes, "floor": floor,
            "plans": plans}


def _all_decisions(planner: autockpt.Planner, settings: list[list[Any]]) -> list[dict[str, Any]]:
    return [_decisions(planner, None if action is None else Action(action), pool) for action, pool in settings]


# --------------------------------------------------------------------------------------------------------- record


def _recorded_values(planner: autockpt.Planner) -> tuple[dict[str, Any], dict[str, Any]]:
    """The planner's trace and prices as JSON values, checked to read back as the same values."""
    if planner.graph.kind is not CaptureKind.MODULE and Action.OFFLOAD not in planner.costs.actions:
        # priced now, so that nothing is calibrated while planning (an infeasible budget asks what pool would do)
        solving.price(planner, Action.OFFLOAD)
    trace, costs = codec.encode(planner.trace), codec.encode(planner.costs)
    if read_trace(trace) != planner.trace or read_costs(costs) != planner.costs:
        raise AssertionError("the trace or the prices do not read back as the values written")
    return trace, costs


def _case(name: str, planner: autockpt.Planner, pool_bytes: int = 0, accumulation: int = 1, **extra: Any) -> dict[str, Any]:
    started = time.perf_counter()
    trace, costs = _recorded_values(planner)
    settings = [[None if action is None else action.value, pool] for action, pool in _settings(planner, pool_bytes)]
    case = {
        "name": name,
        **extra,
        "graph": _graph_values(planner.graph),
        "trace": trace,
        "costs": costs,
        "gradient_accumulation_steps": accumulation,
        "settings": settings,
        "decisions": _all_decisions(planner, settings),
    }
    print(f"{name}: {len(planner.graph.units)} units, {len(settings)} settings, "
          f"{time.perf_counter() - started:.1f} s planning", flush=True)
    return case


def _record_cases() -> Iterator[dict[str, Any]]:
    for name in ZOO:
        yield _case(f"zoo:{name}", zoo_planner(name))
    for name in OFFLOAD:
        yield _case(f"offload:{name}", offload_planner(name), OFFLOAD_POOL_BYTES)
    keys = [stage_key(planner) for planner, _ in pipeline_planners()]
    for i, (planner, accumulation) in enumerate(pipeline_planners()):
        if keys.count(keys[i]) > 1:
            raise AssertionError("two stage planners with the same graph: the replay could not tell them apart")
        yield _case(f"pipeline:{PIPELINE[0]}:stage{i}", planner, accumulation=accumulation, stage_key=keys[i])


def record(out: Path) -> None:
    started = time.perf_counter()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, check=True, capture_output=True,
                            text=True).stdout.strip()
    cases = list(_record_cases())
    document = {"commit": commit, "torch": torch.__version__, "fractions": FRACTIONS, "cases": cases}
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt") as handle:
        json.dump(document, handle, separators=(",", ":"))
    print(f"wrote {out}: {len(cases)} cases, {out.stat().st_size} bytes, {time.perf_counter() - started:.0f} s")


# --------------------------------------------------------------------------------------------------------- replay


def read_trace(data: dict[str, Any]) -> StepTrace:
    return codec.decode(StepTrace, data)


def read_costs(data: dict[str, Any]) -> CostModel:
    return codec.decode(CostModel, data)


def first_difference(recorded: Any, replayed: Any, where: str = "") -> str | None:
    """Where two JSON values first differ, and how; None when they are equal."""
    if isinstance(recorded, dict) and isinstance(replayed, dict):
        for key in [*recorded, *(k for k in replayed if k not in recorded)]:
            if key not in recorded or key not in replayed:
                return f"{where}.{key}: only in the {'replay' if key not in recorded else 'record'}"
            found = first_difference(recorded[key], replayed[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(recorded, list) and isinstance(replayed, list):
        for i, (a, b) in enumerate(zip(recorded, replayed)):
            found = first_difference(a, b, f"{where}[{i}]")
            if found:
                return found
        if len(recorded) != len(replayed):
            return f"{where}: {len(recorded)} items recorded, {len(replayed)} replayed"
        return None
    if recorded != replayed or type(recorded) is not type(replayed):
        return f"{where}: recorded {recorded!r}, replayed {replayed!r}"
    return None


def replay_case(case: dict[str, Any]) -> str | None:
    """The first difference between the case's recorded decisions and the planner's on the recorded values."""
    planner = planner_for(case)
    graph = json.loads(json.dumps(_graph_values(planner.graph)))  # as JSON reads it back (tuples as lists)
    found = first_difference(case["graph"], graph, "graph")
    if found:
        return f"captured another graph: {found}"
    planner = with_recorded_values(planner, read_trace(case["trace"]), read_costs(case["costs"]))
    decisions = json.loads(json.dumps(_all_decisions(planner, case["settings"])))
    return first_difference(case["decisions"], decisions, "decisions")


def replay(path: Path, log: Path | None = None) -> int:
    """Replay every case of ``path``, printing one line per case; with ``log``, the lines also go to that file (a
    header says what was replayed at which commit) and its folder's README lists every replay log there."""
    started = time.perf_counter()
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    with gzip.open(path, "rt") as handle:
        document = json.load(handle)
    say(f"{path}: {len(document['cases'])} cases recorded at {document['commit'][:10]} (torch {document['torch']})")
    different = 0
    for case in document["cases"]:
        case_started = time.perf_counter()
        try:
            found = replay_case(case)
        except Exception as error:  # noqa: BLE001  (a case that cannot be replayed is a difference too; the others still run)
            found = f"{type(error).__name__}: {error}"
        plans = sum(len(d["plans"]) for d in case["decisions"])
        seconds = time.perf_counter() - case_started
        if found:
            different += 1
            say(f"{case['name']}: DIFFERENT ({seconds:.1f} s): {found}")
        else:
            say(f"{case['name']}: same ({plans} plans, {seconds:.1f} s)")
    total = len(document["cases"])
    say(f"{total - different} of {total} cases same, {different} different, {time.perf_counter() - started:.0f} s")
    if log is not None:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True, cwd=REPO_ROOT,
        ).stdout.strip() or "an unknown commit"
        header = f"# replayed at {commit}: python -m experiments.tools.replay_decisions replay {path} --log {log}"
        log.write_text("\n".join([header, *lines]) + "\n")
        write_logs_section(log.parent)
    return 1 if different else 0


def write_logs_section(folder: Path) -> None:
    """The folder's README section "replay": every replay log in it, with its first line (what was replayed, when)
    and its last (how many cases decided the same)."""
    rows = ["| log | what | result |", "|---|---|---|"]
    for log in sorted(folder.glob("replay_*.log")):
        text = [line for line in log.read_text().splitlines() if line.strip()]
        what = text[0].lstrip("# ").replace("|", "/") if text else ""
        result = next((line for line in reversed(text) if "cases same" in line), "(no summary line)")
        rows.append(f"| [`{log.name}`]({log.name}) | {what} | {result} |")
    intro = (
        "Replays of recorded decisions (`decisions.json.gz` and the records the logs name) after refactors that must not "
        "change behaviour: the planner's regions, actions, predicted peaks, floors and statuses on recorded inputs. "
        "Each log is the replay's own output; this table is rewritten by `python -m experiments.tools.replay_decisions "
        "replay FILE --log experiments/results/replay/replay_NAME.log`."
    )
    write_section("replay", intro + "\n\n" + "\n".join(rows), output=folder / "README.md")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    recording = commands.add_parser("record", help="capture, trace and plan every case; write the file")
    recording.add_argument("--out", type=Path, required=True)
    replaying = commands.add_parser("replay", help="plan every recorded case on its recorded values and compare")
    replaying.add_argument("file", type=Path)
    replaying.add_argument("--log", type=Path, help="also write the lines to this file, and list it in its folder's README")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the machine is shared; the decisions do not depend on it
    if args.command == "record":
        record(args.out)
    else:
        sys.exit(replay(args.file, args.log))


if __name__ == "__main__":
    main()
