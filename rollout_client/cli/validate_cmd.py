"""`toolenv rollout validate`: a recorded step replayed against its own timings."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from toolenv_core.console import report_console
from toolenv_core.outputs import input_overwritten, output_dir_problem, output_file_problem
from toolenv_core.polytrace import TraceFormatError
from toolenv_core.polytrace.kinds import files_of_kind

from ..clock import VirtualTimeDeadlock
from ..engines.costmodel import load_cost_model
from ..validate import fit_cost_model, initial_guess, load_step, plot_step, validate_step
from .common import fail, one_line


def validate(
    trace: Annotated[
        list[Path],
        typer.Option("--trace", help="search_r1 step(s) to report on (multi-turn JSONL)."),
    ],
    cost_profile: Annotated[
        str, typer.Option("--cost-profile", help="Built-in engine profile or calibrate JSON.")
    ] = "searchr1-qwen7b",
    fit: Annotated[
        list[Path] | None,
        typer.Option(
            "--fit", help="Fit the profile on these steps first (never the reported ones)."
        ),
    ] = None,
    save_profile: Annotated[
        Path | None, typer.Option("--save-profile", help="Write the fitted profile here.")
    ] = None,
    plot_dir: Annotated[
        Path | None,
        typer.Option(
            "--plot-dir", help="Write validation-<step>.png (recorded vs simulated CDFs)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Replay recorded steps under verl's policy in virtual time and compare with their timings."""
    console = Console(stderr=True)
    _check_outputs(save_profile, plot_dir, fitting=bool(fit))
    try:
        trace = files_of_kind(trace, "multiturn")  # directories, names in the trace cache
        fit = files_of_kind(fit, "multiturn") if fit else None
        cost = load_cost_model(cost_profile)
        fitted = None
        if fit:
            if any(_same_step(f, t) for f in fit for t in trace):
                fail("--fit and --trace must be different steps (never fit on what you report)")
            if save_profile is not None and (same := input_overwritten(save_profile, fit)):
                fail(
                    f"--save-profile {save_profile}: is the step {same} it fits; name another file"
                )
            fit_steps = [load_step(p) for p in fit]
            with console.status("fitting the engine model") as status:
                start = initial_guess(fit_steps[0], cost)
                cost, loss = fit_cost_model(
                    fit_steps,
                    start,
                    on_trial=lambda c, v: status.update(f"fitting: loss {v:.3f}"),
                )
            cost = cost.model_copy(  # not the starting profile's name, nor its fit's error
                update={
                    "name": "fitted",
                    "source": f"toolenv rollout validate --fit {' --fit '.join(map(str, fit))}",
                    "fit_error": {"fit_loss": round(loss, 4)},
                }
            )
            fitted = {"profile": cost.model_dump(), "loss": round(loss, 4)}
            if save_profile is not None:
                cost.save(save_profile)
        results = []
        labels = step_labels(trace)
        for path, label in zip(trace, labels, strict=True):
            with console.status(f"replaying {label} in virtual time"):
                records = load_step(path)
                if plot_dir is not None:
                    png = (
                        plot_dir
                        / f"validation-{label.removesuffix(path.suffix).replace('/', '-')}.png"
                    )
                    result = plot_step(records, cost, png, f"{label} replayed in virtual time")
                else:
                    result = validate_step(records, cost)
                results.append({"trace": str(path), **result})
    except (TraceFormatError, ValueError, OSError, VirtualTimeDeadlock) as exc:
        fail(one_line(exc))
    report = {
        "cost_profile": cost.name,
        "policy": "async (verl SGLang multi-turn)",
        "fit": fitted,
        "steps": results,
    }
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    table = Table(
        title=f"validation against recorded timings (profile {cost.name})", title_justify="left"
    )
    # the step's file name folds, never ellipsized: steps of one trace differ only at its end
    table.add_column("step", overflow="fold")
    for col in (
        "makespan rec/sim (s)",
        "accuracy",
        "completion KS",
        "turn p50 rec/sim (s)",
        "turn p90 rec/sim (s)",
    ):
        table.add_column(col, justify="right")
    for r, label in zip(results, labels, strict=True):
        rec, sim = r["turn_latency_recorded_s"], r["turn_latency_simulated_s"]
        table.add_row(
            label,
            f"{r['makespan_recorded_s']:.1f} / {r['makespan_simulated_s']:.1f}",
            f"{r['makespan_accuracy']:.1%}",
            f"{r['completion_ks']:.3f}",
            f"{rec['p50']:.1f} / {sim['p50']:.1f}",
            f"{rec['p90']:.1f} / {sim['p90']:.1f}",
        )
    report_console().print(table)


def step_labels(paths: list[Path]) -> list[str]:
    """Each step's name in the table and in its plot's file name: the file name, with as many of
    its directories as tell it from another file of that name. Two runs' `trajectories.jsonl`
    were two rows named alike and one plot, the second written over the first."""
    labels = []
    for path in paths:
        depth = 1
        while depth < len(path.parts) and any(
            other != path and other.parts[-depth:] == path.parts[-depth:] for other in paths
        ):
            depth += 1
        labels.append("/".join(path.parts[-depth:]))
    return labels


def _same_step(fit: Path, trace: Path) -> bool:
    """One file by another path (a link) or a copy of it (the cache's step and a clone's: a fit
    on the reported step read as 100% accurate)."""
    return fit.resolve() == trace.resolve() or filecmp.cmp(fit, trace, shallow=False)


def _check_outputs(save_profile: Path | None, plot_dir: Path | None, *, fitting: bool) -> None:
    """The output options, checked before the fit and the replays rather than after them (a
    read-only place or too long a name failed only after a fit of minutes)."""
    if save_profile is not None:
        if not fitting:
            fail("--save-profile writes the profile --fit makes: add --fit STEP...")
        if (problem := output_file_problem(save_profile)) is not None:
            fail(f"--save-profile {save_profile}: {problem}")
    if plot_dir is not None and (problem := output_dir_problem(plot_dir)) is not None:
        fail(f"--plot-dir {plot_dir}: {problem}")
