"""sandboxd subcommands: `toolenv sandboxd serve`, `toolenv sandboxd settings`."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated, Any

import typer
import uvicorn

from toolenv_core import serving
from toolenv_core.cli_options import ConfigFileOption
from toolenv_core.config import ConfigFileError, config_error
from toolenv_core.headbound import HeadBound
from toolenv_core.outputs import output_dir_problem
from toolenv_core.shutdown import AnswerCutCalls, cut_detail

from .app import create_app
from .languages import PythonNotFound, find_python
from .process import BWRAP_INSTALL_HINT
from .settings import SandboxSettings
from .sizing import PROGRAMS_PER_CORE

app = typer.Typer(help="sandboxd commands.", no_args_is_help=True)


@app.command("settings")
def show_settings(
    config: ConfigFileOption = None,
) -> None:
    """Print this service's effective settings as JSON (what `serve --config FILE` would use)."""
    try:
        settings = SandboxSettings.load(config)
    except ValueError as exc:  # the config file or a TOOLENV_SANDBOX_* variable
        typer.echo(f"error: {config_error(exc)}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(settings.model_dump_json(indent=2))


def _process_backend_problem(settings: SandboxSettings) -> str | None:
    """A setting that stops the process backend, found before the port is bound: found as the
    backend starts, it was uvicorn's traceback of the app's start-up, and exit 3."""
    try:
        find_python(settings.python)
    except PythonNotFound as exc:
        return str(exc)
    root = settings.workdir_root
    if root and (problem := output_dir_problem(Path(root))):
        return (
            f"the run directory root {root} (sandbox.workdir_root, TOOLENV_SANDBOX_WORKDIR_ROOT): "
            f"{problem}; name a writable directory"
        )
    return None


@app.command("serve")
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8081).")] = None,
    backend: Annotated[
        str | None, typer.Option(help="process (bubblewrap, the default) or docker.")
    ] = None,
    config: ConfigFileOption = None,
    max_concurrency: Annotated[
        int | None,
        typer.Option(
            help=f"Programs run at once (0: {PROGRAMS_PER_CORE} per CPU core, fewer if memory "
            "cannot hold that many at the default memory limit; never more than docker_pool_size "
            "on Docker; /v1/sandbox/status says which)."
        ),
    ] = None,
    insecure_no_isolation: Annotated[
        bool,
        typer.Option(
            "--insecure-no-isolation",
            help="Run programs without bubblewrap (trusted code only).",
        ),
    ] = False,
    log_level: Annotated[
        str | None,
        typer.Option(help="critical, error, warning (the default), info, debug or trace."),
    ] = None,
    allow_unauthenticated: Annotated[
        bool,
        typer.Option(
            "--allow-unauthenticated",
            help="Allow a --host other hosts reach: sandboxd has no authentication (only where "
            "trusted hosts alone reach it, such as a private container network).",
        ),
    ] = False,
) -> None:
    """Serve the sandbox API alone (`/run_code`, `/v1/run_tests`, `/v1/ping`, ...)."""
    overrides: dict[str, Any] = {}
    for key, value in (
        ("host", host),
        ("port", port),
        ("backend", backend),
        ("max_concurrency", max_concurrency),
        ("log_level", log_level),
    ):
        if value is not None:
            overrides[key] = value
    if insecure_no_isolation:
        overrides["insecure_no_isolation"] = True
    if allow_unauthenticated:
        overrides["allow_unauthenticated"] = True
    try:
        settings = SandboxSettings.load(config, **overrides)
        settings.check_bind()
    except (ConfigFileError, ValueError) as exc:
        typer.echo(f"error: {config_error(exc)}", err=True)
        raise typer.Exit(2) from exc
    if settings.backend == "process" and (problem := _process_backend_problem(settings)):
        typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(2)
    if settings.backend == "process" and not settings.insecure_no_isolation:
        if not shutil.which(settings.bwrap_path or "bwrap"):
            typer.echo(f"error: bwrap not found. {BWRAP_INSTALL_HINT}", err=True)
            raise typer.Exit(2)
    server_config = uvicorn.Config(
        AnswerCutCalls(
            create_app(settings),
            cut_detail("sandboxd", f"shutdown_grace_s ({settings.shutdown_grace_s:g} s)"),
        ),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        # SIGINT or SIGTERM: stop accepting, let the runs in flight finish (as the gateway does),
        # then close the backend (a run still going then is cut: AnswerCutCalls). A second Ctrl-C
        # (SIGINT) stops at once.
        timeout_graceful_shutdown=settings.shutdown_grace_s,
        http=HeadBound,  # a request head bounded in size and time (uvicorn bounds neither)
    )
    # a port in use: one line saying so, exit 3 (and no "serving on" line before it)
    serving.serve(
        server_config,
        f"sandboxd: backend={settings.backend} concurrency={settings.concurrency}, "
        "serving on {url}",
    )
