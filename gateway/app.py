"""The gateway's ASGI application: built from settings, with everything it owns in its lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException

from toolenv_core import __version__
from toolenv_core.admission import RateLimits
from toolenv_core.allow import allowed_methods
from toolenv_core.errors import NOT_JSON, NOT_JSON_STATUS, error_problems
from toolenv_core.heap import freeze_startup_objects

from .asgi import ASGIApp
from .control import router as control_router
from .guard import Door, Guard
from .metrics import GatewayMetrics
from .passthrough import PassThrough
from .routes import router
from .settings import GatewaySettings
from .state import GatewayState
from .toolset import ToolSet, check_custom_apps
from .trace import TraceWriter, check_trace_path
from .upstream import Backend

DESCRIPTION = """One async front door for every tool: admission control (concurrency limit,
bounded queue, 429 + Retry-After), one deadline per call (`X-Toolenv-Deadline-Ms`, and on the
generic call a body `deadline_ms`: the earlier wins) with a structured 504 at expiry, hedging and retries, Prometheus
metrics and trace capture (`X-Trajectory-Id`). `/run_code`, `/retrieve` and `/v1/run_tests`
speak their upstreams' wire formats; `POST /v1/tools/{tool}/call` is the generic call."""


def create_app(
    settings: GatewaySettings | None = None,
    mounts: Mapping[str, ASGIApp] | None = None,
    backends: Mapping[str, Backend] | None = None,
) -> FastAPI:
    """The gateway app. `mounts` are the in-process apps its embedded tools use, by mount name
    ("sandboxd", "emulators", or a custom tool's "module:factory"): built by whoever wires the
    gateway (`toolenv serve`), so the gateway itself never looks an application up. `backends`
    are tools whose calls go to a backend the wiring built (`toolenv serve --ray`: deployment
    handles) instead of the one their mode would build."""
    settings = settings or GatewaySettings.load()
    check_custom_apps(settings, mounts or {}, backends or {})
    if settings.trace_path:
        check_trace_path(settings.trace_path)
    rate = (
        RateLimits(settings.rate_limit_per_s, settings.rate_limit_burst)
        if settings.rate_limit_per_s
        else None
    )
    door = Door(
        [k.get_secret_value() for k in settings.api_keys],
        settings.max_body_bytes,
        rate,
        settings.body_timeout_s,
    )
    state = GatewayState(settings, GatewayMetrics(), door, dict(mounts or {}), dict(backends or {}))
    state.metrics.track_refusals(door.refused)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        toolset = ToolSet(settings, state.metrics, state.mounts, state.backends)
        state.toolset = toolset
        state.metrics.track_admission(
            lambda: [
                (rt.name, rt.admission.in_flight, rt.admission.waiting)
                for rt in toolset.tools.values()
            ]
        )
        trace = TraceWriter(settings.trace_path) if settings.trace_path else None
        state.trace = trace
        try:
            if trace is not None:
                await trace.start()
            await toolset.start()
            freeze_startup_objects()
            state.ready = True
            yield
        finally:
            state.ready = False
            await toolset.close()
            if trace is not None:
                await trace.close()

    app = FastAPIOffline(  # /docs serves its own Swagger UI assets: works offline
        title="toolenv gateway", version=__version__, description=DESCRIPTION, lifespan=lifespan
    )
    app.state.gateway = state
    app.include_router(router)
    app.include_router(control_router)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return JSONResponse({"detail": NOT_JSON, "request_id": _rid(request)}, NOT_JSON_STATUS)
        fields = "; ".join(
            f"{field or 'body'}: {message}" for field, message in error_problems(errors, skip=1)
        )
        return JSONResponse(
            {
                "detail": f"invalid request: {fields}",
                "errors": _plain(errors),
                "request_id": _rid(request),
            },
            422,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = exc.headers
        if exc.status_code == 405:  # Starlette's names one route of the path: /healthz's HEAD
            headers = {**(headers or {}), "Allow": allowed_methods(request)}
        return JSONResponse(
            {"detail": exc.detail, "request_id": _rid(request)}, exc.status_code, headers=headers
        )

    app.add_middleware(PassThrough, state=state)  # inside the guard: keys and limits apply
    app.add_middleware(Guard, door=door)
    return app


def _rid(request: Request) -> str | None:
    return request.scope.get("state", {}).get("request_id")


def _plain(errors: list[dict]) -> list[dict]:
    """Validation errors without the offending input (it may be huge, or carry a secret)."""
    return [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in errors]
