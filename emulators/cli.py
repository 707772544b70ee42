"""`toolenv emulators ...`: fit and describe latency profiles, serve the emulators."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
import uvicorn
from rich.markup import escape
from rich.table import Table

from toolenv_core import serving
from toolenv_core.cli_options import ConfigFileOption
from toolenv_core.config import config_error
from toolenv_core.console import report_console
from toolenv_core.latency.profile import ProfileError, load_profile, save_profile
from toolenv_core.outputs import input_overwritten, output_file_problem
from toolenv_core.polytrace import TraceFormatError, iter_latencies
from toolenv_core.polytrace.kinds import kind_of_file, repeat_notes
from toolenv_core.polytrace.latencies import expand_paths, no_calls_message
from toolenv_core.shutdown import AnswerCutCalls, cut_detail

from .app import create_app
from .describe import describe, faults_line, json_ready, plot_cdf, stage_label
from .fit import build_profile, fit, per_step_note, split_by_status, successful_latencies
from .settings import EmulatorSettings
from .timing import StampingHttpToolsProtocol

app = typer.Typer(
    help="Latency-replaying tool emulators: fit, describe, serve.", no_args_is_help=True
)

# SIGTERM/SIGINT: calls in flight (an emulated delay) may finish for this long, then are cut.
SHUTDOWN_GRACE_S = 5
CUT_CALL_DETAIL = cut_detail("the emulators", f"{SHUTDOWN_GRACE_S} s")


@app.command("settings")
def show_settings(
    config: ConfigFileOption = None,
) -> None:
    """Print this service's effective settings as JSON (what `serve --config FILE` would use)."""
    try:
        settings = EmulatorSettings.load(config)
    except ValueError as exc:  # the config file or a TOOLENV_EMULATORS_* variable
        raise _fail(config_error(exc)) from exc
    typer.echo(settings.model_dump_json(indent=2))


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _check_out(out: Path) -> None:
    """`--out` checked before the traces are read and fitted: it failed after them, the report
    unprinted, and a path under a file said "File exists"."""
    problem = output_file_problem(out, make_parents=True, kind="a profile file (YAML or .json)")
    if problem is not None:
        raise _fail(f"--out {out}: {problem}")


@app.command("fit")
def fit_command(
    traces: Annotated[
        list[Path],
        typer.Argument(
            help="PolyTrace files or directories (multi-turn, call logs, reward timings); a name "
            "not on disk is looked up in the trace cache (`toolenv traces fetch`)."
        ),
    ],
    tool: Annotated[
        str, typer.Option("--tool", help="Tool whose calls to fit (`reward` reads reward timings).")
    ] = "search",
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Write the chosen model as a profile (YAML or .json)."),
    ] = None,
    per_step: Annotated[
        bool,
        typer.Option("--per-step", help="Write a drift profile: one empirical stage per step."),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Fit candidate latency models to recorded calls; report KS and quantile errors; write the best."""
    if out is not None:
        _check_out(out)
    console = report_console(stderr=as_json)
    wanted = {"multiturn", "call_log"} | ({"reward_timings"} if tool == "reward" else set())
    try:
        given = expand_paths(traces)
        if out is not None and (same := input_overwritten(out, given)) is not None:
            raise _fail(f"--out {out}: is the trace {same} it reads; name another file")
        used = [p for p in given if p.is_file() and kind_of_file(p) in wanted]
        for note in repeat_notes(used, "TRACE", "its calls are fitted"):
            typer.echo(note, err=True)
        with console.status(f"reading {tool} calls from {len(traces)} path(s)..."):
            observations = list(iter_latencies(traces, tool))
        if not observations:
            raise _fail(no_calls_message(traces, tool))
        split = split_by_status(observations)
        if len(split.ok) < 2:  # fit's own "got 0" said nothing of the calls that were not fitted
            raise _fail(f"need at least 2 successful calls of {tool!r} to fit: {split.describe()}")
        if tool == "reward" and (unsized := sum(o.batch_size is None for o in split.ok)):
            typer.echo(unsized_reward_note(unsized), err=True)
        data = np.asarray([o.latency_s for o in split.ok])
        with console.status(f"fitting {data.size} calls..."):
            report = fit(data, tool)
    except (TraceFormatError, OSError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    report.extra["statuses"] = split.as_dict()
    # the files that held this tool's calls (a multi-turn trace beside reward timings held none
    # for `--tool reward`, and was named all the same); the folder's own name: a relative path's
    # parent (".") has none, and read as "/trace.jsonl"
    read = {o.source for o in observations if o.source is not None}
    source = "PolyTrace " + ", ".join(sorted(f"{p.resolve().parent.name}/{p.name}" for p in read))
    summary = report.as_dict()
    written = None
    if out is not None:
        profile = build_profile(
            report, source=source, observations=split.ok, per_step=per_step, faults=split.faults()
        )
        try:
            save_profile(profile, out)
        except OSError as exc:
            raise _fail(f"cannot write the profile to {out}: {exc.strerror or exc}") from exc
        summary["profile"] = str(out)
        summary["profile_kind"] = profile.model.kind
        written = f"profile written to {escape(str(out))}"  # `[v2]` is no markup tag
        drift = per_step_note(profile.model)  # not the candidate "chosen:" names
        if drift is not None:
            written += f": {drift}"
    if as_json:  # a failed candidate's KS is inf: null, not `Infinity` (not JSON)
        typer.echo(json.dumps(json_ready(summary), indent=2, allow_nan=False))
        return
    table = Table(
        title=f"{tool}: {report.n} calls, KS 5% critical value {report.ks_critical:.4f}",
        title_justify="left",
    )
    table.add_column("candidate")
    table.add_column("KS", justify="right")
    for name in report.data_quantiles:
        if name.startswith("p"):
            table.add_column(f"{name} err", justify="right")
    for c in sorted(report.candidates, key=lambda c: c.ks):
        mark = " (chosen)" if c is report.best else ""
        if c.spec is None:
            table.add_row(c.name, "failed", c.error or "")
            continue
        table.add_row(
            c.name + mark, f"{c.ks:.4f}", *(f"{v:+.1%}" for v in c.quantile_errors.values())
        )
    console.print(table)
    q = report.data_quantiles
    console.print("data: " + ", ".join(f"{k} {v:.4g}s" for k, v in q.items()))
    console.print(f"chosen: [bold]{report.best.name}[/bold]: {report.reason}")
    if split.carried or split.left_out:
        console.print(split.describe())
    if written is not None:
        console.print(written)


def unsized_reward_note(n: int) -> str:
    """Reward calls of a multi-turn trace (a gateway capture's) record no batch size, and the
    emulator scales a profile's draw by a call's batch_size over `reference.batch_size` (64 when
    unset): fitted on calls of 1 response, a call of 1 answered 64 times sooner, unsaid."""
    return (
        f"note: {n} reward call(s) record no batch size (a multi-turn trace or gateway capture): "
        "the reward emulator reads the profile as batches of reference.batch_size responses (64 "
        "when unset) and scales a call by its batch_size over that; set reference.batch_size in "
        "the profile to the batch these calls verified (a call without batch_size is answered "
        "as recorded)"
    )


@app.command("describe")
def describe_command(
    profile_path: Annotated[
        Path, typer.Argument(metavar="PROFILE", help="A profile file (YAML/JSON).")
    ],
    data: Annotated[
        list[Path] | None,
        typer.Option("--data", help="Trace(s) to compare against (paths or trace-cache names)."),
    ] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write a PNG of the CDF (vs the data).")
    ] = None,
    samples: Annotated[int, typer.Option(help="Samples drawn from the model.", min=100)] = 100_000,
    seed: Annotated[int, typer.Option(help="Seed of the sample.", min=0)] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Print a profile's quantiles (and the data's), and optionally plot its CDF against the data."""
    # found before the sampling, and said as it is: making the directories said "File exists"
    if plot is not None and (
        problem := output_file_problem(plot, make_parents=True, kind="a PNG file")
    ):
        raise _fail(f"cannot write the plot to {plot}: {problem}")
    try:
        read = [profile_path, *expand_paths(data or [])]
        if plot is not None and (same := input_overwritten(plot, read)) is not None:
            raise _fail(
                f"cannot write the plot to {plot}: it is {same}, read here; name a PNG file"
            )
        profile = load_profile(profile_path)
        recorded = successful_latencies(data, profile.tool) if data else None
        report = describe(profile, recorded, samples, seed)
    except (ProfileError, TraceFormatError, OSError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    if plot is not None:
        try:
            report["plot"] = str(plot_cdf(profile, recorded, plot, samples, seed))
        except OSError as exc:
            raise _fail(f"cannot write the plot to {plot}: {exc.strerror or exc}") from exc
    if as_json:
        typer.echo(json.dumps(json_ready(report), indent=2, allow_nan=False))
        return
    console = report_console()
    table = Table(
        title=f"{profile.tool} profile ({profile.model.kind}) from {profile.source or 'unknown source'}",
        title_justify="left",
    )
    table.add_column("")
    for key in report["model"]:
        table.add_column(key, justify="right")
    table.add_row("model (s)", *(f"{v:.4g}" for v in report["model"].values()))
    if "data" in report:
        table.add_row("data (s)", *(f"{report['data'][k]:.4g}" for k in report["model"]))
        table.add_row(
            "rel. error",
            *(
                f"{report['relative_error'][k]:+.1%}" if k in report["relative_error"] else ""
                for k in report["model"]
            ),
        )
    for stage in report.get("stages", []):
        table.add_row(stage_label(stage), *(f"{stage[k]:.4g}" for k in report["model"]))
    console.print(table)
    if "faults" in report:
        console.print(faults_line(report["faults"]) + " (the quantiles are of the latency alone)")
    if "ks_model_vs_data" in report:
        console.print(f"KS distance model vs data: {report['ks_model_vs_data']:.4f}")
    if "plot" in report:
        console.print(f"plot written to {escape(str(report['plot']))}")


@app.command("serve")
def serve_command(
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind (default 8090).")] = None,
    config: ConfigFileOption = None,
    profile: Annotated[
        Path | None,
        typer.Option("--profile", help="Search latency profile (default: the shipped one)."),
    ] = None,
    reward_profile: Annotated[
        Path | None,
        typer.Option("--reward-profile", help="Reward latency profile (default: the shipped one)."),
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Seed for delays and documents (default 0).", min=0)
    ] = None,
    corpus: Annotated[
        Path | None,
        typer.Option(help="JSONL corpus for real BM25 retrieval (default: synthetic documents)."),
    ] = None,
) -> None:
    """Serve the search and reward emulators alone (Search-R1 `/retrieve` + native endpoints)."""
    overrides = {
        k: v
        for k, v in {
            "host": host,
            "port": port,
            "search_profile_file": profile,
            "reward_profile_file": reward_profile,
            "seed": seed,
            "corpus": corpus,
        }.items()
        if v is not None
    }
    # a profile file on the command line replaces an inline profile of the config file or env,
    # which `build_emulators` would otherwise prefer (the command line is the highest precedence)
    for tool in ("search", "reward"):
        if f"{tool}_profile_file" in overrides:
            overrides[f"{tool}_profile"] = None
    try:
        settings = EmulatorSettings.load(config, **overrides)
        app_ = create_app(settings)
    except ValueError as exc:
        raise _fail(config_error(exc)) from exc
    server_config = uvicorn.Config(
        AnswerCutCalls(app_, CUT_CALL_DETAIL),  # a 503 that says so, not uvicorn's plain 500
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        http=StampingHttpToolsProtocol,  # delays count from when a request reached the process
    )
    serving.serve(server_config, "emulators: serving on {url}")  # a port in use: exit 3
