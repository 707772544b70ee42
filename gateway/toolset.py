"""The tools table at run time: builds each tool's backend and runtime, starts and stops them.

Embedded tools run the in-process apps handed to the gateway (`mounts`, built by `toolenv serve`):
tools that mount the same application (search and reward both live in the emulators) share one
app and one lifespan. A custom tool's `app: "module:factory"` is the one documented extension
point: its factory is imported and called with no arguments. In proxy mode each upstream has its
own keep-alive pool in the lean HTTP/1.1 client (`toolenv_core.http1_pool`).
"""

from __future__ import annotations

import logging
import pkgutil
from collections.abc import Mapping

from .asgi import ASGIApp
from .dispatch import ToolRuntime
from .metrics import GatewayMetrics
from .settings import GatewaySettings, ToolConfig
from .upstream import Backend, EmbeddedApp, LocalBackend, RemoteBackend

log = logging.getLogger("toolenv.gateway")


class ToolSet:
    def __init__(
        self,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        mounts: Mapping[str, ASGIApp],
        backends: Mapping[str, Backend] | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.mounts = mounts
        self.given = dict(backends or {})  # tool name -> a backend the wiring built (Ray)
        self.tools: dict[str, ToolRuntime] = {}
        self.embedded: dict[str, EmbeddedApp] = {}
        self.skipped: dict[str, str] = {}
        # hot-route path -> its resolved call (`passthrough.hot_call`; only paths that resolve)
        self.hot_calls: dict[str, object] = {}

    def first_of_kind(self, kind: str) -> ToolRuntime | None:
        for runtime in self.tools.values():
            if runtime.config.kind == kind:
                return runtime
        return None

    async def start(self) -> None:
        table = self.settings.tool_table()
        for tool in table:
            backend = self._backend(tool)
            if backend is not None:
                self.tools[tool.name] = ToolRuntime(tool, backend, self.metrics)
        for app in self.embedded.values():
            await app.start()
        for runtime in self.tools.values():
            await runtime.backend.start()

    def _backend(self, tool: ToolConfig) -> Backend | None:
        if tool.name in self.given:
            return self.given[tool.name]
        if tool.mode == "proxy":
            # idle connections are dropped below uvicorn's 5 s keep-alive: we close first
            return RemoteBackend(
                tool,
                self.settings.upstream_connect_timeout_s,
                self.settings.upstream_keepalive_s,
                self.settings.upstream_pool_size,
                self.settings.upstream_max_body_bytes,
            )
        ref = tool.mount
        if ref not in self.embedded:
            app = self.mounts.get(ref)
            if app is None and tool.app is not None:
                try:
                    app = custom_app(tool.app)
                except Exception as exc:
                    # As an app whose start-up failed: the tool answers 503 naming why and the
                    # others serve (it was a 40-line traceback that stopped the gateway, exit 3).
                    self.embedded[ref] = EmbeddedApp.failed(ref, f"{type(exc).__name__}: {exc}")
                    return LocalBackend(tool, self.embedded[ref])
            if app is None:
                # Built-in apps come from the wiring (`toolenv serve`): serve the other tools.
                self.skipped[tool.name] = (
                    f"no in-process {ref!r} app was handed to the gateway "
                    "(`toolenv serve` builds it; or run the tool in proxy mode)"
                )
                log.warning("embedded tool skipped", extra={"tool": tool.name, "mount": ref})
                return None
            self.embedded[ref] = EmbeddedApp(ref, app)
        return LocalBackend(tool, self.embedded[ref])

    def not_ready(self) -> list[str]:
        return [msg for rt in self.tools.values() if (msg := rt.backend.not_ready())]

    async def close(self) -> None:
        for runtime in self.tools.values():
            await runtime.close()
            await runtime.backend.close()
        for app in self.embedded.values():
            try:
                await app.stop()
            except Exception as exc:
                log.error(
                    "embedded app shut-down failed", extra={"app": app.ref, "error": str(exc)}
                )


def check_custom_apps(
    settings: GatewaySettings, mounts: Mapping[str, ASGIApp], backends: Mapping[str, Backend]
) -> None:
    """Import every embedded custom tool's `app` factory now, so a reference that does not load
    is one settings error when the app is built, not a traceback from inside the server's
    start-up. (The factory itself is still called at start-up, where its app's lifespan runs.)"""
    for tool in settings.tool_table():
        ref = tool.app
        if tool.mode != "embedded" or ref is None or ref in mounts or tool.name in backends:
            continue
        try:
            pkgutil.resolve_name(ref)
        except Exception as exc:
            raise ValueError(
                f"invalid gateway settings: tool {tool.name!r}: app {ref!r} cannot be loaded: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


def custom_app(ref: str) -> ASGIApp:
    """A custom tool's ASGI app from its `app: "module:factory"` (the user extension point)."""
    factory = pkgutil.resolve_name(ref)
    app: ASGIApp = factory()
    if not callable(app):  # it served, readyz said ready, and every call was a 502 TypeError
        raise TypeError(
            f"tool app {ref!r} returned {type(app).__name__}, not an ASGI app: the factory must "
            "return the application (e.g. a FastAPI instance)"
        )
    return app
