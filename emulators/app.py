"""The emulators' ASGI app: search + reward emulators and the profile routes, in one lifespan.

The gateway mounts the same routers in-process (`build_emulators` + `mount_emulators`); alone,
this app is what `toolenv emulators serve` runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException

from toolenv_core import __version__
from toolenv_core.allow import http_error
from toolenv_core.bodylimit import BodyLimit
from toolenv_core.heap import freeze_startup_objects
from toolenv_core.latency.profile import ProfileError, load_profile, shipped_profile_path

from .base import ProfileRejected, ToolEmulator
from .fastpath import FastPathMiddleware
from .profiles_router import build_profiles_router, pin_to_cache
from .reward import RewardEmulator
from .reward import build_router as build_reward_router
from .search import SearchEmulator
from .search import build_router as build_search_router
from .settings import EmulatorSettings

E = TypeVar("E", SearchEmulator, RewardEmulator)


def _emulator(cls: type[E], settings: EmulatorSettings) -> E:
    """One emulator with its configured (or shipped) profile (one that names no `tool` is this
    emulator's). A profile it refuses (another tool's, a trace replay whose files cannot be
    read) names where the profile came from: with `--profile` and `--reward-profile` both
    given, "field 'tool': this is the 'search' emulator" did not say which file was wrong."""
    inline = getattr(settings, f"{cls.name}_profile")
    path = getattr(settings, f"{cls.name}_profile_file") or shipped_profile_path(
        f"{cls.name}_default"
    )
    profile = inline if inline is not None else load_profile(path)
    if "tool" not in profile.model_fields_set:  # as a PUT takes its path's tool: a reward
        # profile written without `tool:` was refused as "the profile says 'search'"
        profile = profile.model_copy(update={"tool": cls.name})
    try:
        return cls(settings, pin_to_cache(profile, settings.trace_cache))
    except ProfileRejected as exc:
        where = f"emulators.{cls.name}_profile" if inline is not None else str(path)
        raise ProfileError(f"{where}: {exc}") from exc


def build_emulators(settings: EmulatorSettings) -> dict[str, ToolEmulator]:
    """The emulated tools with their configured (or shipped) profiles; raises ProfileError."""
    search = _emulator(SearchEmulator, settings)
    reward = _emulator(RewardEmulator, settings)
    return {search.name: search, reward.name: reward}


def mount_emulators(app: FastAPI, emulators: dict[str, ToolEmulator]) -> None:
    """Add the emulators' routes to `app` (and their direct lane past FastAPI's routing)."""
    search = build_search_router(emulators["search"])  # type: ignore[arg-type]
    reward = build_reward_router(emulators["reward"])  # type: ignore[arg-type]
    for router in (search, reward, build_profiles_router(emulators)):
        app.include_router(router)
    app.add_middleware(FastPathMiddleware, routes={**search.fast_routes, **reward.fast_routes})


def create_app(settings: EmulatorSettings | None = None) -> FastAPI:
    settings = settings or EmulatorSettings.load()
    emulators = build_emulators(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for emu in emulators.values():
            await emu.start()
        freeze_startup_objects()
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False
            for emu in emulators.values():
                await emu.close()

    app = FastAPIOffline(  # /docs serves its own Swagger UI assets: works offline
        title="toolenv emulators", version=__version__, lifespan=lifespan
    )
    app.add_exception_handler(HTTPException, http_error)  # a 405's Allow names every method
    app.state.settings = settings
    app.state.emulators = emulators
    app.state.ready = False
    mount_emulators(app, emulators)
    # Outside the direct lane, whose handlers read the body: a body past the limit, or one that
    # never arrives, is a 413 / 408 (the gateway's door applies the same bounds in front).
    app.add_middleware(
        BodyLimit, max_body_bytes=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s
    )

    # GET documented, HEAD not: both on one route made two operations with one operationId
    @app.get("/healthz", tags=["ops"])
    @app.head("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"])
    @app.head("/readyz", include_in_schema=False)
    async def readyz() -> dict[str, object]:
        return {"status": "ready" if app.state.ready else "starting", "tools": sorted(emulators)}

    return app
