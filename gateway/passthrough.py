"""The hot routes as a raw ASGI fast path: the compatible ones (`/run_code`, `/v1/run_tests`,
`/retrieve`) and the generic `POST /v1/tools/{tool}/call`.

These carry the bulk of RL traffic, so they skip the framework's routing, dependency solving,
body models and response classes (over half the gateway's own CPU per call). The FastAPI
declarations of the same routes stay for the OpenAPI docs, and answer only when this path
declines (the gateway still starting, or no such tool), with the error saying why.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from toolenv_core import headers as h
from toolenv_core.disconnect import ClientGone, unless_disconnected
from toolenv_core.errors import NOT_JSON, NOT_JSON_STATUS
from toolenv_core.shutdown import cut_detail

from . import wirejson
from .asgi import ASGIApp
from .calls import CallContext, failure_answer, run_call
from .dispatch import Outcome, ToolRuntime
from .sandboxfusion import (
    CALLERS,
    DEFAULT,
    OWN,
    SANDBOX_ROUTES,
    request_budget_ms,
    reserve_s,
    timeout_answer,
)
from .state import GatewayState
from .upstream import EXECUTOR_HEADERS, FAULT_HEADER

ROUTES: dict[str, tuple[str, str]] = {
    "/run_code": ("sandbox", "/run_code"),
    "/v1/run_tests": ("sandbox", "/v1/run_tests"),
    "/retrieve": ("search", "/retrieve"),
}
_GENERIC_PREFIX, _GENERIC_SUFFIX = "/v1/tools/", "/call"
_DELAY = h.INJECTED_DELAY.lower()
_DELAY_KEY = _DELAY.encode()


@dataclass(slots=True)
class HotCall:
    """A request on a hot route, resolved: the tool, and its own path (None: the generic call)."""

    runtime: ToolRuntime
    native_path: str | None


def hot_call(state: GatewayState, path: str) -> HotCall | None:
    """The tool a `POST` to `path` calls, if `path` is a hot route and the tool exists (else the
    framework's routes answer, with an error that says why)."""
    toolset = state.toolset
    if toolset is None:
        return None
    known = toolset.hot_calls.get(path)
    if known is not None:
        return known  # type: ignore[return-value]
    call = None
    route = ROUTES.get(path)
    if route is not None:
        runtime = toolset.first_of_kind(route[0])
        call = HotCall(runtime, route[1]) if runtime is not None else None
    elif path.startswith(_GENERIC_PREFIX) and path.endswith(_GENERIC_SUFFIX):
        runtime = toolset.tools.get(path[len(_GENERIC_PREFIX) : -len(_GENERIC_SUFFIX)])
        call = HotCall(runtime, None) if runtime is not None else None
    if call is not None:
        toolset.hot_calls[path] = call  # bounded: the hot routes and one path per tool
    return call


# One hot call's answer: status, headers (lower-case names, the content type among them, never
# the content length: whoever writes the answer adds it) and body.
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]


def serve(ctx: CallContext, call: HotCall, body: bytes) -> Coroutine[Any, Any, Answer]:
    """Answer one hot call: what the middleware below (as two ASGI messages) and the
    connection-level lane (`gateway.lane`, in one socket write) both await and write out (the
    route's own coroutine, not one awaiting it: a frame fewer on every step of the call)."""
    if call.native_path is None:
        return generic_call(ctx, call.runtime, body)
    return pass_through(ctx, call.runtime, call.native_path, body)


class PassThrough:
    """Serves the hot routes itself; everything else (and what it declines) goes to `app`."""

    def __init__(self, app: ASGIApp, state: GatewayState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        call = None
        if scope["type"] == "http" and scope["method"] == "POST":
            call = hot_call(self.state, scope["path"])
        if call is None:
            await self.app(scope, receive, send)
            return
        ctx = CallContext.from_scope(scope, self.state.trace, self.state.door.refused)
        body = await _read(receive)
        if body is None:
            return  # the caller hung up
        try:  # the lane does the same from its connection
            status, headers, payload = await unless_disconnected(
                serve(ctx, call, body), receive, watch_after_s=0.0
            )
        except ClientGone:
            return  # the caller hung up: the call was cancelled, and with it the tool's work
        except asyncio.CancelledError:  # not the caller's doing: the server's shutdown cut it
            status, headers, payload = cut_answer(self.state, ctx.request_id)
            headers += [(b"connection", b"close"), (b"content-length", str(len(payload)).encode())]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": payload})
            raise
        headers.append((b"content-length", str(len(payload)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


async def pass_through(ctx: CallContext, runtime: ToolRuntime, path: str, body: bytes) -> Answer:
    """The body as is to the tool's own endpoint; its answer as is back (status, body, delay,
    Retry-After), a timeout the tool answered itself included (sandboxd's TimeLimitExceeded
    marked as the deadline's: the outcome is `timeout`, the body the tool's).

    The sandbox routes keep SandboxFusion's deadline semantics (`gateway.sandboxfusion`)."""
    parsed = _parse(body)
    if parsed is _INVALID:
        return _bad_json(ctx)
    sandbox = runtime.config.kind == "sandbox" and path in SANDBOX_ROUTES
    own_budget = None
    if sandbox and not ctx.sent_deadline:
        own_budget = request_budget_ms(path, parsed, runtime.config)
    try:
        ctx.check_headers()
        deadline, deadline_ms = ctx.deadline(runtime, own_budget)
    except h.HeaderError as exc:
        return _refused(ctx, 400, str(exc))
    reserve = reserve_s(deadline_ms) if sandbox else 0.0
    outcome = await run_call(ctx, runtime, path, body, deadline, deadline_ms, reserve)
    reply = outcome.reply
    if reply is None:
        if sandbox and outcome.kind == "timeout":
            whose = CALLERS if ctx.sent_deadline else OWN if own_budget is not None else DEFAULT
            return _json(200, timeout_answer(path, parsed, outcome, whose))
        return _failure(runtime, outcome, ctx)
    out = [(b"content-type", reply.headers.get("content-type", "application/json").encode())]
    if _DELAY in reply.headers:
        out.append((_DELAY_KEY, reply.headers[_DELAY].encode()))
    out += _tool_headers(reply.headers)
    return reply.status, out, reply.body


async def generic_call(ctx: CallContext, runtime: ToolRuntime, raw: bytes) -> Answer:
    """`POST /v1/tools/{tool}/call`: `{"arguments": {...}, "deadline_ms"?}` -> the tool's native
    endpoint (the one implementation; the FastAPI route of the same path only documents it)."""
    body = _parse(raw)
    if body is _INVALID:
        return _bad_json(ctx)
    problem = _check_call_body(body)
    if problem is not None:
        return _refused(ctx, 422, f"invalid request: {problem}")
    try:
        ctx.check_headers()
        deadline, deadline_ms = ctx.deadline(runtime, body.get("deadline_ms"))
    except h.HeaderError as exc:
        return _refused(ctx, 400, str(exc))
    payload = wirejson.dumps(body["arguments"])
    if not _forwardable(payload, raw):
        return _refused(ctx, 422, f"invalid request: {_NOT_FINITE}")
    # JSON whatever the caller's envelope said (`curl -d` says a form: a FastAPI tool refused it)
    outcome = await run_call(
        ctx, runtime, runtime.config.native_path, payload, deadline, deadline_ms,
        content_type="application/json",
    )  # fmt: skip
    reply = outcome.reply
    if reply is None or outcome.kind == "timeout":  # a timeout is the 504 however it came
        return _failure(runtime, outcome, ctx)
    # not strict JSON (plain text, or `json.dumps`'s NaN): the body as text, so the answer is JSON
    if not wirejson.is_json(reply.body, strict=True):
        text = reply.body.decode("utf-8", errors="replace") if reply.body else None
        answer = {
            "tool": runtime.name, "status": outcome.kind, "result": text, "error": outcome.error,
            "elapsed_s": round(outcome.elapsed_s, 6), "request_id": ctx.request_id,
        }  # fmt: skip
        status, headers, payload = _json(200, answer)
        return (
            status,
            [*headers, _tool_status(outcome.kind), *_tool_headers(reply.headers)],
            payload,
        )
    # The tool's JSON goes in as it came (checked, not parsed and written again: the larger
    # half of the JSON work of a call), between bytes written once per tool and outcome, and a
    # tail written by hand (a dict, `round` and a serializer cost five times as much).
    error = b"null" if outcome.error is None else wirejson.dumps(outcome.error)
    request_id = _json_string(ctx.request_id)
    tail = b', "error": %s, "elapsed_s": %.6f, "request_id": %s}' % (
        error,
        outcome.elapsed_s,
        request_id,
    )
    headers = [_JSON, _tool_status(outcome.kind), *_tool_headers(reply.headers)]
    return 200, headers, b"".join((_answer_head(runtime.name, outcome.kind), reply.body, tail))


_JSON = (b"content-type", b"application/json")
# A tool's headers every route passes on to its caller: Retry-After (the tool's own 429, its
# backpressure signal), the emulators' X-Toolenv-Fault (which injected fault shaped the answer: a
# caller through the gateway could not tell) and the executor headers (where the call ran).
_TOOL_KEYS = tuple(
    (name, name.encode()) for name in ("retry-after", FAULT_HEADER, *EXECUTOR_HEADERS)
)


def _tool_status(kind: str) -> tuple[bytes, bytes]:
    """The answer's `status` as a header too: a load generator reads it, not the body (a tool's
    error answer, a 200, was counted a success by `toolenv stress`)."""
    return _TOOL_STATUS, kind.encode()


_TOOL_STATUS = h.TOOL_STATUS.lower().encode()


def _tool_headers(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """The headers of a reply passed on to the caller (`_TOOL_KEYS`)."""
    return [(key, headers[name].encode()) for name, key in _TOOL_KEYS if name in headers]


def _json_string(text: str) -> bytes:
    """`text` as a JSON string; request ids (`[A-Za-z0-9._:-]`, or the gateway's own) need no
    escaping, so they skip the serializer."""
    if text.isprintable() and '"' not in text and "\\" not in text:
        return b'"%s"' % text.encode()
    return wirejson.dumps(text)


@functools.lru_cache(maxsize=1024)
def _answer_head(tool: str, kind: str) -> bytes:
    """`{"tool": ..., "status": ..., "result": ` of a generic call's answer."""
    return json.dumps({"tool": tool, "status": kind})[:-1].encode() + b', "result": '


_INVALID = object()


def _parse(raw: bytes) -> Any:
    """The JSON body (None when empty), or `_INVALID`."""
    try:
        return wirejson.loads(raw) if raw else None
    except ValueError:
        return _INVALID


def _bad_json(ctx: CallContext) -> Answer:
    """The one answer to malformed JSON on every route (the FastAPI routes answer the same)."""
    return _refused(ctx, NOT_JSON_STATUS, NOT_JSON)


def _refused(ctx: CallContext, status: int, detail: str) -> Answer:
    """A request refused before the tool (a 400 or 422), counted as `invalid_request`."""
    ctx.refuse("invalid_request")
    return _json(status, {"detail": detail, "request_id": ctx.request_id})


def shutdown_cut_detail(grace_s: float) -> str:
    """What a call cut by the gateway's shutdown is told (here, on the lane, and on every other
    route through `toolenv_core.shutdown.AnswerCutCalls`)."""
    return cut_detail("the gateway", f"shutdown_grace_s ({grace_s:g} s)")


def cut_answer(state: GatewayState, request_id: str) -> Answer:
    """The answer to a call still running when the server's shutdown grace ran out and cut it
    (uvicorn cancels it): a 503 saying so, where the caller got a dropped connection."""
    detail = shutdown_cut_detail(state.settings.shutdown_grace_s)
    return _json(503, {"detail": detail, "request_id": request_id})


def _failure(runtime: ToolRuntime, outcome: Outcome, ctx: CallContext) -> Answer:
    status, answer, headers = failure_answer(runtime, outcome, ctx.request_id)
    return _json(status, answer, headers)


def _check_call_body(body: Any) -> str | None:
    """The `ToolCallRequest` rules, checked by hand (same messages as the documented model)."""
    if type(body) is dict and len(body) == 1 and type(body.get("arguments")) is dict:
        return None  # the common body, `{"arguments": {...}}`, in three lookups
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
    if deadline is not None and not _finite_non_negative(deadline):
        return "deadline_ms: must be a non-negative number of milliseconds"
    return None


_NOT_FINITE = (
    "arguments: holds a number beyond a 64-bit float (such as 1e400), which would reach the tool "
    "as `Infinity`, not JSON: send it as a string"
)


def _forwardable(payload: bytes, raw: bytes) -> bool:
    """Whether the arguments as written are JSON when the caller's body was: a number past the
    float range (`1e400`, valid JSON) is read as infinity and written `Infinity`, which a tool's
    JSON parser refuses or reads as a value the caller did not send. (A caller's own `NaN` or
    `Infinity`, which `json` reads, goes on as it came.) Checked only when the text is there."""
    if b"Infinity" not in payload and b"NaN" not in payload:
        return True
    return wirejson.is_json(payload, strict=True) or not wirejson.is_json(raw, strict=True)


def _finite_non_negative(value: Any) -> bool:
    """A JSON number >= 0 that is finite as a float (not `true`, NaN, `1e400`, nor an integer
    past the float range such as 10**400, which no deadline arithmetic can take)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return 0 <= float(value) < math.inf
    except OverflowError:
        return False


async def _read(receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Answer:
    return _raw_json(status, json.dumps(body).encode(), headers)


def _raw_json(status: int, payload: bytes, headers: dict[str, str] | None = None) -> Answer:
    raw = [_JSON]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return status, raw, payload
