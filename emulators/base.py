"""What every tool emulator shares: an active profile, a seeded rng, and how a draw becomes a reply.

A call's fate is drawn from the active profile (delay + optional fault) and played out against the
caller's deadline: the reply is sent at arrival + delay (504 at the deadline if that comes first),
a hang answers 504 exactly at the deadline, a throttle answers 429 with Retry-After at once, an
error answers its status after the delay, a slow body trickles out in chunks. Every reply carries
`X-Toolenv-Injected-Delay-Ms` (what was scheduled), `X-Toolenv-Timer-Error-Ms` (when the handler
woke minus scheduled, measured here) and `X-Toolenv-Pacing-Lead-Ms` (how early it woke on purpose:
the measured response path and intake latency, so that the reply leaves on schedule; see
`timing.Pacer`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, ParamSpec, TypeVar

import anyio
import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive

from toolenv_core import headers as h
from toolenv_core.deadline import Deadline
from toolenv_core.errors import NOT_JSON, NOT_JSON_STATUS, first_problem
from toolenv_core.latency.faults import ErrorFault, HangFault, SlowBodyFault, ThrottleFault
from toolenv_core.latency.profile import Profile
from toolenv_core.latency.samplers import Draw, Sampler
from toolenv_core.timer import sleep_until

from .settings import EmulatorSettings
from .timing import ClientGone, PacedResponse, Pacer, received_at, sleep_or_gone

M = TypeVar("M", bound=BaseModel)
P = ParamSpec("P")


class ProfileRejected(ValueError):
    """A profile that cannot serve this tool: carries FastAPI-shaped error details for a 422."""

    def __init__(self, loc: list[str | int], msg: str) -> None:
        super().__init__(f"field {'.'.join(map(str, loc))!r}: {msg}")
        self.detail = [{"loc": ["body", *loc], "msg": msg, "type": "value_error"}]


class ToolEmulator:
    """One emulated tool: its active profile, the sampler built from it, and a seeded rng."""

    name: str = ""

    def __init__(self, settings: EmulatorSettings, profile: Profile, seed_index: int) -> None:
        self.settings = settings
        self.rng = np.random.default_rng([settings.seed, seed_index])
        self._profile = profile
        self._sampler = self.build(profile)
        self.calls = 0
        # learns this tool's response path, so that replies leave on time
        self.pacer = Pacer(max_lead_s=settings.max_pacing_lead_s)

    @property
    def profile(self) -> Profile:
        return self._profile

    def build(self, profile: Profile) -> Sampler:
        """The sampler of `profile` for this tool, or ProfileRejected. Changes nothing: a large
        profile is built off the event loop, then `activate`d on it."""
        if profile.tool != self.name:
            raise ProfileRejected(
                ["tool"], f"this is the {self.name!r} emulator, the profile says {profile.tool!r}"
            )
        try:
            return profile.model.build()
        except (OSError, ValueError) as exc:  # e.g. a trace replay whose files cannot be read
            raise ProfileRejected(["model"], str(exc)) from exc

    def activate(self, profile: Profile, sampler: Sampler) -> None:
        """Swap in a profile and the sampler `build` made of it (on the event loop: no call sees
        one without the other)."""
        self._profile, self._sampler = profile, sampler

    def parse_profile(self, data: Any) -> Profile:
        try:
            return Profile.model_validate(data)
        except ValidationError as exc:
            field, msg = first_problem(exc)
            raise ProfileRejected(field.split(".") if field else [], msg) from exc

    def exact(self, delay_s: float) -> Draw:
        """An exact replay (`delay_s` in the call): no sampled delay and no fault, but a call all
        the same (`GET /v1/emulators` counted only the sampled ones)."""
        self.calls += 1
        return Draw(delay_s)

    def draw(self, step: int | None, scale: float = 1.0) -> Draw:
        """One call's fate: the profile's delay times `scale`, capped at `max_delay_s` (the one
        bound on every sleep, whatever a profile says: a call never hangs), and its fault."""
        self.calls += 1
        raw = self._sampler.draw(self.rng, step)
        return Draw(bounded(raw.delay_s * scale, self.settings.max_delay_s), raw.fault)

    async def start(self) -> None:
        """Acquire what the emulator needs (indexes, ...); the app's lifespan calls this."""

    async def close(self) -> None:
        """Release it again."""


def bounded(seconds: float, cap: float) -> float:
    """`seconds`, at most `cap` (an overflowed or NaN draw becomes `cap` too)."""
    return seconds if seconds <= cap else cap


def request_deadline(request: Request, settings: EmulatorSettings, arrival: float) -> Deadline:
    """The caller's budget counted from the request's arrival, as its delay is: counted from
    when the handler ran, a call that waited in the loop (or behind a pipelined one) answered
    200 after its deadline, or its 504 that much late."""
    budget = settings.deadline_policy.budget_s(request.headers.get(h.DEADLINE))
    return Deadline.never() if budget is None else Deadline(arrival + budget)


def step_from_headers(request: Request) -> int | None:
    """The training step the caller (the gateway forwards it) sent in `X-Step`; raises
    HeaderError for one that is not a non-negative integer."""
    return h.count_header(h.STEP, request.headers.get(h.STEP))


DEADLINE_ENDED = {h.DEADLINE_EXPIRED: "1"}
"""On a 504 the caller's deadline ended (not an `error` fault's 504): the gateway counts it as
its timeout, and a 504 the emulator answers at its own `max_deadline_s`, before the gateway's
deadline, too."""


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f}"


@dataclass
class Outcome:
    """How a call was played out (what the headers report)."""

    scheduled_s: float
    realized_s: float  # arrival to the handler's wake-up
    fault: str | None = None
    lead_s: float = 0.0  # how much earlier than scheduled the handler woke, on purpose

    def headers(self) -> dict[str, str]:
        out = {
            h.INJECTED_DELAY: _ms(self.scheduled_s),
            h.TIMER_ERROR: _ms(self.realized_s - self.scheduled_s),
            h.PACING_LEAD: _ms(self.lead_s),
        }
        if self.fault:
            out[h.FAULT] = self.fault
        return out


def _json_bytes(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()


def _client_gone_is_499(
    play_fn: Callable[P, Awaitable[Response]],
) -> Callable[P, Awaitable[Response]]:
    """A client that left during the sleep (`sleep_or_gone`) gets a 499 nobody reads: uvicorn
    drops it."""

    @functools.wraps(play_fn)
    async def answer(*args: P.args, **kwargs: P.kwargs) -> Response:
        try:
            return await play_fn(*args, **kwargs)
        except ClientGone:
            return Response(status_code=499)

    return answer


@_client_gone_is_499
async def play(
    arrival: float,
    draw: Draw,
    deadline: Deadline,
    settings: EmulatorSettings,
    make_body: Callable[[], bytes | dict[str, Any]],
    pacer: Pacer,
    min_delay_s: float = 0.0,
    receive: Receive | None = None,
    heavy_body: bool = False,
) -> Response:
    """Turn a draw into the reply, sent at the right moment and never after the deadline;
    `receive` (the request's) stops a long sleep when the client disconnects; a `heavy_body` is
    built on a worker thread, so that every other call's timing goes on meanwhile.

    The handler wakes `pacer.early_s` before the scheduled moment (the response path it measured,
    plus the loop's intake latency before the request was stamped), so that the reply leaves at
    that moment; a delayed reply then reports its own lateness back.
    """
    fault = draw.fault
    if isinstance(fault, ThrottleFault):
        outcome = Outcome(0.0, time.monotonic() - arrival, "throttle")
        return JSONResponse(
            {
                "detail": "too many requests (injected throttle fault)",
                "retry_after_s": fault.retry_after_s,
            },
            status_code=429,
            headers={"Retry-After": str(math.ceil(fault.retry_after_s)), **outcome.headers()},
        )
    if isinstance(fault, HangFault):
        # at most max_delay_s, as every sleep: a caller's deadline of hours (the header has no
        # cap unless max_deadline_s is set) held the call that long
        end = (
            deadline.at
            if math.isfinite(deadline.at)
            else arrival + settings.hang_without_deadline_s
        )
        until = min(end, arrival + settings.max_delay_s)
        woke = await sleep_or_gone(until, receive)
        outcome = Outcome(until - arrival, woke - arrival, "hang")
        headers = outcome.headers()
        if until == deadline.at:
            headers.update(DEADLINE_ENDED)
        return JSONResponse(
            {"detail": "no answer before the deadline (injected hang fault)"},
            status_code=504,
            headers=headers,
        )
    delay = max(draw.delay_s, min_delay_s)
    target = arrival + delay
    if target > deadline.at:
        woke = await sleep_or_gone(deadline.at, receive)
        outcome = Outcome(deadline.at - arrival, woke - arrival, fault.type if fault else None)
        return JSONResponse(
            {
                "detail": f"the emulated call takes {delay:.3g} s, past the caller's deadline",
                "delay_s": delay,
            },
            status_code=504,
            headers={**outcome.headers(), **DEADLINE_ENDED},
        )
    # built while we would be waiting anyway; a big one (256 queries at topk 50 takes about a
    # second) off the loop, which it held: every other call's reply left that much late
    body = await anyio.to_thread.run_sync(make_body) if heavy_body else make_body()
    if isinstance(fault, SlowBodyFault):  # its last byte leaves later anyway: no lead
        woke = await sleep_or_gone(target, receive)
        outcome = Outcome(delay, woke - arrival, fault.type)
        duration = min(fault.duration_s, settings.max_delay_s, max(0.0, deadline.remaining()))
        return StreamingResponse(
            _trickle(_json_bytes(body), fault.chunks, duration),
            media_type="application/json",
            headers=outcome.headers(),
        )
    # the request reached its socket `intake_s` before it was stamped (the loop's own latency),
    # and the reply takes `lead_s` from the wake-up to leave: wake by both early
    due = target - min(pacer.intake_s, pacer.max_lead_s)  # when the reply should leave
    early = pacer.early_s
    wake_at = target - early
    slept = wake_at > time.monotonic()
    woke = await sleep_or_gone(wake_at, receive)
    if slept:  # a real sleep: its overshoot is the loop's latency to a ready fd
        pacer.observe_wake(woke - wake_at)
    outcome = Outcome(delay, woke - arrival, fault.type if fault else None, early)
    if isinstance(fault, ErrorFault):
        status = fault.status
        data = _json_bytes({"detail": f"{fault.message} (injected error fault)"})
    else:
        status, data = 200, _json_bytes(body)
    return PacedResponse(
        data,
        status_code=status,
        headers=outcome.headers(),
        pacer=pacer,
        target=due,
    )


async def _trickle(data: bytes, chunks: int, duration_s: float) -> AsyncIterator[bytes]:
    size = max(1, math.ceil(len(data) / chunks))
    pieces = [data[i : i + size] for i in range(0, len(data), size)]
    start = time.monotonic()
    for i, piece in enumerate(pieces):
        if i:
            await sleep_until(start + duration_s * i / max(1, len(pieces) - 1))
        yield piece
    await asyncio.sleep(0)


def bad_request(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


def unprocessable(loc: list[str | int], msg: str) -> JSONResponse:
    return JSONResponse(
        {"detail": [{"loc": ["body", *loc], "msg": msg, "type": "value_error"}]}, status_code=422
    )


async def parse_body(request: Request, model: type[M]) -> M | JSONResponse:
    """Parse a JSON body whatever its Content-Type (curl -d, requests' json=): model or a 422."""
    raw = await request.body()
    try:
        data = json.loads(raw) if raw else None
    except (ValueError, RecursionError):  # nesting too deep for `json` was a 500
        return bad_request(NOT_JSON, NOT_JSON_STATUS)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        detail = [
            {"loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]}
            for e in exc.errors(include_url=False, include_input=False)
        ]
        return JSONResponse({"detail": detail}, status_code=422)


class CallStart(NamedTuple):
    """What every emulator call reads before its own logic."""

    arrival: float  # the caller's budget starts when the request arrives
    deadline: Deadline
    header_step: int | None
    body: Any


async def begin_call(
    request: Request, settings: EmulatorSettings, model: type[BaseModel]
) -> CallStart | JSONResponse:
    """Arrival time, deadline, `X-Step` and the parsed body, or the 400/422 to answer."""
    arrival = received_at(request.scope)
    try:
        deadline = request_deadline(request, settings, arrival)
        header_step = step_from_headers(request)
    except h.HeaderError as exc:  # the deadline's and the step's
        return bad_request(str(exc))
    body = await parse_body(request, model)
    if isinstance(body, JSONResponse):
        return body
    return CallStart(arrival, deadline, header_step, body)


def json_body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI `requestBody` for routes that parse their body themselves."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": model.model_json_schema(ref_template="#/components/schemas/{model}")
                }
            },
        }
    }
