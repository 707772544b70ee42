"""The gateway's own commands (`toolenv gateway ...`) and how a built gateway app is served.

Building the app with its embedded tools is wiring, done by the `toolenv` CLI (`toolenv serve`,
`toolenv gateway serve`), the one place that knows every service.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
import uvicorn
from fastapi import FastAPI

from toolenv_core import serving
from toolenv_core.console import counted
from toolenv_core.polytrace.errors import TraceFormatError
from toolenv_core.shutdown import AnswerCutCalls

from .lane import lane_protocol
from .logs import setup_logging
from .passthrough import shutdown_cut_detail
from .settings import GatewaySettings
from .state import state_of_app
from .trace import to_multiturn


def build_cli() -> typer.Typer:
    """`toolenv gateway`: the gateway's own commands (the CLI adds `serve`, which wires)."""
    cli = typer.Typer(help="The gateway: one front door for every tool.", no_args_is_help=True)
    cli.command("trace-to-multiturn")(trace_to_multiturn)
    return cli


def uvicorn_config(
    gateway: FastAPI, settings: GatewaySettings, host: str | None = None, port: int | None = None
) -> uvicorn.Config:
    """How a built gateway app is served: here (`run`) and inside a Ray replica (`toolenv.ray`)."""
    return uvicorn.Config(
        # a call cut at the shutdown grace: a 503 saying so, not uvicorn's plain-text 500
        AnswerCutCalls(gateway, shutdown_cut_detail(settings.shutdown_grace_s)),
        http=lane_protocol(state_of_app(gateway)),  # the hot routes served on the connection
        host=settings.host if host is None else host,
        port=settings.port if port is None else port,
        log_level=settings.log_level,
        lifespan="on",
        access_log=False,
        proxy_headers=False,  # X-Forwarded-* are not trusted: the caller is the socket's peer
        backlog=settings.backlog,
        # SIGINT (Ctrl-C) or SIGTERM: stop accepting, let the calls in flight finish, then stop
        # the tools. A second Ctrl-C (SIGINT) stops at once.
        timeout_graceful_shutdown=settings.shutdown_grace_s,
    )


def run(gateway: FastAPI, settings: GatewaySettings, also_log: tuple[str, ...] = ()) -> None:
    """Serve a built gateway app where its settings say, until SIGINT/SIGTERM; `also_log`: the
    loggers of the tools served in this process, logged as the gateway's own lines."""
    setup_logging(settings.log_level, also=also_log)
    # a port in use is said before the tools start
    serving.serve(uvicorn_config(gateway, settings), "gateway: serving on {url}")


def trace_to_multiturn(
    capture: Annotated[Path, typer.Argument(help="JSONL written by the gateway's trace capture.")],
    out: Annotated[
        Path, typer.Argument(help="PolyTrace multi-turn JSONL to write (`-`: standard output).")
    ],
) -> None:
    """Group captured tool calls per trajectory into PolyTrace multi-turn records (for the emulators)."""
    # A pipe (`<(zcat capture.jsonl.gz)`) is read like a file: only what is absent or a folder is
    # refused here (a pipe was "does not exist").
    if capture.is_dir() or not capture.exists():
        why = "is a directory; name the capture file" if capture.is_dir() else "does not exist"
        typer.echo(f"error: {capture} {why}", err=True)
        raise typer.Exit(2)
    to_stdout = str(out) == "-"  # it wrote a file named "-"
    if not to_stdout and out.exists() and capture.samefile(out):  # overwritten by itself
        typer.echo(f"error: {out} is the capture itself; name another file to write", err=True)
        raise typer.Exit(2)
    try:
        converted = to_multiturn(capture, sys.stdout if to_stdout else out)
    except TraceFormatError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    except BrokenPipeError:  # `- | head`: the reader has all it wants; click ends it quietly
        raise
    except OSError as exc:  # the capture's own are TraceFormatError: this is the output's
        typer.echo(f"error: cannot write the trace to {out}: {exc.strerror or exc}", err=True)
        raise typer.Exit(2) from exc
    if converted.torn_line is not None:
        typer.echo(
            f"warning: {capture}:{converted.torn_line} stops mid-record (the gateway was stopped "
            "while writing it): that call is left out",
            err=True,
        )
    where = "standard output" if to_stdout else out  # the records alone on stdout then
    typer.echo(f"wrote {counted(converted.trajectories, 'trajectory')} to {where}", err=to_stdout)
