"""The hot routes as a raw ASGI fast path: the compatible ones (`/run_code`, `/v1/run_tests`,
`/retrieve`) and the generic `POST /v1/tools/{tool}/call`.

These carry the bulk of RL traffic, so they skip the framework's routing, dependency solving,
body models and response classes (over half the gateway's own CPU per call). The FastAPI
declarations of the same routes stay for the OpenAPI docs, and answer only when this path
declines (the gateway still starting, or no such tool), with the error saying why.
"""

from __future__ import annotations

import json
from typing import Any

from toolenv_core.deadline import DeadlineHeaderError

from .asgi import ASGIApp
from .calls import CallContext, failure_answer, run_call
from .upstream import INJECTED_DELAY_HEADER

ROUTES: dict[str, tuple[str, str]] = {
    "/run_code": ("sandbox", "/run_code"),
    "/v1/run_tests": ("sandbox", "/v1/run_tests"),
    "/retrieve": ("search", "/retrieve"),
}
_DELAY = INJECTED_DELAY_HEADER.encode()


class PassThrough:
    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state  # the FastAPI app's state: toolset and trace writer live there

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        toolset = getattr(self.state, "toolset", None)
        route = ROUTES.get(path)
        runtime = None
        if toolset is not None:
            if route is not None:
                runtime = toolset.first_of_kind(route[0])
            elif path.startswith("/v1/tools/") and path.endswith("/call"):
                runtime = toolset.tools.get(path[len("/v1/tools/") : -len("/call")])
        if runtime is None:
            await self.app(scope, receive, send)
            return
        ctx = CallContext.from_scope(scope, self.state.trace)
        body = await _read(receive)
        if body is None:
            return  # the caller hung up
        if route is None:
            await self._generic(ctx, runtime, body, send)
            return
        try:
            requested = ctx.header_deadline_ms()
        except DeadlineHeaderError as exc:
            await _json(send, 400, {"detail": str(exc), "request_id": ctx.request_id})
            return
        outcome = await run_call(ctx, runtime, route[1], body, requested)
        reply = outcome.reply
        if reply is None:
            status, body, headers = failure_answer(runtime, outcome, ctx.request_id)
            await _json(send, status, body, headers)
            return
        out = [
            (b"content-type", reply.headers.get("content-type", "application/json").encode()),
            (b"content-length", str(len(reply.body)).encode()),
        ]
        if INJECTED_DELAY_HEADER in reply.headers:
            out.append((_DELAY, reply.headers[INJECTED_DELAY_HEADER].encode()))
        await send({"type": "http.response.start", "status": reply.status, "headers": out})
        await send({"type": "http.response.body", "body": reply.body})

    async def _generic(self, ctx: CallContext, runtime, raw: bytes, send) -> None:
        """`{"arguments": {...}, "deadline_ms"?}` -> the tool's native endpoint (see schemas)."""
        try:
            body = json.loads(raw)
        except ValueError:
            await _json(
                send,
                400,
                {"detail": "request body is not valid JSON", "request_id": ctx.request_id},
            )
            return
        problem = _check_call_body(body)
        if problem is None:
            try:
                requested = body.get("deadline_ms")
                if requested is None:
                    requested = ctx.header_deadline_ms()
            except DeadlineHeaderError as exc:
                await _json(send, 400, {"detail": str(exc), "request_id": ctx.request_id})
                return
        if problem is not None:
            await _json(
                send, 422, {"detail": f"invalid request: {problem}", "request_id": ctx.request_id}
            )
            return
        payload = json.dumps(body["arguments"]).encode()
        outcome = await run_call(ctx, runtime, runtime.config.native_path, payload, requested)
        if outcome.reply is None:
            status, answer, headers = failure_answer(runtime, outcome, ctx.request_id)
            await _json(send, status, answer, headers)
            return
        reply = outcome.reply
        try:
            result = json.loads(reply.body) if reply.body else None
        except ValueError:
            result = reply.body.decode("utf-8", errors="replace")
        answer = {
            "tool": runtime.name,
            "status": outcome.kind,
            "result": result,
            "error": outcome.error,
            "elapsed_s": round(outcome.elapsed_s, 6),
            "request_id": ctx.request_id,
        }
        await _json(send, 200, answer)


def _check_call_body(body: Any) -> str | None:
    """The `ToolCallRequest` rules, checked by hand (same messages as the documented model)."""
    if not isinstance(body, dict):
        return "body: must be a JSON object with `arguments`"
    extra = set(body) - {"arguments", "deadline_ms"}
    if extra:
        return f"{', '.join(sorted(extra))}: extra inputs are not permitted (send `arguments` and optional `deadline_ms`)"
    if "arguments" not in body:
        return "arguments: field required (an object: the tool's native request body)"
    if not isinstance(body["arguments"], dict):
        return "arguments: must be a JSON object (the tool's native request body)"
    deadline = body.get("deadline_ms")
    if deadline is not None and (
        isinstance(deadline, bool) or not isinstance(deadline, int | float) or not deadline >= 0
        or deadline == float("inf")
    ):  # fmt: skip
        return "deadline_ms: must be a non-negative number of milliseconds"
    return None


async def _read(receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _json(
    send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
