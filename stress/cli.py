"""`toolenv stress`: drive a tool endpoint at a rate (or with N callers) and report honest latency.

Exit codes (for CI):
  0  the run finished and every `--slo` was met (or none was given)
  1  at least one `--slo` was broken (for `--ramp`: the first step already broke them)
  2  bad options: unparsable values, an unbounded run, an off-loopback target without
     `--allow-remote`, an unreadable payload file, `--ramp`, `--rate` or `--slo rate=` in a
     closed loop (and `--max-in-flight`), `--concurrency` in an open one, a ramp's options
     without `--ramp`
  3  the target never answered: not one request got an HTTP response, nor bytes that do not
     parse as one (connection refused, timeouts, ...)
  4  the target answered, but not one request succeeded (every response an error status such as
     404, or not HTTP, or every request failed), and no `--slo` was broken
  130  Ctrl-C: sending stopped, the requests in flight had 2 s to finish, and the report (files
     included) covers what was sent before it
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape

from toolenv_core.console import report_console
from toolenv_core.http1 import Endpoint, TargetURLError
from toolenv_core.outputs import write_whole

from .loop import run_load
from .options import (
    check_loop_options,
    check_open_loop,
    check_outputs,
    check_ramp_options,
    duration_option,
    parse_headers,
)
from .ramp import DEFAULT_RAMP_SLOS, RampResult, RampStep, ramp_rates, run_ramp
from .report import (
    LiveView,
    print_report,
    ramp_step_line,
    ramp_table,
    write_hdr,
    write_plot,
)
from .result import LoadResult
from .slo import SLO, SLOError, check_all
from .spec import LoadSpec, LoadSpecError, Progress
from .targets import RemoteTargetError, TargetError, check_loopback, resolve_target

EXIT_OK, EXIT_SLO_BROKEN, EXIT_USAGE, EXIT_NO_RESPONSE, EXIT_ALL_FAILED = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130  # Ctrl-C: the report of what was sent before it, no verdict

# The options that set each `LoadSpec` field: a spec error names what the user typed
# (`--duration`, not `duration_s`).
OPTION_OF_FIELD = {
    "method": "--method",
    "arrival": "--arrival",
    "rate": "--rate",
    "concurrency": "--concurrency",
    "duration_s": "--duration",
    "max_requests": "--max-requests",
    "max_in_flight": "--max-in-flight",
    "connections": "--connections",
    "timeout_s": "--timeout",
    "workers": "--workers",
    "preconnect": "--preconnect",
    "seed": "--seed",
}
# The check of one ramp step's spec: its duration is --step-duration.
OPTION_OF_STEP_FIELD = {**OPTION_OF_FIELD, "duration_s": "--step-duration"}


def _usage_error(console: Console, message: str) -> typer.Exit:
    # a path's `[v2]` is no markup tag; one line however narrow (piped: 80 columns), for grep
    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
    return typer.Exit(EXIT_USAGE)


def stress(
    ctx: typer.Context,
    url: Annotated[
        str | None, typer.Option(help="Raw target URL (http://), sent the JSON --body.")
    ] = None,
    gateway: Annotated[str | None, typer.Option(help="Gateway base URL, with --tool.")] = None,
    tool: Annotated[
        str | None,
        typer.Option(
            help="Gateway tool: POST {gateway}/v1/tools/{tool}/call (run_code = sandbox)."
        ),
    ] = None,
    body: Annotated[
        str | None, typer.Option(help="JSON request body (--url) or tool arguments.")
    ] = None,
    body_file: Annotated[
        Path | None, typer.Option(help="File holding the JSON body / arguments.")
    ] = None,
    arguments: Annotated[
        str | None, typer.Option(help="JSON tool arguments (with --tool).")
    ] = None,
    payload: Annotated[
        str | None,
        typer.Option(help="Built-in run_code payload: trivial, cpu-bound, memory-heavy, hostile."),
    ] = None,
    method: Annotated[str, typer.Option(help="HTTP method.")] = "POST",
    header: Annotated[
        list[str], typer.Option("--header", "-H", help="Extra header 'Name: value'.")
    ] = [],  # noqa: B006
    capture_header: Annotated[
        list[str], typer.Option(help="Response header to keep per request (in --json records).")
    ] = [],  # noqa: B006
    arrival: Annotated[
        str,
        typer.Option(
            help="constant | poisson (open loop at --rate) | closed (--concurrency callers)."
        ),
    ] = "constant",
    rate: Annotated[
        float, typer.Option(help="Open-loop target rate, requests per second.")
    ] = 100.0,
    concurrency: Annotated[int, typer.Option(help="Closed-loop callers.")] = 16,
    duration: Annotated[
        float, duration_option("Run length: 10s, 500ms, 2m, 1h (at most).")
    ] = "10s",  # type: ignore[assignment]
    max_requests: Annotated[int, typer.Option(help="Hard cap on requests in the run.")] = 1_000_000,
    max_in_flight: Annotated[
        int, typer.Option(help="Open loop: a request due while this many are out is 'dropped'.")
    ] = 10_000,
    connections: Annotated[
        int | None,
        typer.Option(
            help="Max keep-alive connections (default: --max-in-flight open loop, "
            "--concurrency closed loop)."
        ),
    ] = None,
    preconnect: Annotated[
        int | None,
        typer.Option(
            help="Connections to open before the clock starts (slow targets: rate x latency; "
            "default: open loop rate/250 within 2..64, closed loop none)."
        ),
    ] = None,
    timeout: Annotated[
        float, duration_option("Per-request timeout, from its scheduled send time.")
    ] = "30s",  # type: ignore[assignment]
    seed: Annotated[
        int | None, typer.Option(help="Seed for Poisson arrivals (default: a fresh one each run).")
    ] = None,
    workers: Annotated[
        int, typer.Option(help="Generator processes (open loop; for high rates).")
    ] = 1,
    precise: Annotated[
        bool,
        typer.Option(
            help="Busy-poll the last 1 ms before each send (sub-ms schedule, a busy core)."
        ),
    ] = False,
    ramp: Annotated[
        bool, typer.Option(help="Step the rate up from --rate until an SLO breaks.")
    ] = False,
    ramp_max: Annotated[float, typer.Option(help="Ramp: highest rate to try.")] = 10_000.0,
    ramp_factor: Annotated[
        float, typer.Option(help="Ramp: multiply the rate by this per step.")
    ] = 1.5,
    ramp_step: Annotated[
        float, typer.Option(help="Ramp: add this many rps per step instead.")
    ] = 0.0,
    step_duration: Annotated[float, duration_option("Ramp: length of each step.")] = "5s",  # type: ignore[assignment]
    slo: Annotated[
        list[str],
        typer.Option(help="SLO like p99=500ms, p99.9=2s, errors=0.1%, timeouts=0, rate=95%."),
    ] = [],  # noqa: B006
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the JSON report on stdout.")
    ] = False,
    out: Annotated[
        Path | None, typer.Option(help="Also write the JSON report to this file.")
    ] = None,
    records: Annotated[
        bool, typer.Option(help="Include per-request records in the JSON report.")
    ] = False,
    plot: Annotated[
        Path | None, typer.Option(help="Write a PNG: percentile spectrum + latency over time.")
    ] = None,
    hdr: Annotated[
        Path | None, typer.Option(help="Write an HdrHistogram log (tagged per outcome).")
    ] = None,
    allow_remote: Annotated[
        bool, typer.Option(help="Allow a target that does not resolve to loopback.")
    ] = False,
    quiet: Annotated[bool, typer.Option(help="No live display.")] = False,
) -> None:
    """Load-test a tool endpoint, open loop (latency from the scheduled send time) or closed loop.

    Exit codes: 0 all SLOs met; 1 an SLO broken; 2 bad options (incl. a remote target without
    --allow-remote); 3 the target never answered; 4 not one request succeeded.
    """
    err = Console(stderr=True)
    out_console = report_console(stderr=as_json)
    names = OPTION_OF_FIELD  # what a spec error calls each field
    try:
        target = resolve_target(
            url=url,
            gateway=gateway,
            tool=tool,
            body=body,
            body_file=body_file,
            payload=payload,
            arguments=arguments,
            method=method,
        )
        slos = [SLO.parse(s) for s in slo]
        spec = LoadSpec(
            url=target.url,
            body=target.body,
            method=target.method,
            headers=parse_headers(header),
            arrival=arrival,  # type: ignore[arg-type]
            rate=rate,
            concurrency=concurrency,
            duration_s=duration,
            max_requests=max_requests,
            max_in_flight=max_in_flight,
            connections=connections,
            timeout_s=timeout,
            capture_headers=tuple(capture_header),
            seed=seed,
            workers=workers,
            allow_remote=allow_remote,
            spin_s=0.001 if precise else 0.0,
            preconnect=preconnect,
            interruptible=True,  # Ctrl-C: the report of what was sent before it, exit 130
        )
        spec.validate()
        check_outputs(out=out, plot=plot, hdr=hdr)
        if records and not (as_json or out):  # they went nowhere, without a word
            raise ValueError(
                "--records adds every request to the JSON report: give --json or --out FILE too"
            )
        if capture_header and not records:  # kept per request, then shown nowhere
            raise ValueError(
                "--capture-header keeps a header's value in each request's record: "
                "give --records (with --json or --out FILE) too"
            )
        check_loopback(Endpoint.parse(spec.url).host, allow_remote=allow_remote)
        check_open_loop(spec, slos, ramp=ramp)
        check_loop_options(ctx, spec)
        check_ramp_options(ctx, ramp=ramp)
        if ramp:
            rates = ramp_rates(rate, factor=ramp_factor, step=ramp_step, max_rate=ramp_max)
            step_s = step_duration
            names = OPTION_OF_STEP_FIELD
            LoadSpec(**{**_fields(spec), "duration_s": step_s}).validate()
    except LoadSpecError as exc:
        raise _usage_error(err, exc.worded(names)) from exc
    except (TargetError, SLOError, RemoteTargetError, TargetURLError, ValueError) as exc:
        raise _usage_error(err, str(exc)) from exc

    if ramp:
        ramp_slos = slos or [SLO.parse(s) for s in DEFAULT_RAMP_SLOS]
        ramp_result = _run_ramp(spec, rates, ramp_slos, step_s, err, quiet or as_json)
        if not ramp_result.steps:
            raise typer.Exit(EXIT_NO_RESPONSE)
        last = ramp_result.steps[-1]
        report = {
            "ramp": ramp_result.as_dict(),
            "slos": [v.as_dict() for v in last.verdicts],
            "last_step": _json_ready(last.summary),
        }
        if records:  # the last step's, as its --plot and --hdr are (they went nowhere)
            report["records"] = _records(last.result)
        if not as_json:
            out_console.print(ramp_table(ramp_result))
        _write(err, report, as_json, out, last.result, plot, hdr)
        _exit_if_interrupted(err, last.result)
        if all(_never_answered(s.summary) for s in ramp_result.steps):
            err.print("[red]the target never answered[/red]")
            raise typer.Exit(EXIT_NO_RESPONSE)
        raise typer.Exit(EXIT_OK if ramp_result.knee_rate is not None else EXIT_SLO_BROKEN)

    result = _run_single(spec, err, quiet or as_json)
    summary = result.summary()
    verdicts = check_all(slos, summary)
    report = {**_json_ready(summary), "slos": [v.as_dict() for v in verdicts]}
    if records:
        report["records"] = _records(result)
    if not as_json:
        print_report(out_console, summary, verdicts)
    _write(err, report, as_json, out, result, plot, hdr)
    _exit_if_interrupted(err, result)
    if _never_answered(summary):
        err.print("[red]the target never answered[/red]")
        raise typer.Exit(EXIT_NO_RESPONSE)
    if not all(v.ok for v in verdicts):
        raise typer.Exit(EXIT_SLO_BROKEN)
    if "ok" not in summary["outcomes"]:
        failed = ", ".join(f"{name} {e['count']}" for name, e in summary["outcomes"].items())
        err.print(f"[red]not one request succeeded[/red] ({failed})", soft_wrap=True)
        raise typer.Exit(EXIT_ALL_FAILED)
    raise typer.Exit(EXIT_OK)


def _never_answered(summary: dict[str, Any]) -> bool:
    """No HTTP answer and no bytes that failed to parse as one: a server that answered each
    request at once with a malformed status line was "the target never answered" (exit 3)."""
    return summary["responses"] == 0 and "protocol_error" not in summary["outcomes"]


def _records(result: LoadResult) -> list[dict[str, Any]]:
    """Every request of a run, for the JSON report (`--records`)."""
    return [
        {
            "scheduled_s": r.scheduled_s,
            "sent_s": None if math.isnan(r.sent_s) else r.sent_s,
            "done_s": None if math.isnan(r.done_s) else r.done_s,
            "status": r.status,
            "error": r.error,
            "headers": dict(r.headers),
        }
        for r in result.records
    ]


def _exit_if_interrupted(err: Console, result: LoadResult) -> None:
    if result.interrupted:
        err.print("[yellow]interrupted:[/yellow] the report covers what was sent before Ctrl-C")
        raise typer.Exit(EXIT_INTERRUPTED)


def _fields(spec: LoadSpec) -> dict[str, Any]:
    return {f: getattr(spec, f) for f in LoadSpec.__dataclass_fields__}


@contextmanager
def _live_progress(spec: LoadSpec, console: Console, quiet: bool, title: str) -> Iterator[None]:
    """Show the run's progress live (terminal only), wired through `spec.progress`."""
    if quiet or not console.is_terminal:
        yield
        return
    view = LiveView(title)
    with Live(view, console=console, auto_refresh=False, transient=True) as live:

        def on_progress(p: Progress) -> None:
            view.update(p)
            live.refresh()

        spec.progress = on_progress
        try:
            yield
        finally:
            spec.progress = None


def _run_single(spec: LoadSpec, console: Console, quiet: bool) -> LoadResult:
    with _live_progress(spec, console, quiet, "stress"):
        return run_load(spec)


def _run_ramp(
    spec: LoadSpec,
    rates: list[float],
    slos: list[SLO],
    step_s: float,
    console: Console,
    quiet: bool,
) -> RampResult:
    def on_step(step: RampStep) -> None:
        if not quiet:
            console.print(ramp_step_line(step))

    with _live_progress(spec, console, quiet, "ramp step"):
        return run_ramp(spec, rates, slos, step_duration_s=step_s, on_step=on_step)


def _json_ready(value: Any) -> Any:
    """NaN -> null, numpy scalars -> Python numbers (strict JSON for other tools)."""
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, str | bytes):
        value = value.item()
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return value


def _write(
    err: Console,
    report: dict[str, Any],
    as_json: bool,
    out: Path | None,
    result: LoadResult,
    plot: Path | None,
    hdr: Path | None,
) -> None:
    """The report and its files; a file that cannot be written is one line, exit 2."""
    try:
        _emit(report, as_json, out)
        _files(result, plot, hdr)
    except OSError as exc:
        raise _usage_error(err, f"cannot write {exc.filename}: {exc.strerror}") from exc


def _emit(report: dict[str, Any], as_json: bool, out: Path | None) -> None:
    text = json.dumps(_json_ready(report), indent=2, allow_nan=False)
    if as_json:
        typer.echo(text)
    if out is not None:
        write_whole(out, text + "\n")


def _files(result: LoadResult, plot: Path | None, hdr: Path | None) -> None:
    if plot is not None:
        write_plot(result, plot)
    if hdr is not None:
        write_hdr(result, hdr)


def build_app() -> typer.Typer:
    """A standalone app (`python -m stress`), same command as `toolenv stress`."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command("stress")(stress)
    return app
