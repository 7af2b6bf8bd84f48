"""The ``autockpt`` command line: estimate, plan, sweep, demo. Built on click; progress bars with tqdm.

    autockpt estimate gpt2 --optimizer adam --depth 2
    autockpt plan mypkg.models:make_model --input "x=float32[8,3,224,224]" --budget 8GB --report plan.html --out plan.json
    autockpt sweep gpt2 --budgets 40MB,50MB,60MB --out results/

User mistakes (unknown module, malformed input spec, bad budget, infeasible budget, ...) print one line saying what
to do and exit with status 1 (2 for click's own usage errors); ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import csv
import dataclasses
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from autockpt.errors import AutockptError
from autockpt.present.workload import UserInputError, load_workload, parse_budget, parse_host_pool
from autockpt.types import Action
from autockpt.units import format_bytes

if TYPE_CHECKING:
    from autockpt.planning.options import PlanOptions

# ------------------------------------------------------------------------------------------------------ progress


class StageProgress:
    """A progress bar over pipeline stages (capture, profile, solve, ...); silent when quiet or not a terminal."""

    def __init__(self, total: int, quiet: bool) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, disable=quiet or not sys.stderr.isatty(), unit="stage", leave=False, ncols=100,
                         bar_format="{desc:<10} {bar} {n_fmt}/{total_fmt} [{elapsed}]")
        self._started = False

    def __call__(self, stage: str) -> None:
        if self._started:
            self._bar.update(1)
        self._started = True
        self._bar.set_description_str(stage)

    def close(self) -> None:
        if self._started:
            self._bar.update(1)
        self._bar.close()


@contextmanager
def stage_progress(total: int, quiet: bool) -> Iterator[StageProgress]:
    progress = StageProgress(total, quiet)
    try:
        yield progress
    finally:
        progress.close()


# ------------------------------------------------------------------------------------------------------ commands


class _Group(click.Group):
    """Turns autockpt's own errors and the user's mistakes into one line and exit status 1 (tracebacks with --debug)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (AutockptError, ValueError, TypeError, ImportError, OSError) as error:
            if ctx.meta.get("autockpt.debug"):
                raise
            message = str(error).splitlines()
            click.echo(f"error: {' '.join(line.strip() for line in message)}", err=True)
            click.echo("(run with --debug for the traceback)", err=True)
            ctx.exit(1)


def _model_options(command: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.argument("model", required=False),
        click.option("--hf-config", metavar="PATH_OR_NAME",
                     help="instead of MODEL: a Hugging Face config (config.json, its folder, or a hub name where the "
                          "network allows), built on the meta device in its dtype and planned from a fake trace"),
        click.option("--batch", type=click.IntRange(min=1), help="with --hf-config: token ids of this batch size "
                     "(default 1; labels = the ids)"),
        click.option("--seq", type=click.IntRange(min=1), help="with --hf-config: token ids of this length (default 512)"),
        click.option("--input", "inputs", multiple=True, metavar="SPEC",
                     help="example input, e.g. 'input_ids=int64[4,512]:high=50257' or 'float32[8,3,224,224]' (repeat)"),
        click.option("--inputs", "inputs_ref", metavar="MODULE:FUNCTION",
                     help="function returning the example inputs: a tensor, a tuple (positional) or a dict (keywords)"),
        click.option("--size", type=click.Choice(["tiny", "small", "bench"]), default="small", show_default=True,
                     help="size of a built-in example model"),
        click.option("--device", default="cpu", show_default=True, help="device to run the model on: cpu, cuda, cuda:1"),
        click.option("--seed", type=int, default=0, show_default=True, help="seed for weights and random inputs"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _tokens(batch: int | None, seq: int | None) -> tuple[int, int] | None:
    """--batch / --seq as the (batch, sequence) of an --hf-config model's token ids; None when neither is given."""
    return None if batch is None and seq is None else (batch or 1, seq or 512)


def _solver_options(command: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--solver", type=click.Choice(["auto", "cbc", "highs"]), default="auto", show_default=True,
                     help="MILP solver (auto: HiGHS when highspy is installed, else CBC)"),
        click.option("--time-limit", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
                     help="seconds per MILP; the best plan found so far is used when it runs out"),
        click.option("--checkpoint", type=click.Choice(["auto", *(action.value for action in Action if action.recomputes)]),
                     default="auto", show_default=True,
                     help="recompute action the plan is made for (autockpt.Action; auto: plan for both, keep the "
                          "smaller predicted overhead; module-level captures stay on torch_non_reentrant)"),
        click.option("--host-pool", default="0", show_default=True,
                     help="host memory the plan may offload saved tensors into (one pinned buffer on CUDA): 0 (recompute "
                          "only), auto (up to half the host memory available), or a size such as 16GB"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _device_options(command: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--target", metavar="DEVICE",
                     help="plan for this device instead of --device: a table name (h100-sxm-80gb, a100-80gb, l4, ...; "
                          "autockpt.core.devices.DEVICE_SPECS); times come from its roofline, its memory is the "
                          "default budget"),
        click.option("--meta", is_flag=True,
                     help="build MODEL on the meta device (no weights anywhere) and plan it from a fake trace: for "
                          "models that do not fit this machine"),
        click.option("--device-memory", metavar="SIZE",
                     help="memory of the device planned for (8GB, 80GiB, bytes): a step predicted above it is traced "
                          "on fake tensors instead of run; the default budget"),
        click.option("--trace", type=click.Choice(["auto", "fake", "measured"]), default="auto", show_default=True,
                     help="how the step is known: run it (measured), on fake tensors (fake: no real step), or auto"),
        click.option("--timing", type=click.Choice(["auto", "measured", "benchmark", "roofline"]), default="auto",
                     show_default=True,
                     help="unit times: measured on the step, benchmark (each op alone), roofline (of --target)"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _plan_options(
    *, solver: str = "auto", time_limit: float = 10.0, checkpoint: str = "auto", host_pool: str = "0",
    optimizer: str = "none", grad_accumulation: int = 1, output_dropped: bool = False, target: str | None = None,
    device_memory: str | None = None, trace: str = "auto", timing: str = "auto",
) -> PlanOptions:
    """The command line's flags as the one ``PlanOptions`` (its checks, said as a usage error)."""
    from autockpt.core.solve.base import SolverOptions
    from autockpt.planning.options import PlanOptions

    try:
        return PlanOptions(
            solver=SolverOptions(solver=solver, time_limit_s=time_limit), checkpoint=checkpoint,
            host_pool_gb=parse_host_pool(host_pool), optimizer=optimizer, gradient_accumulation_steps=grad_accumulation,
            output_held=not output_dropped, target=target,
            device_memory_bytes=parse_budget(device_memory) if device_memory else None, trace=trace, timing=timing,
        )
    except (TypeError, ValueError) as refused:
        raise UserInputError(str(refused)) from refused


def _loop_options(command: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--optimizer", type=click.Choice(["none", "adam", "adamw", "sgd"]), default="none",
                     show_default=True,
                     help="optimizer whose step the budget covers too: its states and its step's temporaries, "
                          "measured (sgd: with momentum; none: forward and backward only)"),
        click.option("--grad-accumulation", type=click.IntRange(min=1), default=1, show_default=True,
                     help="gradient accumulation micro-steps: above 1 the budget covers steps that start with "
                          "gradients alive (also for loops that zero gradients in place)"),
        click.option("--output-dropped", is_flag=True,
                     help="the loop drops the model's output before backward (Hugging Face's Trainer, torchtitan, "
                          "model(**batch).loss.backward()): PlanOptions.output_held=False"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="show tracebacks instead of one-line errors")
@click.option("--quiet", "-q", is_flag=True, help="no progress bars")
@click.version_option(package_name="autockpt")
@click.pass_context
def main(ctx: click.Context, debug: bool, quiet: bool) -> None:
    """Fit a PyTorch training step into a memory budget: estimate, plan, sweep (GB = 10^9 bytes, GiB = 2^30 bytes)."""
    ctx.meta["autockpt.debug"] = debug
    ctx.meta["autockpt.quiet"] = quiet


@main.command()
@_model_options
@click.option("--optimizer", type=click.Choice(["none", "adam", "adamw", "sgd"]), default="none", show_default=True,
              help="optimizer whose state and step to count (sgd: with momentum)")
@click.option("--depth", type=click.IntRange(min=0), default=2, show_default=True, help="module nesting in the table")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), help="also write the breakdown as CSV")
@_device_options
@click.pass_context
def estimate(
    ctx: click.Context, model: str | None, hf_config: str | None, batch: int | None, seq: int | None,
    inputs: tuple[str, ...], inputs_ref: str | None, size: str, device: str, seed: int,
    optimizer: str, depth: int, csv_path: str | None, target: str | None, meta: bool, device_memory: str | None,
    trace: str, timing: str,
) -> None:
    """Memory of one training step of MODEL: parameters, gradients, optimizer state, activations, temporaries.

    MODEL is a built-in example (gpt2, bert, t5, llama, vit, unet, vae, mlp, cnn, transformer, control_flow) or
    package.module:factory, a function returning an nn.Module; or give --hf-config instead (a Hugging Face config,
    built on the meta device).
    """
    from autockpt.planning.estimate import estimate_from_planner
    from autockpt.planning.planner import Planner

    options = _plan_options(optimizer=optimizer, target=target, device_memory=device_memory, trace=trace, timing=timing)
    work = load_workload(model, size, inputs, inputs_ref, device, seed, meta=meta, hf_config=hf_config,
                         tokens=_tokens(batch, seq))
    with stage_progress(2, ctx.meta["autockpt.quiet"]) as progress:
        # as autockpt.estimate: the optimizer measured apart from the traced step
        planner = Planner.from_model(work.model, example_inputs=work.args, example_kwargs=work.kwargs, loss_fn=work.loss_fn,
                                     on_stage=progress, options=dataclasses.replace(options, optimizer=None))
    breakdown = estimate_from_planner(planner, options.optimizer, depth)
    click.echo(breakdown.table())
    if csv_path:
        breakdown.to_dataframe().to_csv(csv_path, index=False)
        click.echo(f"\nwrote {csv_path}")


@main.command()
@_model_options
@click.option("--budget", help="peak memory budget: 8GB (10^9 bytes), 7.5GiB (2^30 bytes), 500MB, bytes (default: "
              "--device-memory, or the --target's memory)")
@click.option("--report", "report_path", type=click.Path(dir_okay=False),
              help="write a report: HTML (self-contained, with plots) for .html, markdown otherwise")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), help="save the plan as JSON (autockpt.load_plan)")
@click.option("--pareto", "pareto_points", type=click.IntRange(min=0), default=6, show_default=True,
              help="budgets to solve for the report's Pareto curve (0: none)")
@click.option("--depth", type=click.IntRange(min=0), default=2, show_default=True, help="module nesting in the report")
@_solver_options
@_loop_options
@_device_options
@click.pass_context
def plan(
    ctx: click.Context, model: str | None, hf_config: str | None, batch: int | None, seq: int | None,
    inputs: tuple[str, ...], inputs_ref: str | None, size: str, device: str, seed: int,
    budget: str | None, report_path: str | None, out_path: str | None, pareto_points: int, depth: int, solver: str,
    time_limit: float, checkpoint: str, host_pool: str, optimizer: str, grad_accumulation: int, output_dropped: bool,
    target: str | None, meta: bool, device_memory: str | None, trace: str, timing: str,
) -> None:
    """Plan MODEL's training step under --budget and print what was decided; nothing is rewritten.

    Apply the saved plan on the training machine with autockpt.apply_plan(model, autockpt.load_plan(path), ...).
    """
    from autockpt.planning.planner import Planner

    options = _plan_options(
        solver=solver, time_limit=time_limit, checkpoint=checkpoint, host_pool=host_pool, optimizer=optimizer,
        grad_accumulation=grad_accumulation, output_dropped=output_dropped, target=target, device_memory=device_memory,
        trace=trace, timing=timing,
    )
    if budget is None and target is None and device_memory is None:
        raise UserInputError("give --budget (e.g. --budget 8GB), or --device-memory / --target, whose memory is the budget")
    budget_bytes = parse_budget(budget) if budget is not None else None
    work = load_workload(model, size, inputs, inputs_ref, device, seed, meta=meta, hf_config=hf_config,
                         tokens=_tokens(batch, seq))
    with stage_progress(3 + pareto_points, ctx.meta["autockpt.quiet"]) as progress:
        planner = Planner.from_model(work.model, example_inputs=work.args, example_kwargs=work.kwargs, loss_fn=work.loss_fn,
                                     on_stage=progress, options=options)
        the_plan = planner.plan(budget_bytes=budget_bytes, pareto_points=pareto_points)
    click.echo(the_plan.summary())
    if out_path:
        the_plan.save(out_path)
        click.echo(f"\nwrote the plan to {out_path}")
    if report_path:
        the_plan.report(report_path, depth=depth)
        click.echo(f"wrote the report to {report_path}")


@main.command()
@_model_options
@click.option("--budgets", required=True, help="comma-separated budgets, e.g. 2GB,4GB,6GB or 500MB,1GiB")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True,
              help="folder for sweep.csv, sweep.md and pareto.png")
@_solver_options
@_loop_options
@click.pass_context
def sweep(
    ctx: click.Context, model: str | None, hf_config: str | None, batch: int | None, seq: int | None,
    inputs: tuple[str, ...], inputs_ref: str | None, size: str, device: str, seed: int,
    budgets: str, out_dir: str, solver: str, time_limit: float, checkpoint: str, host_pool: str, optimizer: str,
    grad_accumulation: int, output_dropped: bool,
) -> None:
    """Plan MODEL at several budgets (one capture and profile) and write the Pareto curve of predicted peak vs
    predicted overhead."""
    from tqdm import tqdm

    from autockpt.planning.planner import Planner

    options = _plan_options(
        solver=solver, time_limit=time_limit, checkpoint=checkpoint, host_pool=host_pool, optimizer=optimizer,
        grad_accumulation=grad_accumulation, output_dropped=output_dropped,
    )
    budget_list = [parse_budget(text) for text in budgets.split(",") if text.strip()]
    if not budget_list:
        raise UserInputError(f"--budgets {budgets!r} lists no budget; give e.g. --budgets 2GB,4GB,6GB")
    work = load_workload(model, size, inputs, inputs_ref, device, seed, hf_config=hf_config, tokens=_tokens(batch, seq))
    quiet = ctx.meta["autockpt.quiet"]
    with stage_progress(2, quiet) as progress:
        planner = Planner.from_model(work.model, example_inputs=work.args, example_kwargs=work.kwargs, loss_fn=work.loss_fn,
                                     on_stage=progress, options=options)
    points = [
        planner.pareto([budget])[0]
        for budget in tqdm(budget_list, desc="budgets", disable=quiet or not sys.stderr.isatty(), leave=False)
    ]
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "model": work.label,
            "budget_bytes": p.budget_bytes,
            "feasible": p.predicted_peak_bytes is not None,
            "predicted_peak_bytes": p.predicted_peak_bytes,
            "predicted_overhead": p.predicted_overhead,
            "regions": p.regions,
            "unmodified_peak_bytes": planner.trace.baseline_peak_bytes,
        }
        for p in points
    ]
    with open(folder / "sweep.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"# autockpt sweep: {work.label}", "", "GB = 10^9 bytes, GiB = 2^30 bytes; predicted figures.", "",
             "| budget | predicted peak | predicted overhead | regions |", "|---|---|---|---|"]
    for p in points:
        peak = "infeasible" if p.predicted_peak_bytes is None else format_bytes(p.predicted_peak_bytes)
        overhead = "" if p.predicted_overhead is None else f"+{100 * p.predicted_overhead:.1f}%"
        lines.append(f"| {format_bytes(p.budget_bytes)} | {peak} | {overhead} | {p.regions} |")
    (folder / "sweep.md").write_text("\n".join(lines) + "\n")
    written = ["sweep.csv", "sweep.md"]
    if _pareto_png(points, folder / "pareto.png", work.label):
        written.append("pareto.png")
    click.echo("\n".join(lines[4:]))
    click.echo(f"\nwrote {', '.join(str(folder / name) for name in written)}")


def _pareto_png(points: list[Any], path: Path, label: str) -> bool:
    from autockpt.present.page import matplotlib_import_error, plots_missing_text

    missing = matplotlib_import_error()  # the same check and words as the HTML report's
    if missing is not None:
        click.echo(f"no pareto.png: {plots_missing_text(missing)}", err=True)
        return False
    from matplotlib.figure import Figure

    feasible = [p for p in points if p.predicted_peak_bytes is not None]
    figure = Figure(figsize=(6.5, 4), layout="constrained")
    ax = figure.subplots()
    ax.plot([p.predicted_peak_bytes / 1e9 for p in feasible], [100 * p.predicted_overhead for p in feasible], marker="o")
    ax.set_xlabel("predicted peak, GB (10^9 bytes)")
    ax.set_ylabel("predicted overhead, % of the step")
    ax.set_title(f"autockpt: {label}", fontsize=10)
    ax.grid(alpha=0.3)
    figure.savefig(path, dpi=120)
    return True


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True}, add_help_option=False)
@click.pass_context
def demo(ctx: click.Context) -> None:
    """The README's main job: optimize a built-in GPT-2 to half its activation memory and measure it
    (options: --model, --size, --fraction; see `autockpt demo --help`)."""
    from autockpt.present.demo import main as run_demo

    run_demo(list(ctx.args), prog="autockpt demo")


if __name__ == "__main__":
    main()
