"""The gateway's HTTP routes: pass-through, the generic call, the tools list and operations."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from emulators.polytrace.records import ToolCallRecord
from toolenv.deadline import DEADLINE_HEADER, DeadlineHeaderError, parse_deadline_ms

from .dispatch import Outcome, ToolRuntime
from .schemas import (
    RetrieveBody,
    RunCodeBody,
    RunTestsBody,
    ToolCallRequest,
    ToolCallResponse,
    ToolFailureResponse,
    openai_function,
)
from .toolset import ToolSet
from .trace import STEP_HEADER, TRAJECTORY_HEADER, TURN_HEADER, parse_int_header
from .upstream import INJECTED_DELAY_HEADER

log = logging.getLogger("toolenv.gateway")
router = APIRouter()

FAILURE_STATUS = {"timeout": 504, "rejected": 429, "unavailable": 503, "upstream_failed": 502}
_FAILURES = {
    429: {"model": ToolFailureResponse, "description": "saturated (Retry-After) or rate limited"},
    502: {"model": ToolFailureResponse, "description": "the upstream failed mid-request"},
    503: {"model": ToolFailureResponse, "description": "no upstream reachable (names the tool)"},
    504: {
        "model": ToolFailureResponse,
        "description": "the deadline expired; the work was cancelled",
    },
}
_DEADLINE_DOC = (
    f"Deadline: `{DEADLINE_HEADER}` header (remaining ms), capped by the tool's maximum."
)


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


# ---------------------------------------------------------------- helpers


def _toolset(request: Request) -> ToolSet:
    toolset = request.app.state.toolset
    if toolset is None:
        raise HTTPException(503, "the gateway is starting")
    return toolset


def _request_id(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id", "")


def _header_deadline_ms(request: Request) -> float | None:
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    try:
        return parse_deadline_ms(raw) * 1000.0
    except DeadlineHeaderError as exc:
        raise HTTPException(400, str(exc)) from None


async def _run(
    request: Request, runtime: ToolRuntime, path: str, body: bytes, requested_ms: float | None
) -> Outcome:
    deadline, deadline_ms = runtime.deadline_for(requested_ms)
    headers = {
        "content-type": request.headers.get("content-type", "application/json"),
        "x-request-id": _request_id(request),
    }
    outcome = await runtime.call("POST", path, body, headers, deadline, deadline_ms)
    _after(request, runtime, outcome)
    return outcome


def _after(request: Request, runtime: ToolRuntime, outcome: Outcome) -> None:
    """Trace capture and the call's log line."""
    trace = request.app.state.trace
    trajectory = request.headers.get(TRAJECTORY_HEADER)
    if trace is not None and trajectory:
        trace.record(
            ToolCallRecord(
                tool_name=runtime.name,
                turn=parse_int_header(request.headers.get(TURN_HEADER)) or 0,
                latency_s=outcome.elapsed_s,
                status="success" if outcome.kind == "ok" else outcome.kind,
                response_bytes=len(outcome.reply.body) if outcome.reply is not None else 0,
                trajectory_id=trajectory[:256],
                step=parse_int_header(request.headers.get(STEP_HEADER)),
            )
        )
    # Successes and 429s are the bulk under load: logging each would cost more than the call.
    level = logging.DEBUG if outcome.kind in ("ok", "rejected") else logging.INFO
    if log.isEnabledFor(level):
        log.log(
            level,
            "tool call",
            extra={
                "request_id": _request_id(request),
                "tool": runtime.name,
                "outcome": outcome.kind,
                "status": outcome.reply.status if outcome.reply is not None else None,
                "elapsed_ms": round(outcome.elapsed_s * 1000, 3),
                "queue_wait_ms": round(outcome.queue_wait_s * 1000, 3),
                "upstream": outcome.reply.endpoint if outcome.reply is not None else None,
                "error": outcome.error,
                "caller": request.scope.get("state", {}).get("caller"),
            },
        )


def _failure(request: Request, runtime: ToolRuntime, outcome: Outcome) -> JSONResponse:
    body: dict[str, Any] = {
        "tool": runtime.name,
        "status": outcome.kind,
        "error": outcome.error,
        "elapsed_s": round(outcome.elapsed_s, 6),
        "request_id": _request_id(request),
    }
    if outcome.kind == "timeout":
        body["deadline_ms"] = outcome.deadline_ms
    headers = {"Retry-After": outcome.retry_after} if outcome.retry_after else None
    return JSONResponse(body, FAILURE_STATUS[outcome.kind], headers=headers)


async def _pass_through(request: Request, kind: str, path: str) -> Response:
    toolset = _toolset(request)
    runtime = toolset.first_of_kind(kind)
    if runtime is None:
        raise HTTPException(404, f"no {kind} tool is configured in the gateway's tools table")
    requested = _header_deadline_ms(request)
    outcome = await _run(request, runtime, path, await request.body(), requested)
    if outcome.reply is None:
        return _failure(request, runtime, outcome)
    reply = outcome.reply
    headers = {}
    if INJECTED_DELAY_HEADER in reply.headers:
        headers[INJECTED_DELAY_HEADER] = reply.headers[INJECTED_DELAY_HEADER]
    return Response(
        reply.body,
        reply.status,
        headers=headers,
        media_type=reply.headers.get("content-type", "application/json"),
    )


# ---------------------------------------------------------------- pass-through


@router.post(
    "/run_code",
    tags=["pass-through"],
    summary="SandboxFusion run_code",
    description="Forwarded as is to the sandbox tool. " + _DEADLINE_DOC,
    openapi_extra=_body_doc(RunCodeBody),
    responses=_FAILURES,
)
async def run_code(request: Request) -> Response:
    return await _pass_through(request, "sandbox", "/run_code")


@router.post(
    "/v1/run_tests",
    tags=["pass-through"],
    summary="sandboxd run_tests",
    description="Forwarded as is to the sandbox tool. " + _DEADLINE_DOC,
    openapi_extra=_body_doc(RunTestsBody),
    responses=_FAILURES,
)
async def run_tests(request: Request) -> Response:
    return await _pass_through(request, "sandbox", "/v1/run_tests")


@router.post(
    "/retrieve",
    tags=["pass-through"],
    summary="Search-R1 retrieve",
    description="Forwarded as is to the search tool. " + _DEADLINE_DOC,
    openapi_extra=_body_doc(RetrieveBody),
    responses=_FAILURES,
)
async def retrieve(request: Request) -> Response:
    return await _pass_through(request, "search", "/retrieve")


# ---------------------------------------------------------------- generic


@router.post(
    "/v1/tools/{tool}/call",
    tags=["tools"],
    response_model=ToolCallResponse,
    responses={404: {"description": "unknown tool"}, **_FAILURES},
    summary="Call any tool",
)
async def call_tool(tool: str, body: ToolCallRequest, request: Request) -> Response:
    """Forward `arguments` to the tool's native endpoint, under one deadline.

    200 `{"tool", "status": "ok"|"error", "result", "error", "elapsed_s", "request_id"}`;
    504 `{"tool", "status": "timeout", "error", "elapsed_s", "deadline_ms", "request_id"}`.
    """
    toolset = _toolset(request)
    runtime = toolset.tools.get(tool)
    if runtime is None:
        known = ", ".join(sorted(toolset.tools)) or "none"
        raise HTTPException(404, f"unknown tool {tool!r}; known tools: {known}")
    requested = body.deadline_ms if body.deadline_ms is not None else _header_deadline_ms(request)
    payload = json.dumps(body.arguments).encode()
    outcome = await _run(request, runtime, runtime.config.native_path, payload, requested)
    if outcome.reply is None:
        return _failure(request, runtime, outcome)
    try:
        result = json.loads(outcome.reply.body) if outcome.reply.body else None
    except ValueError:
        result = outcome.reply.body.decode("utf-8", errors="replace")
    return JSONResponse(
        {
            "tool": runtime.name,
            "status": outcome.kind,
            "result": result,
            "error": outcome.error,
            "elapsed_s": round(outcome.elapsed_s, 6),
            "request_id": _request_id(request),
        }
    )


@router.get("/v1/tools", tags=["tools"], summary="Tools, in OpenAI function format")
async def list_tools(request: Request) -> dict[str, Any]:
    """`tools` is ready to hand to a model as its `tools=[...]`; `details` is for operators."""
    toolset = _toolset(request)
    return {
        "tools": [openai_function(rt.config) for rt in toolset.tools.values()],
        "details": [
            {
                "name": rt.name,
                "kind": rt.config.kind,
                "mode": rt.config.mode,
                "endpoints": [
                    {"endpoint": e.label, "healthy": e.healthy, "outstanding": e.outstanding}
                    for e in rt.backend.endpoints
                ],
                "in_flight": rt.admission.in_flight,
                "queued": rt.admission.waiting,
                "concurrency": rt.config.concurrency,
                "queue": rt.config.queue,
                "idempotent": rt.config.is_idempotent,
                "hedge": rt.hedging,
                "retry": rt.config.retry.enabled,
            }
            for rt in toolset.tools.values()
        ],
        "skipped": toolset.skipped,
    }


# ---------------------------------------------------------------- operations


@router.get("/healthz", tags=["ops"])
async def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/readyz", tags=["ops"], responses={503: {"description": "names what is not ready"}})
async def readyz(request: Request) -> JSONResponse:
    """Readiness: start-up finished and every tool can take calls (upstreams reachable)."""
    toolset = request.app.state.toolset
    if not request.app.state.ready or toolset is None:
        return JSONResponse({"status": "starting", "detail": "the gateway is starting"}, 503)
    problems = toolset.not_ready()
    if problems:
        return JSONResponse({"status": "not ready", "detail": "; ".join(problems)}, 503)
    return JSONResponse({"status": "ready", "tools": sorted(toolset.tools)})


@router.get("/metrics", tags=["ops"], response_class=Response)
async def metrics(request: Request) -> Response:
    """Prometheus metrics (text exposition format)."""
    return Response(
        generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST
    )
