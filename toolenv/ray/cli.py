"""`toolenv serve --ray [ADDRESS]`: deploy on a Ray cluster, wait until it answers, then stay in
the foreground like `serve run` (Ctrl-C deletes the application) unless `--detach`."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import ray
import typer
from ray import serve
from rich.console import Console

from toolenv_core.config import ConfigFileError, config_error
from toolenv_core.ray_connect import LOCAL, RayUnreachable

from .app import DeployFailed, RayStack, build_application, deploy


def run_on_ray(
    address: str, config_file: str | None, port: int | None, detach: bool, ready_timeout_s: float
) -> None:
    console = Console(stderr=True)
    if detach and address == LOCAL:
        # A local cluster started by this command ends with it: nothing would stay deployed.
        console.print("[red]--detach needs a running cluster[/] (`--ray auto` or HOST:PORT)")
        raise typer.Exit(2)
    try:
        stack = RayStack.load(config_file, address=None if address == LOCAL else address)
        if port is not None:
            stack.ray = stack.ray.model_copy(update={"http_port": port})
        # Ray checks the deployments' options (e.g. `resources`) as they are built: before any
        # cluster is started or joined.
        app = build_application(stack)
    except (ConfigFileError, ValueError) as exc:  # a ValidationError too: one line, as `serve`
        typer.echo(f"error: {config_error(exc)}", err=True)
        raise typer.Exit(2) from exc
    where = stack.ray.address or "a new local cluster"
    url = f"http://{stack.ray.http_host}:{stack.ray.http_port}"
    try:
        with console.status(f"deploying toolenv on Ray ({where})"):
            deploy(stack, app)
    except RayUnreachable as exc:
        typer.echo(f"error: {exc} (--ray)", err=True)
        raise typer.Exit(1) from exc
    except DeployFailed as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    with console.status(f"waiting for {url}/readyz"):
        problem = wait_ready(url, ready_timeout_s)
    if problem is not None:
        console.print(f"[red]not ready after {ready_timeout_s:.0f} s:[/] {problem}")
        raise typer.Exit(1)
    console.print(
        f"[green]toolenv is serving on Ray[/] at {url} (application {stack.ray.app_name!r})"
    )
    if detach:
        return
    wait_for_stop_signal()
    console.print("deleting the application")
    serve.delete(stack.ray.app_name)
    ray.shutdown()


def wait_for_stop_signal() -> None:
    """Block until SIGINT or SIGTERM. The handlers are installed explicitly, as uvicorn does, so
    Ctrl-C and `kill` both clean up even when the command was started with SIGINT ignored (a
    background job of a non-interactive shell), where Python raises no KeyboardInterrupt."""
    stop = threading.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in signals}
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_ready(url: str, timeout_s: float) -> str | None:
    """None once `/readyz` answers 200, else what it said last."""
    end = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < end:
        try:
            resp = httpx.get(f"{url}/readyz", timeout=5)
            if resp.status_code == 200:
                return None
            last = f"{resp.status_code} {resp.text[:300]}"
        except httpx.HTTPError as exc:
            last = str(exc) or type(exc).__name__
        time.sleep(0.5)
    return last
