"""`toolenv rollout study`: the policy x scenario matrix in virtual time."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from toolenv_core.cli_options import RAY_ADDRESS_HELP, ray_address
from toolenv_core.console import counted
from toolenv_core.polytrace import TraceFormatError
from toolenv_core.polytrace.kinds import files_of_kind, repeat_notes
from toolenv_core.sigterm import sigterm_unwinds

from ..clock import VirtualTimeDeadlock
from ..study import JobRunner, StudyPlan, load_inputs, run_here, run_study
from ..study_report import markdown, write
from .common import fail, one_line, out_dir_for_run


def study(
    trace: Annotated[
        list[Path],
        typer.Option(
            "--trace",
            help="search_r1 multi-turn JSONL or its directory, on disk or in the trace cache "
            "(repeatable; 3 steps for full runs).",
        ),
    ],
    reward_trace: Annotated[
        list[Path] | None,
        typer.Option(
            "--reward-trace",
            help="rllm_deepcoder reward_timings JSONL or its directory, on disk or in the trace "
            "cache (repeatable): the reward scenario.",
        ),
    ] = None,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick", help="256 trajectories per step and 7 policies (about 8 s on 2 cores)."
        ),
    ] = False,
    batch: Annotated[
        int | None,
        typer.Option("--batch", min=1, help="Trajectories per step (default 2048; quick 256)."),
    ] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Steps per cell.")] = 2,
    cost_profile: Annotated[
        str, typer.Option("--cost-profile", help="Built-in engine profile or calibrate JSON.")
    ] = "searchr1-qwen7b",
    seed: Annotated[int, typer.Option("--seed", min=0)] = 0,
    out: Annotated[Path, typer.Option("--out", help="Output directory.")] = Path("rollout-study"),
    as_json: Annotated[bool, typer.Option("--json", help="Print study.json to stdout.")] = False,
    no_plots: Annotated[bool, typer.Option("--no-plots", help="Skip the PNG plots.")] = False,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            help=f"Spread the cells over a Ray cluster as tasks. {RAY_ADDRESS_HELP} Same report "
            "as a local run for the same seed.",
            callback=ray_address,
        ),
    ] = None,
) -> None:
    """Every straggler policy against every tool scenario on full steps, in virtual time."""
    plan = (
        StudyPlan.quick(trace, reward_trace or [], seed=seed)
        if quick
        else StudyPlan(trace, reward_trace or [], seed=seed)
    )
    plan.steps, plan.cost_profile = steps, cost_profile
    if batch is not None:
        plan.batch = batch
    runner: JobRunner = run_here
    if ray_address is not None:
        try:  # Ray is an optional extra (`pip install toolenv[ray]`)
            from ..study_ray import RayRunner, RayUnreachable
        except ImportError as exc:
            fail(f"--ray needs Ray: pip install 'toolenv[ray]' ({exc})")
        try:
            runner = RayRunner(ray_address)
        except RayUnreachable as exc:
            fail(f"{exc} (--ray)", code=1)
    scenarios = [s for s in plan.scenarios if not s.reward or plan.reward_traces]
    total = len(scenarios) * len(plan.policies)
    progress = Progress(
        TextColumn("[bold]study"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[last]}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )
    # the report is written inside: one interrupted while written leaves no empty --out either;
    # SIGTERM (`timeout`, a CI cancel) unwinds as Ctrl-C does (it left an empty --out)
    with sigterm_unwinds(), out_dir_for_run(out):
        try:  # before the bar: an error written while it is live went into its line
            inputs = load_inputs(plan)
            notes = repeat_notes(
                files_of_kind(plan.traces, "multiturn"),
                "--trace",
                "its trajectories are in the selection",
            ) + repeat_notes(
                files_of_kind(plan.reward_traces, "reward_timings"),
                "--reward-trace",
                "its timings are counted",
            )
        except (TraceFormatError, ValueError) as exc:
            fail(one_line(exc))
        for note in notes:
            typer.echo(note, err=True)
        with progress:
            task = progress.add_task("cells", total=total, last="")

            def on_cell(row: dict) -> None:
                progress.update(
                    task,
                    advance=1,
                    last=f"{row['scenario']} / {row['policy']}: "
                    f"{row['trajectories_per_s']:.2f} traj/s, {row['calls_cut_share']:.1%} cut",
                )

            try:
                result = run_study(inputs, on_cell, runner)
            except (TraceFormatError, ValueError, VirtualTimeDeadlock) as exc:
                fail(one_line(exc))
        # quoted as a shell reads it: `--out "my study"` was written `--out my study`
        command = "toolenv rollout study " + shlex.join(sys.argv[3:])
        try:  # a full disk, or a directory where a file goes: a traceback and exit 1, the code
            # that says trajectories failed
            write(result, out, command.strip(), plots=not no_plots)
        except OSError as exc:
            where = Path(exc.filename).name if exc.filename else "the report"
            fail(f"--out {out}: cannot write {where}: {exc.strerror or exc}")
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        typer.echo(markdown(result, command.strip()))
        typer.echo(f"wrote {out}/study.md, {out}/study.json" + ("" if no_plots else " and PNGs"))
    failed = [c for c in result["cells"] if c["failed"]]
    if failed:  # its figures count only what finished: not a result to compare
        first = failed[0]
        typer.echo(
            f"error: trajectories failed in {counted(len(failed), 'cell')}, e.g. "
            f"{first['failed']} in "
            f"{first['scenario']} / {first['policy']}: {first['first_failure']}",
            err=True,
        )
        raise typer.Exit(1)
