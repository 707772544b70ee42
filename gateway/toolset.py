"""The tools table at run time: builds each tool's backend and runtime, starts and stops them.

Embedded tools that mount the same application (search and reward both live in the emulators)
share one in-process app and one lifespan. Proxy tools share one aiohttp session: its connection
pool is what keeps the per-call overhead well under a millisecond.
"""

from __future__ import annotations

import logging

import aiohttp

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
        self.session: aiohttp.ClientSession | None = None
        self.skipped: dict[str, str] = {}

    def first_of_kind(self, kind: str) -> ToolRuntime | None:
        for runtime in self.tools.values():
            if runtime.config.kind == kind:
                return runtime
        return None

    async def start(self) -> None:
        table = self.settings.tool_table()
        if any(t.mode == "proxy" for t in table):
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self.settings.upstream_pool_size,
                    # below uvicorn's 5 s default: we close idle connections before the upstream
                    # does, so a request is never written into a connection it is closing
                    keepalive_timeout=self.settings.upstream_keepalive_s,
                    ttl_dns_cache=300,
                ),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.settings.upstream_connect_timeout_s
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
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
            assert self.session is not None
            return RemoteBackend(tool, self.session)
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
        if self.session is not None:
            await self.session.close()
