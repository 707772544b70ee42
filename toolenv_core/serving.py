"""A service served from the command line: its port bound before its app starts.

Why: uvicorn binds after the app's startup (the gateway started its embedded tools, a sandbox
pool among them, only to stop them again) and then says only `ERROR: [Errno 98] error while
attempting to bind on address ('127.0.0.1', 8080): address already in use`. Bound first, a port
in use (or not ours to bind) is one line saying which and what to do, before anything starts.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket

import typer
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

STARTUP_FAILURE = 3  # uvicorn's exit status when a server could not start


def bind_message(host: str, port: int, exc: OSError) -> str:
    """What to tell the user when `host:port` cannot be bound."""
    where = f"{host}:{port}"
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"cannot listen on {where}: {host} is not an address of this machine "
            "(choose another with --host, e.g. 127.0.0.1)"
        )
    if exc.errno == errno.EADDRINUSE:
        return (
            f"{where} is already in use (another server listens there): stop it, "
            "or choose another port with --port"
        )
    if exc.errno == errno.EACCES:
        return (
            f"no permission to listen on {where} (ports below 1024 need privileges): "
            "choose another port with --port"
        )
    return f"cannot listen on {where}: {exc.strerror or exc}"


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` as asyncio binds uvicorn's (SO_REUSEADDR; an IPv6 host
    only for IPv6). Raises OSError; `bind_message` says it to the user."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def listen_url(sock: socket.socket) -> str:
    """The URL a bound socket serves: its real port (`--port 0` picks one), IPv6 in brackets."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class OneLineStartupFailure:
    """An app whose start-up raises is told as one line, `ERROR: <Class>: <text>`, then uvicorn's
    `Application startup failed. Exiting.`: Starlette's failure message is the whole traceback
    (40 lines of the server's own files for `sandboxd serve --backend docker` with no engine,
    the reason on the last). The traceback is still logged, at debug level (`--log-level debug`).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        held: list[Message] = []

        async def hold_startup_failure(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed":
                held.append(message)  # told once the app has raised what it failed with
            else:
                await send(message)

        try:
            await self.app(scope, receive, hold_startup_failure)
        except Exception as exc:
            if not held:
                raise
            logging.getLogger("uvicorn.error").debug("the app's start-up failed", exc_info=exc)
            text = str(exc)
            failed = {"type": "lifespan.startup.failed", "message": type(exc).__name__}
            if text:
                failed["message"] += f": {text}"
            await send(failed)
            raise  # uvicorn, told the start-up failed, does not log it again
        if held:
            await send(held[0])


class _Server(uvicorn.Server):
    """uvicorn's server, saying where it serves once the app has started: uvicorn logs its
    `Uvicorn running on ...` only for sockets it bound itself, so with ours nothing said where
    (nor which port `--port 0` got)."""

    def __init__(self, config: uvicorn.Config, announce: str) -> None:
        super().__init__(config)
        self.announce = announce

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and sockets:
            typer.echo(self.announce.format(url=listen_url(sockets[0])), err=True)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """A second Ctrl-C (uvicorn's force exit) stops at once, but uvicorn then leaves the
        calls running and skips the app's shutdown: asyncio cancelled both together as the
        process ended, the tools closing under runs still going (two tracebacks, and a run's
        caller got a 200 `sandbox backend error: OSError ...`). Here the calls are cut first
        (each caller gets its 503), then the tools close as on a graceful stop."""
        await super().shutdown(sockets=sockets)
        lifespan_done = getattr(self.lifespan, "shutdown_event", None)
        if not self.force_exit or lifespan_done is None or lifespan_done.is_set():
            return
        calls = list(self.server_state.tasks)
        for call in calls:
            call.cancel(msg="stopped at once by a second Ctrl-C")
        await asyncio.gather(*calls, return_exceptions=True)
        await self.lifespan.shutdown()


def serve(config: uvicorn.Config, announce: str) -> None:
    """Serve `config`'s app on its host and port until SIGINT/SIGTERM. A port that cannot be
    bound is `error: ...` on stderr and exit 3 before the app starts, as is an app that fails
    to start (uvicorn has said why, in one line: `OneLineStartupFailure`). Once the app has started, `announce` (with `{url}`, the
    address really bound) goes to stderr."""
    try:
        sock = bind(config.host, config.port)
    except OSError as exc:
        typer.echo(f"error: {bind_message(config.host, config.port, exc)}", err=True)
        raise typer.Exit(STARTUP_FAILURE) from None
    config.app = OneLineStartupFailure(config.app)
    server = _Server(config, announce)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    if not server.started:
        raise typer.Exit(STARTUP_FAILURE)
