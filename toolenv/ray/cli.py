"""`toolenv serve --ray [ADDRESS]`: deploy on a Ray cluster, wait until it answers, then stay in
the foreground like `serve run` (Ctrl-C deletes the application) unless `--detach`."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import httpx
import ray
import typer
from ray import serve
from ray.exceptions import RayError
from ray.serve import Application
from ray.serve.exceptions import RayServeException
from rich.console import Console

from toolenv_core.config import ConfigFileError, config_error
from toolenv_core.ray_connect import LOCAL, RayUnreachable, check_reachable

from .app import (
    DeployFailed,
    RayStack,
    app_status,
    build_application,
    connect,
    deploy,
    remove_failed,
)
from .ingress import gateway_url

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C and `kill`
SHUTDOWN_WITHOUT_GCS_S = 10.0  # how long Ray's driver shutdown may take once the GCS is gone


def run_on_ray(
    address: str,
    config_file: str | None,
    bind: tuple[str | None, int | None],
    allow_unauthenticated: bool,
    detach: bool,
    ready_timeout_s: float,
) -> None:
    """`bind` is `--host`/`--port` (each overrides `ray.http_host`/`http_port` when given)."""
    console = Console(stderr=True)
    if detach and address == LOCAL:
        # A local cluster started by this command ends with it: nothing would stay deployed.
        typer.echo(
            "error: --detach needs a running cluster (`--ray auto` or HOST:PORT): a local one "
            "ends with this command",
            err=True,
        )
        raise typer.Exit(2)
    try:
        stack = RayStack.load(config_file, address=address)
        host, port = bind
        where = {"http_host": host, "http_port": port}
        stack.ray = stack.ray.model_copy(update={k: v for k, v in where.items() if v is not None})
        if allow_unauthenticated:
            stack.gateway = stack.gateway.model_copy(update={"allow_unauthenticated": True})
        # Ray checks the deployments' options (e.g. `resources`) as they are built: before any
        # cluster is started or joined.
        app = build_application(stack)
    except (ConfigFileError, ValueError) as exc:  # a ValidationError too: one line, as `serve`
        typer.echo(f"error: {config_error(exc)}", err=True)
        raise typer.Exit(2) from exc
    url = gateway_url(stack.ray.http_host, stack.ray.http_port)
    try:
        node = start(stack, app, url, ready_timeout_s, console, detach)
        console.print(
            f"[green]toolenv is serving on Ray[/] at {url} on node {node} "
            f"(application {stack.ray.app_name!r})"
        )
        if detach:
            return
        wait_for_stop_signal()
    except StartInterrupted as exc:
        console.print(f"interrupted ({exc.signal.name}) while starting: stopping what started")
        ignore_stop_signals()  # the replicas' own stop takes seconds: let it finish
        if ray.is_initialized():
            with contextlib.suppress(Exception):  # there may be nothing (whole) to delete
                serve.delete(stack.ray.app_name)
        ray.shutdown()  # also stops a local cluster that `ray.init` had only begun to start
        raise typer.Exit(128 + exc.signal) from None
    gone = cluster_gone()
    if gone is not None:
        typer.echo(
            f"error: {gone}: application {stack.ray.app_name!r} could not be deleted", err=True
        )
        # Ray's driver shutdown (which also stops a local cluster's processes) may wait on the
        # GCS too: bounded, then out without Python's exit hooks (Ray's would wait as well)
        stopping = threading.Thread(target=ray.shutdown, daemon=True)
        stopping.start()
        stopping.join(SHUTDOWN_WITHOUT_GCS_S)
        os._exit(1)
    console.print("deleting the application")
    serve.delete(stack.ray.app_name)
    ray.shutdown()


def cluster_gone() -> str | None:
    """Why the cluster this command is connected to no longer answers, else None. Its GCS
    refusing connections is a cluster whose head died: `serve.delete` then waited, deaf to
    Ctrl-C, until Ray's driver gave up on the GCS (60 s) and exited 1 in a flood of native log
    lines, after the command had said "deleting the application"."""
    try:
        check_reachable(ray.get_runtime_context().gcs_address, timeout_s=2)
    except RayUnreachable as exc:
        return f"the Ray cluster stopped answering ({exc})"
    return None


class StartInterrupted(BaseException):
    """SIGINT or SIGTERM while the stack was starting. Not an `Exception`, as KeyboardInterrupt
    is not: Ray's and Serve's code running when it is raised catches those."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signal = signal.Signals(signum)


def _interrupt(signum: int, _frame: object) -> None:
    raise StartInterrupted(signum)


def interrupt_on_stop_signals() -> None:
    """SIGINT and SIGTERM raise `StartInterrupted` in the main thread, installed explicitly as
    `wait_for_stop_signal` does (a background job starts with SIGINT ignored)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupt)


def start(
    stack: RayStack,
    app: Application,
    url: str,
    ready_timeout_s: float,
    console: Console,
    detach: bool = False,
) -> str:
    """Connect, deploy (each deployment running within `ready_timeout_s`) and wait for a
    gateway replica's `/readyz` (`wait_ready`); returns that replica's node. A failure is one
    line (what Serve says of the deployments, or what `/readyz` said last) and exit 1, once
    the application it created is deleted (`remove_failed`). Raises
    `StartInterrupted` at a stop signal, whenever it comes. `ray.init` installs SIGTERM handlers
    of its own, a Python one that exits and a native one that crashes the driver: the stop
    signals are taken back as soon as it returns, and its exit is read as the SIGTERM it was."""
    where = stack.ray.address or "a new local cluster"
    interrupt_on_stop_signals()
    try:
        with console.status(f"deploying toolenv on Ray ({where})"):
            try:
                connect(stack)
            finally:
                interrupt_on_stop_signals()
            taken = someone_else_answers(stack.ray.app_name, url, foreground=not detach)
            if taken is not None:
                typer.echo(f"error: {taken}", err=True)
                raise typer.Exit(1)
            created = deploy(stack, app, ready_timeout_s)
        with console.status(f"waiting for {url}/readyz"):
            node, problem = wait_ready(stack.ray.app_name, ready_timeout_s)
        if problem is not None:
            raise DeployFailed(f"not ready after {ready_timeout_s:.0f} s: {problem}", created)
        return node
    except RayUnreachable as exc:
        typer.echo(f"error: {exc} (--ray)", err=True)
        raise typer.Exit(1) from exc
    except DeployFailed as exc:
        note = ""
        if stack.ray.address is not None:  # a local cluster stops with this command, and all on it
            with console.status(f"deleting application {stack.ray.app_name}"):
                note = f" ({remove_failed(stack.ray.app_name, exc.created)})"
        typer.echo(f"error: {exc}{note}", err=True)
        raise typer.Exit(1) from exc
    except KeyboardInterrupt:
        raise StartInterrupted(signal.SIGINT) from None
    except SystemExit as exc:  # ray.init's own SIGTERM handler
        if exc.code != signal.SIGTERM:
            raise
        raise StartInterrupted(signal.SIGTERM) from None


def ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def wait_for_stop_signal() -> None:
    """Block until SIGINT or SIGTERM. The handlers are installed explicitly, as uvicorn does, so
    Ctrl-C and `kill` both clean up even when the command was started with SIGINT ignored (a
    background job of a non-interactive shell), where Python raises no KeyboardInterrupt. They
    stay installed: a second signal does not cut the clean-up short."""
    stop = threading.Event()
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


def someone_else_answers(app_name: str, url: str, foreground: bool = False) -> str | None:
    """What already answers at the gateway's URL when the application is new, else None. The
    gateway replicas bind with SO_REUSEPORT (`ingress`), so those of a second application on
    the same port (or a second local cluster's) bound beside the first one's without a word,
    and the kernel split the calls between the two. An application being updated answers
    there itself, with `--detach`; in the `foreground` the command deletes its application
    when it stops, and a second one took over the first one's (restarting its replicas) and
    deleted it from under it at Ctrl-C."""
    serve.start(proxy_location="Disabled")
    if app_status(app_name) is not None:
        if not foreground:
            return None
        return (
            f"application {app_name!r} already runs on this cluster, and this command would "
            "take it over and delete it when stopped. Update it with --detach, delete it "
            "(docs/ray.md), or give this one its own ray.app_name and ray.http_port"
        )
    try:
        resp = httpx.get(f"{url}/healthz", timeout=2)
    except httpx.HTTPError:
        return None
    return (
        f"{url} already answers (HTTP {resp.status_code} to /healthz): another application's "
        f"gateway, or another server? A new application {app_name!r} would share its port "
        "and the calls would be split between the two. Pick another port (ray.http_port, "
        "--port) or stop what listens there"
    )


def wait_ready(app_name: str, timeout_s: float) -> tuple[str, str | None]:
    """Until a gateway replica says its `/readyz` answers 200 on its own node (`readiness`):
    that node's address and None, else what it said last. The replica reads it, not this
    command: it may run on another node, where `http_host` (loopback by default) is not this
    machine's."""
    handle = serve.get_app_handle(app_name).options(method_name="readiness")
    end = time.monotonic() + timeout_s
    node, last = "", "no answer yet"
    while time.monotonic() < end:
        try:
            node, problem = handle.remote().result(timeout_s=10)
        except (RayError, RayServeException, TimeoutError) as exc:
            problem = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if problem is None:
            return node, None
        last = problem
        time.sleep(0.5)
    return node, last
