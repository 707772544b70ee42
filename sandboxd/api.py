"""The HTTP router: `POST /run_code`, `POST /v1/run_tests`, ping, languages, status.

Everything a client can get wrong is answered here with the right status and a message that says
what to fix (400 unknown language, 413 body too large, 422 invalid fields, 429 + Retry-After at
capacity, 503 not started). The app (`sandboxd.app`) bounds a body's size and time in front
(`toolenv_core.bodylimit`: 413, 408); the router still checks the size as it reads, with the same
words, so that it stays bounded wherever it is mounted.
"""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from toolenv_core import headers as h
from toolenv_core.admission import Rejected
from toolenv_core.bodylimit import too_large_message
from toolenv_core.deadline import DEADLINE_HEADER, DeadlineHeaderError
from toolenv_core.disconnect import ClientGone, unless_disconnected
from toolenv_core.errors import NOT_JSON, NOT_JSON_STATUS

from .requests import BadRequest
from .service import SandboxService
from .wire import (
    RunCodeRequest,
    RunCodeResponse,
    RunStatus,
    RunTestsRequest,
    RunTestsResponse,
    Verdict,
)

M = TypeVar("M", bound=BaseModel)
WATCH_AFTER_S = 0.05  # a call still running after this watches for its client's disconnect
log = logging.getLogger("sandboxd")

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "unknown language (the message lists the supported ones), bad deadline"},
    408: {"description": "request body not whole within body_timeout_s (connection closed)"},
    413: {"description": "request body larger than max_body_bytes"},
    422: {"description": "missing or invalid fields, timeouts or limits out of range"},
    429: {
        "description": "at capacity: the bounded queue is full or the wait ran out (Retry-After)"
    },
    503: {"description": "the sandbox backend is not started"},
}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


class _BodyTooLarge(Exception):
    pass


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(request: Request, model: type[M], limit: int) -> M | JSONResponse:
    try:
        body = await _read_body(request, limit)
    except _BodyTooLarge:
        return _error(413, too_large_message(limit))
    try:
        data = json.loads(body) if body else None
    except (ValueError, RecursionError):  # nesting too deep for `json` was a 500
        return _error(NOT_JSON_STATUS, NOT_JSON)
    if not isinstance(data, dict):
        return _error(422, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # Without the offending input: it may be huge, or a NaN/Infinity no JSON answer can hold.
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        return JSONResponse({"detail": jsonable_encoder(errors)}, status_code=422)


def _run_code_failure(message: str) -> RunCodeResponse:
    return RunCodeResponse(status=RunStatus.SANDBOX_ERROR, message=message)


def _run_tests_failure(message: str) -> RunTestsResponse:
    return RunTestsResponse(
        verdict=Verdict.SANDBOX_ERROR,
        passed=0,
        total=0,
        pass_fraction=0.0,
        cases=[],
        message=message,
    )


def build_router(service: SandboxService) -> APIRouter:
    """All sandboxd endpoints, bound to one service (the gateway mounts this in-process)."""
    router = APIRouter()
    limit = service.settings.max_body_bytes
    expired = {h.DEADLINE_EXPIRED: "1"}  # on an answer the call's deadline ended

    async def handle(request: Request, model: type[M], call, fallback) -> Response:
        try:
            deadline = service.deadlines.from_headers(request.headers)
        except DeadlineHeaderError as exc:
            return _error(400, str(exc))
        parsed = await _parse(request, model, limit)
        if isinstance(parsed, JSONResponse):
            return parsed
        try:
            result = await unless_disconnected(
                call(parsed, deadline), request.receive, watch_after_s=WATCH_AFTER_S
            )
        except ClientGone:
            return Response(status_code=499)  # never sent: nginx's "client closed request"
        except BadRequest as exc:
            return _error(exc.status, exc.message)
        except Rejected as exc:
            return _error(429, str(exc), {"Retry-After": exc.retry_after_header})
        except Exception as exc:  # never a 500: the failure is reported in the body
            log.exception("sandboxd request failed")
            result = fallback(f"sandbox error: {type(exc).__name__}: {exc}")
        # The body stays SandboxFusion's; the header tells a gateway that this TimeLimitExceeded
        # is the deadline's (its `timeout`), not the program's own run_timeout.
        headers = expired if service.ended_by_deadline(result, deadline) else None
        return Response(result.model_dump_json(), media_type="application/json", headers=headers)

    @router.post(
        "/run_code",
        response_model=RunCodeResponse,
        responses=_ERRORS,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": RunCodeRequest.model_json_schema()}},
            }
        },
        summary="Run one program (SandboxFusion-compatible)",
        description=f"Honours `{DEADLINE_HEADER}` (remaining ms) as a bound on the whole call.",
    )
    async def run_code(request: Request) -> Response:
        return await handle(request, RunCodeRequest, service.run_code, _run_code_failure)

    @router.post(
        "/v1/run_tests",
        response_model=RunTestsResponse,
        responses=_ERRORS,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": RunTestsRequest.model_json_schema()}},
            }
        },
        summary="Run one program against test cases; a verdict per case and the pass fraction",
        description=f"Honours `{DEADLINE_HEADER}` (remaining ms) as a bound on the whole call.",
    )
    async def run_tests(request: Request) -> Response:
        return await handle(request, RunTestsRequest, service.run_tests, _run_tests_failure)

    @router.get("/v1/ping", summary='Liveness: answers "pong" (as SandboxFusion does)')
    async def ping() -> str:
        return "pong"

    @router.get("/v1/languages", summary="Supported languages")
    async def languages() -> dict[str, Any]:
        return {"languages": service.languages()}

    @router.get("/v1/sandbox/status", summary="Backend, admission and pool state")
    async def status() -> dict[str, Any]:
        return service.status()

    # GET documented, HEAD not: both on one route made two operations with one operationId
    @router.get("/readyz", summary="200 once the backend is started, else 503")
    @router.head("/readyz", include_in_schema=False)
    async def readyz() -> Response:
        if not service.started:
            return _error(503, "sandbox backend not started")
        return JSONResponse({"status": "ready", "backend": service.settings.backend})

    return router
