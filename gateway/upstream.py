"""Where a tool's calls go: an in-process app (embedded) or a set of upstream URLs (proxy).

Both expose the same small surface (`pick`, `send`, `not_ready`), so admission, deadlines,
hedging, retries and metrics wrap either the same way. Proxy mode balances by least outstanding
requests and keeps an active health check per upstream; a refused connection also marks an
upstream down at once (a passive check), so callers stop paying connect errors. Upstream HTTP
goes through the lean client's `http1_pool.Pool` (one keep-alive pool per upstream).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from toolenv_core import headers as h
from toolenv_core.http1_pool import (
    KEPT_HEADERS,
    NO_LIMIT,
    ConnectFailed,
    ConnectionBroken,
    Pool,
    ResponseTooLarge,
)

from .asgi import ASGIApp, Lifespan, call_asgi, raw_headers
from .settings import ToolConfig

log = logging.getLogger("toolenv.gateway")

INJECTED_DELAY_HEADER = h.INJECTED_DELAY.lower()  # replies' header keys are lower-cased here
EXECUTOR_HEADERS = (h.EXECUTOR_NODE.lower(), h.EXECUTOR_REPLICA.lower())  # where a call ran
DEADLINE_EXPIRED_HEADER = h.DEADLINE_EXPIRED.lower()  # the tool's deadline ended the call
FAULT_HEADER = h.FAULT.lower()  # the fault an emulator injected, passed on to the caller
# the reply headers kept, embedded, on Ray and proxied alike (the rest are skipped unread): the
# lean client's own (content type, injected delay, Retry-After), and the gateway's
_KEPT_HEADERS = (*KEPT_HEADERS, DEADLINE_EXPIRED_HEADER, FAULT_HEADER, *EXECUTOR_HEADERS)


class UpstreamConnectError(Exception):
    """The request never reached the upstream (refused, unreachable): safe to retry anywhere."""


class AppNotStarted(UpstreamConnectError):
    """An in-process tool's app did not start: the call reached no app, as no upstream."""


class UpstreamBroken(Exception):
    """The upstream took the request and then failed it at the transport level (e.g. died)."""


class UpstreamTooLarge(UpstreamBroken):
    """The upstream's answer grew past `upstream_max_body_bytes`: cut there, never retried (the
    same call would bring the same answer)."""


@dataclass(slots=True)
class UpstreamReply:
    status: int
    body: bytes
    headers: dict[str, str]
    endpoint: str

    @property
    def injected_delay_s(self) -> float | None:
        """The delay the tool says it injected; None unless a finite, non-negative number (one
        `nan` made the histogram's sum NaN for good)."""
        raw = self.headers.get(INJECTED_DELAY_HEADER)
        if raw is None:
            return None
        try:
            ms = float(raw)
        except ValueError:
            return None
        return ms / 1000.0 if 0 <= ms < math.inf else None


@dataclass(eq=False, slots=True)
class Endpoint:
    """One place a call can go, with the counters balancing and health need."""

    label: str
    outstanding: int = 0
    healthy: bool = True
    last_error: str | None = None
    checked: bool = False
    pool: Pool | None = None  # proxy mode: this upstream's keep-alive connections


class Backend(Protocol):
    endpoints: list[Endpoint]

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def not_ready(self) -> str | None:
        """None when calls can be taken, else a message saying what is missing."""

    def one_replica_of_many(self) -> str | None:
        """None when a change sent to every endpoint reaches every instance of the tool, else
        what runs behind an endpoint that the change would reach only one of."""

    async def send(
        self, endpoint: Endpoint, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> UpstreamReply: ...


def pick(endpoints: list[Endpoint], turn: int = 0) -> Endpoint:
    """Where a call's first attempt goes: least outstanding requests among healthy endpoints (all
    of them if none is healthy: the call still tries, and says no upstream was reachable).

    Ties go round-robin from position `turn`, so an idle pool still spreads its calls.
    """
    if len(endpoints) == 1:
        return endpoints[0]  # the common case: nothing to choose
    return _least_busy([e for e in endpoints if e.healthy] or endpoints, turn)


def pick_another(endpoints: list[Endpoint], used: Iterable[Endpoint], turn: int = 0) -> Endpoint:
    """Where a hedge or a retry goes, given the endpoints the call has `used` (failed on, or still
    in flight at): first a healthy one it has not used, then any healthy one, and only when every
    endpoint is known to be down one of those (unused first). A hedge is not sent to an endpoint
    known to be down; a retry is (with backoff it rides out an upstream's restart)."""
    if len(endpoints) == 1:
        return endpoints[0]
    seen = set(map(id, used))
    fresh = [e for e in endpoints if id(e) not in seen]
    for group in ([e for e in fresh if e.healthy], [e for e in endpoints if e.healthy], fresh):
        if group:
            return _least_busy(group, turn)
    return _least_busy(endpoints, turn)


def _least_busy(endpoints: list[Endpoint], turn: int) -> Endpoint:
    """Least outstanding requests; ties go round-robin from position `turn`."""
    n = len(endpoints)
    if n == 1:
        return endpoints[0]
    start = turn % n
    return min(endpoints[start:] + endpoints[:start], key=lambda e: e.outstanding)


# ------------------------------------------------------------------ embedded


async def _no_app(scope: Any, receive: Any, send: Any) -> None:
    """Stands for an app whose factory failed (`EmbeddedApp.failed`): never started, never called."""
    raise RuntimeError("this in-process app failed to start")


class EmbeddedApp:
    """One in-process application (shared by tools that mount the same one) and its lifespan.

    `ref` names the mount: a built-in one ("sandboxd", "emulators") or a custom tool's
    "module:factory".
    """

    def __init__(self, ref: str, app: ASGIApp) -> None:
        self.ref = ref
        self.app = app
        self.lifespan = Lifespan(app, ref)
        self.started = False
        self.error: str | None = None

    @classmethod
    def failed(cls, ref: str, error: str) -> EmbeddedApp:
        """An app whose factory failed: never started, its tools unavailable naming `error`."""
        failed = cls(ref, _no_app)
        failed.error = error
        log.error("embedded app failed to start", extra={"app": ref, "error": error})
        return failed

    async def start(self) -> None:
        if self.error is not None:
            return  # its factory failed: there is no app to start
        try:
            await self.lifespan.start()
            self.started = True
        except Exception as exc:
            # LifespanError names the app already: kept once in the messages built from this
            self.error = str(exc).removeprefix(f"{self.ref} failed to start: ")
            log.error("embedded app failed to start", extra={"app": self.ref, "error": str(exc)})

    async def stop(self) -> None:
        if self.started:
            self.started = False
            await self.lifespan.stop()


class LocalBackend:
    """A tool mounted in-process: calls run in the caller's task, so cancellation reaches them."""

    def __init__(self, tool: ToolConfig, app: EmbeddedApp) -> None:
        self.tool = tool
        self.app = app
        self.endpoints = [Endpoint(label=f"embedded:{app.ref}")]

    async def start(self) -> None:  # the shared EmbeddedApp is started by the registry
        return None

    async def close(self) -> None:
        return None

    def one_replica_of_many(self) -> str | None:
        return None  # one in-process app

    def not_ready(self) -> str | None:
        if self.app.started:
            return None
        return f"tool {self.tool.name!r}: in-process app {self.app.ref} " + (
            f"failed to start: {self.app.error}" if self.app.error else "not started"
        )

    async def send(
        self, endpoint: Endpoint, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> UpstreamReply:
        if not self.app.started:  # as an upstream nobody can reach: 503 naming why, not a 502
            why = f"failed to start: {self.app.error}" if self.app.error else "has not started"
            raise AppNotStarted(f"its in-process app {self.app.ref} {why}")
        try:
            status, out, payload = await call_asgi(
                self.app.app, method, path, body, raw_headers(headers), self.app.lifespan.state
            )
        except (ConnectionError, RuntimeError) as exc:
            raise UpstreamBroken(str(exc)) from exc
        return asgi_reply(status, out, payload, endpoint.label)


def asgi_reply(
    status: int, headers: list[tuple[bytes, bytes]], body: bytes, label: str
) -> UpstreamReply:
    """An in-process (or in-replica) ASGI answer as a reply, keeping only the headers we use."""
    if not 100 <= status <= 599:  # as the proxy client reads one (`http1`): a broken answer
        raise UpstreamBroken(f"{label}: unparsable answer (status {status} is outside 100-599)")
    kept = {}
    for k, v in headers:
        key = k.decode("latin-1").lower()
        if key in _KEPT_HEADERS:
            kept[key] = v.decode("latin-1")
    return UpstreamReply(status, body, kept, label)


# ------------------------------------------------------------------ proxy


class RemoteBackend:
    """A tool served by one or more upstream URLs (one keep-alive pool each)."""

    def __init__(
        self,
        tool: ToolConfig,
        connect_timeout_s: float,
        keepalive_s: float,
        max_idle: int = 1024,
        max_body_bytes: int = NO_LIMIT,
    ) -> None:
        self.tool = tool
        self.endpoints = [
            Endpoint(
                label=url,
                pool=Pool(
                    url, connect_timeout_s, keepalive_s, max_idle, _KEPT_HEADERS, max_body_bytes
                ),
            )
            for url in tool.upstreams
        ]
        self._health_task: asyncio.Task[None] | None = None
        # a request that may run only once is not sent again when a kept-alive connection closes
        # unanswered: the upstream may have read it and died (a broken call, 502)
        self._resend = tool.is_idempotent

    async def start(self) -> None:
        await self.check_all()
        self._health_task = asyncio.create_task(
            self._health_loop(), name=f"health:{self.tool.name}"
        )

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
        for endpoint in self.endpoints:
            _pool(endpoint).close()

    def one_replica_of_many(self) -> str | None:
        return None  # each endpoint is one upstream, and a change goes to every one

    def not_ready(self) -> str | None:
        if any(e.healthy for e in self.endpoints):
            return None
        detail = "; ".join(
            f"{e.label}: {e.last_error or 'not checked yet'}" for e in self.endpoints
        )
        return f"tool {self.tool.name!r}: no upstream reachable ({detail})"

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tool.health_interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(e) for e in self.endpoints))

    async def _check(self, endpoint: Endpoint) -> None:
        try:
            async with asyncio.timeout(min(2.0, self.tool.health_interval_s)):
                resp = await _pool(endpoint).request("GET", self.tool.health, {}, b"")
            ok = resp.status < 500
            error = None if ok else f"health check answered {resp.status}"
        except (ConnectFailed, ConnectionBroken, TimeoutError, OSError) as exc:
            ok, error = False, _describe(exc)
        self._mark(endpoint, ok, error)
        endpoint.checked = True

    def _mark(self, endpoint: Endpoint, ok: bool, error: str | None) -> None:
        """Set an endpoint's health, logging each change once, whoever saw it first (a call's
        refused connection, or the health check: "healthy again" had no "unhealthy" before it
        when a call saw the upstream go)."""
        if ok and not endpoint.healthy:
            log.info(
                "upstream healthy again", extra={"tool": self.tool.name, "upstream": endpoint.label}
            )
        if not ok and endpoint.healthy:
            log.warning(
                "upstream unhealthy",
                extra={"tool": self.tool.name, "upstream": endpoint.label, "error": error},
            )
        endpoint.healthy, endpoint.last_error = ok, error

    async def send(
        self, endpoint: Endpoint, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> UpstreamReply:
        try:
            resp = await _pool(endpoint).request(method, path, headers, body, self._resend)
        except ConnectFailed as exc:
            self._mark(endpoint, False, str(exc))
            raise UpstreamConnectError(f"{endpoint.label}: {exc}") from exc
        except ResponseTooLarge as exc:
            raise UpstreamTooLarge(
                f"{endpoint.label} answered more than upstream_max_body_bytes ({exc.limit} "
                "bytes): the connection was closed there, the rest not read (raise the setting "
                "if such answers are legitimate)"
            ) from exc
        except (ConnectionBroken, OSError) as exc:
            raise UpstreamBroken(f"{endpoint.label}: {_describe(exc)}") from exc
        return UpstreamReply(resp.status, resp.body, resp.headers, endpoint.label)


def _pool(endpoint: Endpoint) -> Pool:
    if endpoint.pool is None:
        raise RuntimeError(f"{endpoint.label} is not a proxy endpoint")
    return endpoint.pool


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
