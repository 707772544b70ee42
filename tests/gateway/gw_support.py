"""Gateway test support: real loopback upstream processes and a real gateway server.

The gateway runs under uvicorn in a thread of the test process (a real socket on loopback, and
its app object at hand to inspect); upstreams are separate processes so a test can kill one.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from gateway.lane import lane_protocol
from gateway.settings import GatewaySettings, ToolConfig
from gateway.state import state_of_app
from toolenv.wiring import build_gateway
from toolenv_core.config import read_config_file
from toolenv_core.net import free_port

HERE = Path(__file__).resolve().parent


class Upstream:
    def __init__(
        self, name: str, unhealthy: bool = False, plain: bool = False, keep_alive_s: float = 5.0
    ) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            sys.executable,
            str(HERE / "gw_upstream.py"),
            "--port",
            str(self.port),
            "--name",
            name,
        ]
        if unhealthy:
            argv.append("--unhealthy")
        if plain:
            argv.append("--plain")
        argv += ["--keep-alive-s", str(keep_alive_s)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"upstream {name} exited with {self.proc.returncode}")
            try:
                httpx.get(self.url + "/stats", timeout=0.5)
                return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError(f"upstream {name} did not start")

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/stats", timeout=5).json()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


class GatewayServer:
    """A real gateway on a loopback port, served by uvicorn in a thread, wired as `toolenv serve`
    wires it (its embedded tools' apps built from the config file's sections)."""

    def __init__(
        self, settings: GatewaySettings, config_file: str | None = None, keep_alive_s: float = 5.0
    ) -> None:
        self.settings = settings
        sections = read_config_file(config_file) if config_file else {}
        self.app = build_gateway(settings, sections)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # served as `toolenv serve` serves it: with the lane for the hot routes (gateway.lane)
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False,
            lifespan="on", loop="asyncio", timeout_graceful_shutdown=2,
            http=lane_protocol(state_of_app(self.app)), timeout_keep_alive=keep_alive_s,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    @property
    def toolset(self):
        return self.app.state.gateway.toolset

    def metrics_text(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5, headers=self.auth).text

    auth: dict[str, str] = {}  # noqa: RUF012

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def proxy_tool(name: str, *urls: str, **overrides: Any) -> ToolConfig:
    fields = {"name": name, "kind": "http", "mode": "proxy", "upstreams": list(urls),
              "health_interval_s": 0.3, **overrides}  # fmt: skip
    return ToolConfig(**fields)


def metric_value(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition (0 when absent), labels in any order."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        metric, _, rest = series.partition("{")
        if metric != name:
            continue
        found = dict(pair.split("=", 1) for pair in rest.rstrip("}").split(",") if "=" in pair)
        if {k: v.strip('"') for k, v in found.items()} == labels:
            return float(value)
    return 0.0


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc: no extra dependency)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def describe(pids: set[int]) -> dict[int, str]:
    out = {}
    for pid in pids:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            out[pid] = "<gone>"
    return out


def call(gw: GatewayServer, tool: str, arguments: dict, **kw: Any) -> httpx.Response:
    """The generic call `POST /v1/tools/{tool}/call` with these arguments."""
    return httpx.post(
        f"{gw.url}/v1/tools/{tool}/call", json={"arguments": arguments}, timeout=30, **kw
    )
