"""A call cut by a server's graceful-shutdown timeout answers 503 with what happened.

Why: past `timeout_graceful_shutdown`, uvicorn cancels the handlers still running and answers
its own plain-text `500 Internal Server Error`: the caller (and a gateway, which passes a tool's
500 on) cannot tell a service that stopped from one that failed.
"""

from __future__ import annotations

import asyncio
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def cut_detail(service: str, grace: str) -> str:
    """What a call cut at `service`'s shutdown is told, every service alike (`grace`: how long
    calls in flight get, as the service sets it)."""
    return (
        f"{service} stopped before this call finished: calls in flight get {grace} after "
        "SIGTERM/SIGINT (none after a second Ctrl-C), then are cut; send it again when the "
        "service is back (or to another one)"
    )


class AnswerCutCalls:
    """A served app's outermost layer: a call uvicorn cancels at its shutdown timeout, before
    its answer started, is answered 503 with `detail` (and the connection closed). Answered, the
    cancellation ends here: raised on, uvicorn logged it as `Exception in ASGI application` with
    a 60-line traceback per call, for a stop it had announced itself (`Cancel N running
    task(s), timeout graceful shutdown exceeded`); the app below has unwound already. So does
    one the app below answered whole itself (the gateway's pass-through routes answer their own
    503), which was still raised on: that traceback for each of them."""

    def __init__(self, app: ASGIApp, detail: str) -> None:
        self.app = app
        self.body = json.dumps({"detail": detail}).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = answered = False

        async def tracked(message: Message) -> None:
            nonlocal started, answered
            kind = message["type"]
            started = started or kind == "http.response.start"
            answered = answered or (kind == "http.response.body" and not message.get("more_body"))
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if scope["type"] != "http" or (started and not answered):
                raise
            if answered:
                return
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": self.body})
