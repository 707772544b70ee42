"""The gateway's own Python per hot call, without the kernel: an A/B tool for small changes.

    python -m benchmarks.gateway_cpu [--route gateway|generic] [--calls 5000] [--profile]

A real gateway app (proxy mode, trace capture on, its lifespan run) and its lane protocol
(`gateway.lane`), driven in process: the client's request is fed to the protocol as one chunk
and the upstream's answer (a 3.4 kB `/retrieve` reply with the emulator's headers) to the
upstream connection, through stand-in transports, one call at a time. CPU per call is the
process's CPU time (the trace writer's thread included) over the calls: no socket system calls,
no other process, so a change of a microsecond shows where `gateway_bench` (about +-5% from run
to run on a shared machine) cannot see it. Seven rounds; the figures are sorted, read the median.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import tempfile
import time

import uvicorn
import uvloop
from uvicorn.server import ServerState

from gateway.app import create_app
from gateway.asgi import Lifespan
from gateway.lane import LaneProtocol
from gateway.settings import GatewaySettings
from gateway.state import state_of_app
from toolenv_core import headers as h
from toolenv_core.http1 import encode_request
from toolenv_core.http1_pool import _PoolConnection

from .gateway_bench import BODY, PATHS

_REPLY_BODY = json.dumps(
    {"result": [[{"id": str(i), "contents": "x" * 1100} for i in range(3)]]}
).encode()
REPLY = (
    b"HTTP/1.1 200 OK\r\ndate: Thu, 26 Nov 2026 01:07:26 GMT\r\nserver: uvicorn\r\n"
    b"x-toolenv-injected-delay-ms: 0.000\r\nx-toolenv-timer-error-ms: 1.114\r\n"
    b"x-toolenv-pacing-lead-ms: 0.000\r\ncontent-length: %d\r\n"
    b"content-type: application/json\r\n\r\n" % len(_REPLY_BODY)
) + _REPLY_BODY
HEADERS = {
    "Content-Type": "application/json", "User-Agent": "toolenv-stress", h.DEADLINE: "10000",
    h.TRAJECTORY: "bench-trajectory", h.STEP: "3", h.TURN: "1",
}  # fmt: skip


class _Upstream:
    """The upstream's side of a pooled connection: every request answered with `REPLY`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, conn: _PoolConnection) -> None:
        self.loop, self.conn = loop, conn

    def write(self, data: bytes) -> None:
        self.loop.call_soon(self.conn.data_received, REPLY)

    def abort(self) -> None:
        return None

    def is_closing(self) -> bool:
        return False


class _Client:
    """The client's side of the lane's connection: each answer resolves `waiter`."""

    def __init__(self) -> None:
        self.waiter: asyncio.Future[None] | None = None

    def write(self, data: bytes) -> None:
        assert self.waiter is not None
        self.waiter.set_result(None)

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name, default)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        raise RuntimeError("the lane closed the connection")

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None


async def measure(route: str, calls: int, rounds: int, profile: bool) -> list[float]:
    loop = asyncio.get_running_loop()
    path, body = PATHS[route] if route in PATHS else ("/retrieve", BODY)
    request = encode_request(
        "POST", path, "127.0.0.1:1", HEADERS, json.dumps(body, separators=(",", ":")).encode()
    )
    with tempfile.TemporaryDirectory(prefix="toolenv-gw-cpu-") as tmp:
        settings = GatewaySettings(
            log_level="warning",
            trace_path=f"{tmp}/capture.jsonl",
            tools=[{
                "name": "search", "kind": "search", "mode": "proxy",
                "upstreams": ["http://127.0.0.1:1"], "concurrency": 1024, "queue": 8192,
                "health_interval_s": 3600,
            }],
        )  # fmt: skip
        app = create_app(settings)
        state = state_of_app(app)
        lifespan = Lifespan(app, "gateway")
        await lifespan.start()
        assert state.toolset is not None
        for runtime in state.toolset.tools.values():
            for endpoint in runtime.backend.endpoints:
                assert endpoint.pool is not None
                endpoint.healthy = True
                conn = _PoolConnection(endpoint.pool, loop)
                conn.connection_made(_Upstream(loop, conn))  # type: ignore[arg-type]
                conn.idle_since = time.monotonic() + 1e9  # never stale
                endpoint.pool._idle.append(conn)
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=3600)
        config.load()
        client = _Client()
        lane = LaneProtocol(
            config=config, server_state=ServerState(), app_state={}, _loop=loop, gateway=state
        )
        lane.connection_made(client)  # type: ignore[arg-type]

        async def one() -> None:
            client.waiter = loop.create_future()
            lane.data_received(request)
            await client.waiter

        for _ in range(2000):  # warm-up
            await one()
        profiler = cProfile.Profile() if profile else None
        if profiler is not None:
            profiler.enable()
        per_call = []
        for _ in range(rounds):
            started = time.process_time()
            for _ in range(calls):
                await one()
            per_call.append((time.process_time() - started) / calls * 1e6)
            await asyncio.sleep(0.06)  # the trace writer's batch (its CPU lands in a round)
        if profiler is not None:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(40)
        await lifespan.stop()
    return sorted(per_call)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--route", choices=sorted(PATHS), default="gateway")
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="cProfile the rounds (slower)")
    args = parser.parse_args(argv)
    uvloop.install()
    figures = asyncio.run(measure(args.route, args.calls, args.rounds, args.profile))
    median = figures[len(figures) // 2]
    print(
        f"{args.route}: {median:.2f} us of CPU per call (median; rounds "
        + " ".join(f"{x:.2f}" for x in figures)
        + ")"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
