"""The front door: request id, bearer keys, rate limits, body limit.

`Door` is the policy, checked once per request from its headers alone; `Guard` applies it as a
pure ASGI middleware (not BaseHTTPMiddleware: it sits on every call's path), and the hot-route
lane (`gateway.lane`) applies the same `Door` before it serves a call, so a key, a rate limit and
a body limit mean the same on both paths. Keys are compared in constant time and never logged or
echoed: logs carry only a short hash that names the key.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from toolenv_core import headers as h
from toolenv_core.admission import RateLimits, Rejected
from toolenv_core.bodylimit import (
    BAD_LENGTH,
    body_timeout_message,
    run_bounded,
    too_large_message,
)

from .asgi import ASGIApp, Message
from .metrics import REFUSALS

OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # no API key needed
# Not rate limited (the limit is a caller's budget of calls): the probes, the Prometheus scrape
# and the control routes (`gateway.control`), which a caller's health probe, a scraper or an
# operator on the same key or address must still reach when its calls have used the budget up.
UNMETERED_PATHS = OPEN_PATHS | {
    "/metrics",
    "/v1/tools",
    "/v1/ping",
    "/v1/sandbox/status",
    "/v1/languages",
    "/v1/emulators/search/profile",
    "/v1/emulators/reward/profile",
}
_NO_KEY = "missing or invalid API key: send `Authorization: Bearer <key>`"
_AUTH_TWICE = (
    "Authorization was sent twice with different values: send `Authorization: Bearer <key>` once"
)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
REQUEST_ID_KEY = h.REQUEST_ID.lower().encode()


def key_id(key: str) -> str:
    """A short, stable name for a key that is safe to log."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


@dataclass(slots=True)
class Verdict:
    """What the door decided for one request: who it is, and the refusal if it is refused."""

    request_id: str
    caller: str
    status: int = 0  # 0: let in; else the HTTP status of the refusal
    detail: str = ""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    length: int | None = None  # the declared Content-Length (None: none, e.g. chunked)

    def refusal_body(self) -> bytes:
        return json.dumps({"detail": self.detail, "request_id": self.request_id}).encode()


class Door:
    """The front-door policy of one gateway app (its rate-limit buckets live here, shared by
    every path a request can take)."""

    def __init__(
        self,
        api_keys: Iterable[str],
        max_body_bytes: int,
        rate_limits: RateLimits | None = None,
        body_timeout_s: float = 10.0,
    ) -> None:
        self.keys = [k.encode() for k in api_keys]
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s  # the whole body must arrive within this (else 408)
        self.rate_limits = rate_limits
        # what the door refused before any tool, by reason (`/metrics`: refused_total)
        self.refused = {reason: 0 for reason in REFUSALS}
        # Request ids: a random per-process prefix and a counter (unique, and no system call per
        # request as uuid4 makes); a caller's own well-formed X-Request-Id wins.
        self._id_prefix = os.urandom(8).hex()
        self._ids = itertools.count(1)

    def check(
        self,
        headers: Iterable[tuple[bytes, bytes]],
        path: str,
        client: tuple[str, int] | None,
        takes_body: bool = False,
    ) -> Verdict:
        """The verdict on one request from its headers. `takes_body`: the route reads a body
        (the lane's hot routes), so a declared length over the limit is its 413 now; elsewhere
        it is refused when the app first reads the body (`run_bounded`), and a route that reads
        none answers as it would without the limit (a 404, a 405, a GET)."""
        request_id = None
        auth = None
        auth_twice = False  # two different credentials: which one counts would be a guess
        length = None
        for name, value in headers:
            if name == REQUEST_ID_KEY:
                candidate = value.decode("latin-1")
                request_id = candidate if _REQUEST_ID.match(candidate) else None
            elif name == b"authorization":
                auth_twice = auth_twice or (auth is not None and auth != value)
                auth = value
            elif name == b"content-length":
                length = value
        if request_id is None:
            request_id = f"{self._id_prefix}{next(self._ids):016x}"
        who = f"client-{client[0]}" if client else "client-unknown"
        verdict = Verdict(request_id, who)
        if self.keys and path not in OPEN_PATHS:
            # Two different Authorization headers (a proxy's and the caller's, say) are refused:
            # the last one counted here, where a proxy in front may have checked the first.
            key = None if auth_twice else _bearer(auth)
            if key is None or not any(hmac.compare_digest(key, k) for k in self.keys):
                self.refused["unauthorized"] += 1
                detail = _AUTH_TWICE if auth_twice else _NO_KEY
                return _refuse(verdict, 401, detail, ((b"www-authenticate", b"Bearer"),))
            verdict.caller = key_id(key.decode("latin-1"))
        if self.rate_limits is not None and path not in UNMETERED_PATHS:
            try:
                self.rate_limits.check(verdict.caller)
            except Rejected as exc:
                self.refused["rate_limited"] += 1
                return _refuse(
                    verdict, 429, str(exc), ((b"retry-after", exc.retry_after_header.encode()),)
                )
        if length is not None:
            try:
                verdict.length = int(length)
            except ValueError:
                self.refused["invalid_request"] += 1
                return _refuse(verdict, 400, BAD_LENGTH)
            if takes_body and verdict.length > self.max_body_bytes:
                self.refused["too_large"] += 1
                return _refuse(verdict, 413, self.too_large_message())
        return verdict

    def body_refused(self, status: int) -> None:
        """Counts a body the bounds refused once it came (or did not come in time): a 413 or 408."""
        self.refused["too_large" if status == 413 else "body_timeout"] += 1

    def too_large_message(self) -> str:
        return too_large_message(self.max_body_bytes)  # the same words as every front door

    def body_timeout_message(self, seen: int, headers: Iterable[tuple[bytes, bytes]]) -> str:
        return body_timeout_message(self.body_timeout_s, seen, headers)


def _refuse(
    verdict: Verdict, status: int, detail: str, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> Verdict:
    verdict.status, verdict.detail, verdict.headers = status, detail, headers
    return verdict


class Guard:
    """The door as ASGI middleware: refusals answered here, the request id and caller put in
    the scope's state, and a body without Content-Length counted as it arrives."""

    def __init__(self, app: ASGIApp, door: Door) -> None:
        self.app = app
        self.door = door

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        verdict = self.door.check(scope["headers"], scope["path"], scope.get("client"))
        state = scope.setdefault("state", {})
        state["request_id"] = verdict.request_id
        rid_header = (REQUEST_ID_KEY, verdict.request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), rid_header]
            await send(message)

        if verdict.status:
            await _reply(send_with_id, verdict)
            return
        state["caller"] = verdict.caller
        # The body must arrive whole within the door's body timeout (a body shorter than its
        # Content-Length must not hold a connection open); a declared one over the limit is
        # refused when the app reads it, one without Content-Length (chunked) counted as it comes.
        door = self.door
        refusal = await run_bounded(
            self.app,
            scope,
            receive,
            send_with_id,
            door.max_body_bytes,
            door.body_timeout_s,
            verdict.length,
        )
        if refusal is not None:
            door.body_refused(refusal.status)
            await _reply(send_with_id, _refuse(verdict, *refusal))


def _bearer(auth: bytes | None) -> bytes | None:
    if not auth or not auth[:7].lower() == b"bearer ":
        return None
    return auth[7:].strip()


async def _reply(send, verdict: Verdict) -> None:
    body = verdict.refusal_body()
    await send(
        {
            "type": "http.response.start",
            "status": verdict.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *verdict.headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
