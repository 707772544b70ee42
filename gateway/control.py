"""Runtime control through the one front door: the emulators' latency profiles, the sandbox's
status and SandboxFusion's `/v1/ping`, reached through the gateway in embedded and proxy mode
alike (behind the API key when keys are set, like every route but `/healthz` and `/readyz`).

Control calls skip admission and the rate limit (an operator must reach a saturated tool, and
a gateway whose callers used up their budget: `guard.UNMETERED_PATHS`) and are bounded by
`CONTROL_TIMEOUT_S`. A read goes to one upstream; a profile change goes to every upstream of the
tool (each emulator replica holds its own profile) and succeeds only if every one took it. A
profile read asks every healthy upstream: a replica restarted since the change holds its
configured profile again, and one upstream's answer said the change held everywhere.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from toolenv_core import headers as h
from toolenv_core.errors import NOT_JSON, NOT_JSON_STATUS

from .dispatch import ToolRuntime
from .state import state_of
from .upstream import (
    EXECUTOR_HEADERS,
    Endpoint,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamReply,
    pick,
)

CONTROL_TIMEOUT_S = 10.0
EMULATED_KINDS = ("search", "reward")
router = APIRouter(tags=["control"])


def _runtime(request: Request, kind: str) -> ToolRuntime:
    toolset = state_of(request).toolset
    if toolset is None:
        raise HTTPException(503, "the gateway is starting")
    runtime = toolset.first_of_kind(kind)
    if runtime is None:
        raise HTTPException(404, f"no {kind} tool is configured in the gateway's tools table")
    return runtime


def _emulated(request: Request, name: str) -> ToolRuntime:
    if name not in EMULATED_KINDS:
        raise HTTPException(
            404, f"no emulated tool {name!r}; emulated: {', '.join(EMULATED_KINDS)}"
        )
    return _runtime(request, name)


async def _send(
    runtime: ToolRuntime,
    method: str,
    path: str,
    body: bytes,
    request: Request,
    endpoints: list[Endpoint] | None = None,
) -> list[UpstreamReply]:
    """Send to one upstream (GET), to every upstream (PUT) or to `endpoints`; the tool's failures
    as HTTP errors. A PUT some upstreams took and others missed says which did what (the replicas
    now differ); a read that some of `endpoints` answered is theirs."""
    headers = {"content-type": "application/json", h.REQUEST_ID: _request_id(request)}
    if endpoints is None:
        every = method == "PUT"
        endpoints = runtime.backend.endpoints if every else [pick(runtime.backend.endpoints)]

    async def bounded(endpoint: Endpoint) -> UpstreamReply:
        """Each upstream bounded on its own: one that hangs is named beside those that took the
        change (one timer over them all answered a bare 504, the replicas apart, unsaid)."""
        try:
            send = runtime.backend.send(endpoint, method, path, body, headers)
            return await asyncio.wait_for(send, CONTROL_TIMEOUT_S)
        except TimeoutError:
            raise _Silent(
                f"{endpoint.label}: did not answer within {CONTROL_TIMEOUT_S:g} s"
            ) from None

    results = await asyncio.gather(*(bounded(e) for e in endpoints), return_exceptions=True)
    replies = [r for r in results if isinstance(r, UpstreamReply)]
    failures = [r for r in results if isinstance(r, BaseException)]
    if not failures:
        return replies
    if replies and method != "GET":  # some took it
        raise _answered_apart(runtime, results)
    if replies:  # a read: those that answered
        return replies
    exc = failures[0]
    if isinstance(exc, _Silent):
        raise HTTPException(
            504, f"tool {runtime.name!r} did not answer within {CONTROL_TIMEOUT_S:g} s"
        ) from None
    if isinstance(exc, UpstreamConnectError):
        raise HTTPException(503, f"tool {runtime.name!r} is unavailable: {exc}") from None
    if isinstance(exc, UpstreamBroken):
        raise HTTPException(502, f"tool {runtime.name!r} failed mid-request: {exc}") from None
    raise exc


class _Silent(Exception):
    """An upstream did not answer a control call within `CONTROL_TIMEOUT_S`."""


def _answered_apart(
    runtime: ToolRuntime, results: Sequence[UpstreamReply | BaseException]
) -> HTTPException:
    """A 502 naming what each upstream did (an error's text names its upstream): the replicas
    now differ."""
    detail = "; ".join(
        f"{r.endpoint}: HTTP {r.status}" if isinstance(r, UpstreamReply) else str(r)
        for r in results
    )
    return HTTPException(502, f"tool {runtime.name!r}: its upstreams answered apart ({detail})")


def _answer(runtime: ToolRuntime, replies: list[UpstreamReply]) -> Response:
    first = replies[0]
    disagree = [r for r in replies if r.status != first.status]
    if disagree:
        raise _answered_apart(runtime, replies)
    media = first.headers.get("content-type", "application/json")
    # where the one upstream that answered ran (a Ray replica: the status is that replica's pool,
    # the profile that replica's); several upstreams' answers are not one place
    one = len(replies) == 1
    where = {k: first.headers[k] for k in EXECUTOR_HEADERS if one and k in first.headers}
    return Response(first.body, first.status, media_type=media, headers=where or None)


def _same_profile(runtime: ToolRuntime, replies: list[UpstreamReply]) -> list[UpstreamReply]:
    """`replies` when every upstream holds one profile, else a 502 naming which holds which."""
    groups: dict[str, list[str]] = {}
    for r in replies:
        try:
            key = json.dumps(json.loads(r.body), sort_keys=True)
        except (ValueError, RecursionError):
            key = r.body.decode("latin-1")
        groups.setdefault(f"{r.status} {key}", []).append(r.endpoint)
    if len(groups) == 1:
        return replies
    held = "; ".join(
        f"{', '.join(where)}: profile {n}" for n, where in enumerate(groups.values(), 1)
    )
    raise HTTPException(
        502,
        f"tool {runtime.name!r}: its upstreams hold different profiles ({held}); an upstream "
        "restarted since the last PUT holds its configured profile again: PUT the profile again",
    )


def _request_id(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id", "")


def _check_json(raw: bytes, request: Request) -> JSONResponse | None:
    try:
        json.loads(raw)
    except (ValueError, RecursionError):  # nesting too deep for `json` was a 500
        state_of(request).door.refused["invalid_request"] += 1  # counted as on every route
        return JSONResponse(
            {"detail": NOT_JSON, "request_id": _request_id(request)}, NOT_JSON_STATUS
        )
    return None


_PROFILE_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"type": "object"}}},
        "description": "a latency profile (`{tool, model}`), as `toolenv emulators` documents",
    }
}


@router.get(
    "/v1/emulators/{name}/profile",
    summary="The active latency profile of an emulated tool (search | reward)",
)
async def get_profile(name: str, request: Request) -> Response:
    runtime = _emulated(request, name)
    path = f"/v1/emulators/{name}/profile"
    endpoints = runtime.backend.endpoints
    healthy = [e for e in endpoints if e.healthy] or endpoints
    replies = await _send(runtime, "GET", path, b"", request, healthy)
    return _answer(runtime, _same_profile(runtime, replies))


@router.put(
    "/v1/emulators/{name}/profile",
    summary="Swap the latency profile of an emulated tool (every upstream of it)",
    openapi_extra=_PROFILE_BODY,
)
async def put_profile(name: str, request: Request) -> Response:
    runtime = _emulated(request, name)
    why = runtime.backend.one_replica_of_many()
    if why is not None:  # it answered 200 and changed one replica of two: the rest went on
        raise HTTPException(
            409,
            f"the {name} profile cannot be changed at run time here: {why}. Set "
            f"emulators.{name}_profile in the config and deploy again, or run one replica "
            "(ray.emulators: min_replicas = max_replicas = 1)",
        )
    raw = await request.body()
    bad = _check_json(raw, request)
    if bad is not None:
        return bad
    path = f"/v1/emulators/{name}/profile"
    return _answer(runtime, await _send(runtime, "PUT", path, raw, request))


@router.get("/v1/sandbox/status", summary="The sandbox tool's backend, admission and pool state")
async def sandbox_status(request: Request) -> Response:
    runtime = _runtime(request, "sandbox")
    return _answer(runtime, await _send(runtime, "GET", "/v1/sandbox/status", b"", request))


@router.get("/v1/languages", summary="The languages the sandbox tool runs")
async def languages(request: Request) -> Response:
    runtime = _runtime(request, "sandbox")
    return _answer(runtime, await _send(runtime, "GET", "/v1/languages", b"", request))


@router.get("/v1/ping", summary='SandboxFusion\'s liveness probe: "pong" from the sandbox tool')
async def ping(request: Request) -> Response:
    runtime = _runtime(request, "sandbox")
    return _answer(runtime, await _send(runtime, "GET", "/v1/ping", b"", request))
