"""Faults: what can go wrong with a call besides being slow, as data a `faulty` model draws.

A fault is chosen per call (one uniform draw against the cumulative rates), after the latency.
The service decides what each one means on the wire: `error` answers `status` after the delay,
`hang` answers nothing until the caller's deadline (then 504), `throttle` answers 429 at once with
`Retry-After`, `slow_body` sends the body in chunks spread over `duration_s` after the delay.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from toolenv_core.fields import Integer, Number


class _Fault(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    rate: Number = Field(ge=0.0, le=1.0, description="probability per call")


class ErrorFault(_Fault):
    type: Literal["error"] = "error"
    status: Integer = Field(default=503, ge=400, le=599, description="HTTP status answered")
    message: str = "injected error"


class HangFault(_Fault):
    type: Literal["hang"] = "hang"


class ThrottleFault(_Fault):
    type: Literal["throttle"] = "throttle"
    # at most an hour: 1e300 was accepted and sent as a 300-digit Retry-After header
    retry_after_s: Number = Field(
        default=1.0, ge=0.0, le=3600.0, description="sent as Retry-After (seconds, at most 3600)"
    )


class SlowBodyFault(_Fault):
    type: Literal["slow_body"] = "slow_body"
    duration_s: Number = Field(
        default=1.0, gt=0.0, description="time over which the body trickles out"
    )
    chunks: Integer = Field(default=10, ge=2, le=1000)


Fault = Annotated[
    ErrorFault | HangFault | ThrottleFault | SlowBodyFault, Field(discriminator="type")
]
