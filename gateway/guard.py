"""The front door as one pure ASGI middleware: request id, bearer keys, rate limits, body limit.

Pure ASGI (not BaseHTTPMiddleware) because it sits on every call's hot path. Keys are compared
in constant time and never logged or echoed: logs carry only a short hash that names the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import uuid
from collections.abc import Iterable
from typing import Any

from toolenv_core import headers as h
from toolenv_core.admission import RateLimits, Rejected

from .asgi import ASGIApp, Message

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_REQUEST_ID_KEY = h.REQUEST_ID.lower().encode()


class BodyTooLarge(Exception):
    pass


def key_id(key: str) -> str:
    """A short, stable name for a key that is safe to log."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        api_keys: Iterable[str],
        max_body_bytes: int,
        rate_limits: RateLimits | None = None,
    ) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.max_body_bytes = max_body_bytes
        self.rate_limits = rate_limits

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = None
        auth = None
        length = None
        for name, value in scope["headers"]:
            if name == _REQUEST_ID_KEY:
                candidate = value.decode("latin-1")
                request_id = candidate if _REQUEST_ID.match(candidate) else None
            elif name == b"authorization":
                auth = value
            elif name == b"content-length":
                length = value
        request_id = request_id or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        rid_header = (_REQUEST_ID_KEY, request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), rid_header]
            await send(message)

        path = scope["path"]
        who = f"client-{scope['client'][0]}" if scope.get("client") else "client-unknown"
        if self.keys and path not in OPEN_PATHS:
            key = _bearer(auth)
            if key is None or not any(hmac.compare_digest(key, k) for k in self.keys):
                await _reply(
                    send_with_id, 401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                    request_id, [(b"www-authenticate", b"Bearer")],
                )  # fmt: skip
                return
            who = key_id(key.decode("latin-1"))
        state["caller"] = who
        if self.rate_limits is not None and path not in OPEN_PATHS:
            try:
                self.rate_limits.check(who)
            except Rejected as exc:
                await _reply(
                    send_with_id, 429, str(exc), request_id,
                    [(b"retry-after", exc.retry_after_header.encode())],
                )  # fmt: skip
                return
        if length is not None:
            try:
                too_large = int(length) > self.max_body_bytes
            except ValueError:
                await _reply(send_with_id, 400, "Content-Length is not a number", request_id)
                return
            if too_large:
                await _reply(send_with_id, 413, self._too_large_message(), request_id)
                return
            await self.app(scope, receive, send_with_id)
            return
        # No Content-Length (chunked): count as it arrives.
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send_with_id(message)

        try:
            await self.app(scope, counted_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _reply(send_with_id, 413, self._too_large_message(), request_id)

    def _too_large_message(self) -> str:
        return f"request body exceeds the limit of {self.max_body_bytes} bytes"


def _bearer(auth: bytes | None) -> bytes | None:
    if not auth or not auth[:7].lower() == b"bearer ":
        return None
    return auth[7:].strip()


async def _reply(
    send,
    status: int,
    message: str,
    request_id: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = json.dumps({"detail": message, "request_id": request_id}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
