"""What one gateway app holds at run time, declared in one place (no attributes set on the fly)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request

from .asgi import ASGIApp
from .guard import Door
from .metrics import GatewayMetrics
from .settings import GatewaySettings
from .toolset import ToolSet
from .trace import TraceWriter
from .upstream import Backend


@dataclass(eq=False)
class GatewayState:
    """Settings and the apps handed in at build time; the tools and trace writer of the lifespan."""

    settings: GatewaySettings
    metrics: GatewayMetrics
    door: Door
    mounts: Mapping[str, ASGIApp] = field(default_factory=dict)
    backends: Mapping[str, Backend] = field(default_factory=dict)
    toolset: ToolSet | None = None
    trace: TraceWriter | None = None
    ready: bool = False


def state_of(request: Request) -> GatewayState:
    return state_of_app(request.app)


def state_of_app(app: Starlette) -> GatewayState:
    """The state `create_app` put on the app it built."""
    state: GatewayState = app.state.gateway
    return state
