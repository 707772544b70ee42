"""HTTP route of the reward emulator: `POST /v1/emulators/reward/call`."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from toolenv_core.fields import Integer, Number
from toolenv_core.headers import COUNT_MAX

from ..base import (
    begin_call,
    json_body_schema,
    play,
    unprocessable,
)
from ..fastpath import FastRouter
from .emulator import RewardEmulator

MAX_BATCH = 100_000
MAX_RESPONSE_LENGTH = 10**9  # tokens; far past any model's context, and their mean stays a float


class RewardCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_size: Integer | None = Field(
        default=None, ge=1, le=MAX_BATCH, description="responses to verify"
    )
    response_lengths: list[Annotated[Integer, Field(le=MAX_RESPONSE_LENGTH)]] | None = Field(
        default=None, max_length=MAX_BATCH, description="token length of each response"
    )
    delay_s: Number | None = Field(
        default=None, ge=0, description="exact replay: sleep exactly this"
    )
    step: Integer | None = Field(default=None, ge=0, le=COUNT_MAX, description="training step")


def build_router(emulator: RewardEmulator) -> APIRouter:
    router = FastRouter(tags=["reward emulator"])
    settings = emulator.settings

    async def call(request: Request) -> Response:
        """Answers after the time a sandbox would take to verify the batch (no code runs)."""
        start = await begin_call(request, settings, RewardCall)
        if isinstance(start, Response):
            return start
        arrival, deadline, header_step, body = start
        lengths = body.response_lengths
        if lengths is not None and (not lengths or any(n < 0 for n in lengths)):
            return unprocessable(
                ["response_lengths"], "give one non-negative token count per response"
            )
        if lengths is not None and body.batch_size is not None and len(lengths) != body.batch_size:
            return unprocessable(
                ["response_lengths"],
                f"has {len(lengths)} entries but batch_size is {body.batch_size}",
            )
        batch = body.batch_size or (
            len(lengths)
            if lengths
            else max(1, round(emulator.profile.reference.get("batch_size", 64)))
        )
        if body.delay_s is not None and body.delay_s > settings.max_delay_s:
            return unprocessable(["delay_s"], f"at most {settings.max_delay_s} s")
        step = body.step if body.step is not None else header_step
        mean_length = sum(lengths) / len(lengths) if lengths else None
        scale = emulator.scale(batch, mean_length)
        draw = (
            emulator.exact(body.delay_s) if body.delay_s is not None else emulator.draw(step, scale)
        )

        def reply() -> bytes:
            return json.dumps(
                {
                    "tool": "reward",
                    "batch_size": batch,
                    "scale": scale,
                    "reward_time_s": draw.delay_s,
                },
                separators=(",", ":"),
            ).encode()

        return await play(
            arrival, draw, deadline, settings, reply, emulator.pacer, receive=request.receive
        )

    router.add_fast_route(
        "POST",
        "/v1/emulators/reward/call",
        call,
        summary="Emulated code verification of a batch",
        openapi_extra=json_body_schema(RewardCall),
    )
    return router
