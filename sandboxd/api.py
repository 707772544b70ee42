"""The HTTP router: `POST /run_code`, `POST /v1/run_tests`, ping, languages, status.

Everything a client can get wrong is answered here with the right status and a message that says
what to fix (400 unknown language, 413 body too large, 422 invalid fields, 429 + Retry-After at
capacity, 503 not started). The app (`sandboxd.app`) bounds a body's size and time in front
(`toolenv_core.bodylimit`: 413, 408); the router still checks the size as it reads, with the same
words, so that it stays bounded wherever it is mounted.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from toolenv_core.admission import Rejected
from toolenv_core.bodylimit import too_large_message
from toolenv_core.deadline import DEADLINE_HEADER, DeadlineHeaderError
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
T = TypeVar("T")
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


class _ClientGone(Exception):
    """The client disconnected before its answer: no one is left to read it."""


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`, stopped as soon as the client disconnects (then `_ClientGone`).

    uvicorn does not cancel a request's task when its client leaves: a program would run on to
    its time limit (up to `max_timeout_s`, a run_tests request's every case), holding admission
    slots for an answer no one reads, and a queued call would still take its turn. Past the body
    the next `receive()` returns only at the disconnect, so a watcher awaits it and cancels this
    task; the backend then kills the program and cleans up, as for any cancelled run. The watcher
    starts only once the call has taken `WATCH_AFTER_S`: most runs end sooner, and a task per
    call cost a short run's throughput a few percent."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    gone = False
    watcher: asyncio.Task[None] | None = None

    async def watch() -> None:
        nonlocal gone
        if (await request.receive())["type"] == "http.disconnect":
            gone = True
            task.cancel()

    def arm() -> None:
        nonlocal watcher
        watcher = loop.create_task(watch())

    timer = loop.call_later(WATCH_AFTER_S, arm)
    try:
        return await work
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:  # ours alone (not a shutdown's)
            raise _ClientGone from None
        raise
    finally:
        timer.cancel()
        if watcher is not None:  # no await since `work` ended: it cannot have fired after it
            watcher.cancel()


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

    async def handle(request: Request, model: type[M], call, fallback) -> Response:
        try:
            deadline = service.deadlines.from_headers(request.headers)
        except DeadlineHeaderError as exc:
            return _error(400, str(exc))
        parsed = await _parse(request, model, limit)
        if isinstance(parsed, JSONResponse):
            return parsed
        try:
            result = await _unless_gone(request, call(parsed, deadline))
        except _ClientGone:
            return Response(status_code=499)  # never sent: nginx's "client closed request"
        except BadRequest as exc:
            return _error(exc.status, exc.message)
        except Rejected as exc:
            return _error(429, str(exc), {"Retry-After": exc.retry_after_header})
        except Exception as exc:  # never a 500: the failure is reported in the body
            log.exception("sandboxd request failed")
            result = fallback(f"sandbox error: {type(exc).__name__}: {exc}")
        return Response(result.model_dump_json(), media_type="application/json")

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

    @router.api_route(
        "/readyz", methods=["GET", "HEAD"], summary="200 once the backend is started, else 503"
    )
    async def readyz() -> Response:
        if not service.started:
            return _error(503, "sandbox backend not started")
        return JSONResponse({"status": "ready", "backend": service.settings.backend})

    return router
