"""The gateway's HTTP routes: pass-through, the generic call, the tools list and operations."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from toolenv_core.deadline import DEADLINE_HEADER, DeadlineHeaderError

from .calls import CallContext, failure_answer, run_call
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

log = logging.getLogger("toolenv.gateway")
router = APIRouter()

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


_HEADER_PARAMETERS = [
    {
        "name": DEADLINE_HEADER,
        "in": "header",
        "required": False,
        "description": "this call's remaining budget in milliseconds (capped by the tool's maximum)",
        "schema": {"type": "number", "minimum": 0},
    },
    {
        "name": "X-Trajectory-Id",
        "in": "header",
        "required": False,
        "description": "trace capture: the rollout this call belongs to",
        "schema": {"type": "string", "maxLength": 256},
    },
    {
        "name": "X-Step",
        "in": "header",
        "required": False,
        "description": "trace capture: training step",
        "schema": {"type": "integer", "minimum": 0},
    },
    {
        "name": "X-Turn",
        "in": "header",
        "required": False,
        "description": "trace capture: turn within the trajectory",
        "schema": {"type": "integer", "minimum": 0},
    },
]


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "parameters": _HEADER_PARAMETERS,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        },
    }


# ---------------------------------------------------------------- helpers


def _toolset(request: Request) -> ToolSet:
    toolset = request.app.state.toolset
    if toolset is None:
        raise HTTPException(503, "the gateway is starting")
    return toolset


def _request_id(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id", "")


def _context(request: Request) -> CallContext:
    return CallContext.from_scope(request.scope, request.app.state.trace)


def _failure(request: Request, runtime: ToolRuntime, outcome: Outcome) -> JSONResponse:
    status, body, headers = failure_answer(runtime, outcome, _request_id(request))
    return JSONResponse(body, status, headers=headers)


async def _pass_through(request: Request, kind: str, path: str) -> Response:
    """Reached only when the fast path (gateway.passthrough) declined: say why, clearly."""
    toolset = _toolset(request)
    if toolset.first_of_kind(kind) is None:
        raise HTTPException(404, f"no {kind} tool is configured in the gateway's tools table")
    raise HTTPException(503, "the gateway is starting")


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
    openapi_extra={"parameters": _HEADER_PARAMETERS},
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
    ctx = _context(request)
    try:
        requested = body.deadline_ms if body.deadline_ms is not None else ctx.header_deadline_ms()
    except DeadlineHeaderError as exc:
        raise HTTPException(400, str(exc)) from None
    payload = json.dumps(body.arguments).encode()
    outcome = await run_call(ctx, runtime, runtime.config.native_path, payload, requested)
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
