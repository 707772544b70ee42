"""A service served from the command line: its port bound before its app starts.

Why: uvicorn binds after the app's startup (the gateway started its embedded tools, a sandbox
pool among them, only to stop them again) and then says only `ERROR: [Errno 98] error while
attempting to bind on address ('127.0.0.1', 8080): address already in use`. Bound first, a port
in use (or not ours to bind) is one line saying which and what to do, before anything starts.
"""

from __future__ import annotations

import errno
import socket

import typer
import uvicorn

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


def serve(config: uvicorn.Config, announce: str | None = None) -> None:
    """Serve `config`'s app on its host and port until SIGINT/SIGTERM. A port that cannot be
    bound is `error: ...` on stderr and exit 3 before the app starts, as is an app that fails
    to start (uvicorn has said why). `announce` goes to stderr once the port is bound: said
    before, it claimed a server on a port that then failed."""
    try:
        sock = bind(config.host, config.port)
    except OSError as exc:
        typer.echo(f"error: {bind_message(config.host, config.port, exc)}", err=True)
        raise typer.Exit(STARTUP_FAILURE) from None
    if announce:
        typer.echo(announce, err=True)
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    if not server.started:
        raise typer.Exit(STARTUP_FAILURE)
