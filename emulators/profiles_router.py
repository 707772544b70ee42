"""`GET /v1/emulators`, `GET/PUT /v1/emulators/{tool}/profile`: see and swap profiles at run time."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from toolenv_core.errors import NOT_JSON, NOT_JSON_STATUS
from toolenv_core.latency.profile import Profile
from toolenv_core.latency.samplers import Sampler
from toolenv_core.latency.specs import TraceReplay
from toolenv_core.polytrace.cache import confine_trace, missing_trace_error, resolve_trace

from .base import ProfileRejected, ToolEmulator


def trace_specs(obj: Any, loc: list[str | int]) -> Iterator[tuple[list[str | int], TraceReplay]]:
    """Every `trace` model in a profile (mixture components, drift stages, faulty, tokens)."""
    if isinstance(obj, TraceReplay):
        yield loc, obj
    elif isinstance(obj, BaseModel):
        for name in type(obj).model_fields:
            yield from trace_specs(getattr(obj, name), [*loc, name])
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            yield from trace_specs(item, [*loc, i])


def _not_text(obj: Any, loc: list[str | int]) -> list[str | int] | None:
    """Where a JSON value holds a string that is not text (a lone surrogate escape, `"\\ud800"`,
    which JSON allows and UTF-8 cannot encode), or None."""
    if isinstance(obj, str):
        try:
            obj.encode()
        except UnicodeEncodeError:
            return loc
    elif isinstance(obj, dict):
        for key, value in obj.items():
            found = _not_text(key, loc) or _not_text(value, [*loc, key])
            if found is not None:
                return found
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            found = _not_text(item, [*loc, i])
            if found is not None:
                return found
    return None


def confine_traces(profile: Profile, roots: Sequence[Path]) -> None:
    """Pin each trace path of a profile sent over HTTP inside `roots` (in place), or raise
    ProfileRejected: a PUT must not read, or learn of, files elsewhere on the server."""
    for loc, spec in trace_specs(profile, []):
        pinned = []
        for i, raw in enumerate(spec.paths or []):
            try:
                pinned.append(str(confine_trace(raw, roots)))
            except ValueError as exc:
                raise ProfileRejected([*loc, "paths", i], str(exc)) from exc
        if spec.paths is not None:
            spec.paths = pinned


def pin_to_cache(profile: Profile, cache: Path) -> Profile:
    """A configured profile (which may name any path) with each trace name found now, in the
    service's own trace cache (`EmulatorSettings.trace_cache`): its samplers, built later, read
    a name in the cache of `TOOLENV_CONFIG` otherwise. Raises ProfileRejected for a name that
    is nowhere."""
    pinned = profile.model_copy(deep=True)
    for loc, spec in trace_specs(pinned, []):
        found = []
        for i, raw in enumerate(spec.paths or []):
            path = resolve_trace(raw, cache)
            if not path.exists():
                raise ProfileRejected([*loc, "paths", i], str(missing_trace_error(raw, cache)))
            found.append(str(path))
        if spec.paths is not None:
            spec.paths = found
    return pinned


def _not_a_profile() -> JSONResponse:
    detail = [
        {"loc": ["body"], "msg": "body must be a JSON object (a profile)", "type": "dict_type"}
    ]
    return JSONResponse({"detail": detail}, status_code=422)


def prepare_profile(
    emu: ToolEmulator, tool: str, raw: bytes
) -> tuple[Profile, Sampler] | JSONResponse:
    """A PUT body as a profile and its sampler, built and ready to swap in, or the answer that
    refuses it. Pure CPU, and a lot of it for a large profile (1.4M samples: about 1.3 s, which
    on the event loop stalled every call of the emulator): run in a worker thread."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # nesting too deep for `json` was a 500
        return JSONResponse({"detail": NOT_JSON}, status_code=NOT_JSON_STATUS)
    if not isinstance(data, dict):
        return _not_a_profile()
    data.setdefault("tool", tool)
    try:
        # an active profile is read back as UTF-8 JSON (GET): one it cannot be written as
        # made those GETs and `GET /v1/emulators` a 500 until the next swap
        bad = _not_text(data, [])
        if bad is not None:
            raise ProfileRejected(bad, "must be text: a lone surrogate escape is not")
        profile = emu.parse_profile(data)
        confine_traces(profile, emu.settings.trace_roots)
        return profile, emu.build(profile)
    except ProfileRejected as exc:
        return JSONResponse({"detail": exc.detail, "message": str(exc)}, status_code=422)


def profile_json(profile: Profile) -> bytes:
    """The active profile as the JSON a GET answers (the object a fit writes)."""
    return profile.model_dump_json(exclude_none=True).encode()


def build_profiles_router(emulators: dict[str, ToolEmulator]) -> APIRouter:
    router = APIRouter(tags=["emulator profiles"])
    written: dict[str, tuple[Profile, bytes]] = {}  # each tool's profile as a GET last wrote it

    def unknown(tool: str) -> JSONResponse:
        return JSONResponse(
            {"detail": f"unknown tool {tool!r}; emulated tools: {', '.join(sorted(emulators))}"},
            status_code=404,
        )

    @router.get("/v1/emulators", summary="List the emulated tools")
    async def list_tools() -> dict:
        return {
            "tools": [
                {
                    "tool": name,
                    "kind": emu.profile.model.kind,
                    "source": emu.profile.source,
                    "calls": emu.calls,
                    "profile": f"/v1/emulators/{name}/profile",
                }
                for name, emu in sorted(emulators.items())
            ]
        }

    @router.get("/v1/emulators/{tool}/profile", summary="The active latency profile of a tool")
    async def get_profile(tool: str):
        emu = emulators.get(tool)
        if emu is None:
            return unknown(tool)
        # written in a worker thread (as a PUT is parsed) and once per profile: a profile of a
        # million samples took about 0.6 s to write on the event loop, every call waiting
        profile = emu.profile
        kept = written.get(tool)
        if kept is None or kept[0] is not profile:
            kept = written[tool] = (profile, await anyio.to_thread.run_sync(profile_json, profile))
        return Response(kept[1], media_type="application/json")

    @router.put(
        "/v1/emulators/{tool}/profile",
        summary="Swap a tool's latency profile (validated; a bad one changes nothing)",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"type": "object"}}},
            }
        },
    )
    async def put_profile(tool: str, request: Request):
        """The body is a profile, the same object a fit writes: `{"tool": ..., "model": {"kind": ...}}`.
        Without `tool` the path's tool is assumed. 422 names the offending field."""
        emu = emulators.get(tool)
        if emu is None:
            return unknown(tool)
        prepared = await anyio.to_thread.run_sync(prepare_profile, emu, tool, await request.body())
        if isinstance(prepared, JSONResponse):
            return prepared  # refused: nothing changed
        profile, sampler = prepared
        emu.activate(profile, sampler)  # on the event loop, between two calls
        return JSONResponse({"tool": tool, "kind": profile.model.kind, "active": True})

    return router
