"""The gateway's HTTP routes: pass-through, the generic call, the tools list and operations."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from toolenv_core import headers as h
from toolenv_core.errors import NOT_JSON, NOT_JSON_STATUS

from . import wirejson
from .schemas import (
    RetrieveBody,
    RunCodeBody,
    RunTestsBody,
    ToolCallRequest,
    ToolCallResponse,
    ToolFailureResponse,
    openai_function,
)
from .state import state_of
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
    f"Deadline: `{h.DEADLINE}` header (remaining ms), else the tool's default; capped by the "
    "tool's maximum."
)


_HEADER_PARAMETERS = [
    {
        "name": h.DEADLINE,
        "in": "header",
        "required": False,
        "description": "this call's remaining budget in milliseconds (with a body `deadline_ms` "
        "too, the earlier wins; capped by the tool's maximum)",
        "schema": {"type": "number", "minimum": 0},
    },
    {
        "name": h.TRAJECTORY,
        "in": "header",
        "required": False,
        "description": "trace capture: the rollout this call belongs to (passed on to the tool)",
        "schema": {"type": "string", "maxLength": h.TRAJECTORY_MAX_CHARS},
    },
    {
        "name": h.STEP,
        "in": "header",
        "required": False,
        "description": "training step: trace capture, and passed on to the tool (drifting "
        "latency profiles drift by it)",
        "schema": {"type": "integer", "minimum": 0},
    },
    {
        "name": h.TURN,
        "in": "header",
        "required": False,
        "description": "trace capture: turn within the trajectory (passed on to the tool)",
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
    toolset = state_of(request).toolset
    if toolset is None:
        raise HTTPException(503, "the gateway is starting")
    return toolset


def _declined(request: Request, kind: str | None = None, tool: str | None = None) -> Response:
    """Reached only when the fast path (gateway.passthrough) declined a call: say why, clearly."""
    toolset = _toolset(request)
    refused = state_of(request).door.refused
    if kind is not None and toolset.first_of_kind(kind) is None:
        refused["unknown_tool"] += 1
        raise HTTPException(404, f"no {kind} tool is configured in the gateway's tools table")
    if tool is not None and tool not in toolset.tools:
        refused["unknown_tool"] += 1
        known = ", ".join(sorted(toolset.tools)) or "none"
        raise HTTPException(404, f"unknown tool {tool!r}; known tools: {known}")
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
    return _declined(request, kind="sandbox")


@router.post(
    "/v1/run_tests",
    tags=["pass-through"],
    summary="sandboxd run_tests",
    description="Forwarded as is to the sandbox tool. " + _DEADLINE_DOC,
    openapi_extra=_body_doc(RunTestsBody),
    responses=_FAILURES,
)
async def run_tests(request: Request) -> Response:
    return _declined(request, kind="sandbox")


@router.post(
    "/retrieve",
    tags=["pass-through"],
    summary="Search-R1 retrieve",
    description="Forwarded as is to the search tool. " + _DEADLINE_DOC,
    openapi_extra=_body_doc(RetrieveBody),
    responses=_FAILURES,
)
async def retrieve(request: Request) -> Response:
    return _declined(request, kind="search")


# ---------------------------------------------------------------- generic


@router.post(
    "/v1/tools/{tool}/call",
    tags=["tools"],
    response_model=ToolCallResponse,
    responses={404: {"description": "unknown tool"}, **_FAILURES},
    summary="Call any tool",
    openapi_extra=_body_doc(ToolCallRequest),
)
async def call_tool(tool: str, request: Request) -> Response:
    """Forward `arguments` to the tool's native endpoint, under one deadline: the earlier of the
    body's `deadline_ms` and the `X-Toolenv-Deadline-Ms` header, else the tool's default, capped
    by the tool's maximum.

    200 `{"tool", "status": "ok"|"error", "result", "error", "elapsed_s", "request_id"}` (a
    tool's own error answer: "error", its body in `result`, its `Retry-After` passed on);
    504 `{"tool", "status": "timeout", "error", "elapsed_s", "deadline_ms", "request_id"}`.
    """
    # Served by gateway.passthrough.generic_call; reached only for an unknown tool (or while
    # starting). No body model here: FastAPI would refuse a `curl -d` body (a form content type)
    # with a 422 before the 404. Malformed JSON is the one 400, as on every route.
    raw = await request.body()
    if raw and not wirejson.is_json(raw):
        state_of(request).door.refused["invalid_request"] += 1
        raise HTTPException(NOT_JSON_STATUS, NOT_JSON)
    return _declined(request, tool=tool)


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


# GET documented, HEAD (load balancers' probe) not: one route with both gave OpenAPI two
# operations with one operationId (the spec wants them unique; FastAPI warned at /docs)
@router.get("/healthz", tags=["ops"])
@router.head("/healthz", include_in_schema=False)
async def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/readyz", tags=["ops"], responses={503: {"description": "names what is not ready"}})
@router.head("/readyz", include_in_schema=False)
async def readyz(request: Request) -> JSONResponse:
    """Readiness: start-up finished and every tool can take calls (upstreams reachable)."""
    state = state_of(request)
    toolset = state.toolset
    if not state.ready or toolset is None:
        return JSONResponse({"status": "starting", "detail": "the gateway is starting"}, 503)
    problems = toolset.not_ready()
    if problems:
        return JSONResponse({"status": "not ready", "detail": "; ".join(problems)}, 503)
    return JSONResponse({"status": "ready", "tools": sorted(toolset.tools)})


@router.get("/metrics", tags=["ops"], response_class=Response)
async def metrics(request: Request) -> Response:
    """Prometheus metrics (text exposition format)."""
    return Response(
        generate_latest(state_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST
    )
