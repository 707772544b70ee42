"""The tools table at run time: builds each tool's backend and runtime, starts and stops them.

Embedded tools that mount the same application (search and reward both live in the emulators)
share one in-process app and one lifespan. In proxy mode each
upstream has its own keep-alive pool in the lean HTTP/1.1 client (`http1`).
"""

from __future__ import annotations

import logging

from .dispatch import ToolRuntime
from .metrics import GatewayMetrics
from .settings import GatewaySettings, ToolConfig
from .upstream import EmbeddedApp, LocalBackend, RemoteBackend, build_embedded_app

log = logging.getLogger("toolenv.gateway")


class ToolSet:
    def __init__(
        self, settings: GatewaySettings, metrics: GatewayMetrics, config_file: str | None
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.config_file = config_file
        self.tools: dict[str, ToolRuntime] = {}
        self.embedded: dict[str, EmbeddedApp] = {}
        self.skipped: dict[str, str] = {}

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

    def _backend(self, tool: ToolConfig) -> LocalBackend | RemoteBackend | None:
        if tool.mode == "proxy":
            # idle connections are dropped below uvicorn's 5 s keep-alive: we close first
            return RemoteBackend(
                tool,
                self.settings.upstream_connect_timeout_s,
                self.settings.upstream_keepalive_s,
                self.settings.upstream_pool_size,
            )
        ref = tool.app_ref
        if ref not in self.embedded:
            try:
                self.embedded[ref] = EmbeddedApp(ref, build_embedded_app(ref, self.config_file))
            except ModuleNotFoundError as exc:
                if exc.name and ref.startswith(exc.name):
                    # The package is not installed (or not written yet): serve the other tools.
                    self.skipped[tool.name] = f"{ref} is not installed"
                    log.warning(
                        "embedded tool skipped", extra={"tool": tool.name, "reason": str(exc)}
                    )
                    return None
                raise
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
