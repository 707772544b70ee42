"""`python -m benchmarks.service_cpu`: the sandbox service's own CPU per python `print(1)` run.

No HTTP server and no load generator process: a real `SandboxService` (process backend, fork
server on, `--max-concurrency`) runs `--runs` `/run_code` requests of `print(1)` in process,
one at a time and then `--concurrency` at a time, through the router (`--http`: an in-process
ASGI call, no client library: FastAPI's and the wire models' work is in, uvicorn's HTTP
parsing is not) or straight through `SandboxService.run_code`, on uvloop as `toolenv sandboxd serve` runs (`--loop asyncio`: the
standard loop). Per run it reports the service process's CPU (`time.process_time`:
the event loop and its threads; the zygote's tree is another process and is not in it) and the
wall time. `--profile FILE` writes a cProfile of the measured runs. `--served`: a real
`toolenv sandboxd serve` (uvicorn) driven over HTTP by the `stress` load generator in this
process; the server process's own CPU (`/proc/<pid>/stat`: its threads, not the zygote's tree)
per run.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import time
from typing import Any

import uvloop
from fastapi import FastAPI

from sandboxd.api import build_router
from sandboxd.service import SandboxService
from sandboxd.settings import SandboxSettings
from sandboxd.wire import RunCodeRequest, RunStatus
from toolenv_core.deadline import Deadline

from .fork_server_bench import start_server
from .sandboxd_bench import closed_loop

BODY = {"code": "print(1)\n", "language": "python"}
RAW_BODY = json.dumps(BODY).encode()
SCOPE: dict[str, Any] = {
    "type": "http",
    "asgi": {"version": "3.0"},
    "http_version": "1.1",
    "method": "POST",
    "scheme": "http",
    "path": "/run_code",
    "raw_path": b"/run_code",
    "query_string": b"",
    "root_path": "",
    "headers": [
        (b"host", b"sandboxd"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(RAW_BODY)).encode()),
    ],
    "client": ("127.0.0.1", 1),
    "server": ("127.0.0.1", 80),
}


class Driver:
    """One run of `print(1)`, through the router (`http`) or the service's own method."""

    def __init__(self, service: SandboxService, http: bool) -> None:
        self.service = service
        self.app: FastAPI | None = None
        if http:
            self.app = FastAPI()
            self.app.include_router(build_router(service))

    async def _asgi(self) -> tuple[int, bytes]:
        """One POST through the app, as a server would hand it over."""
        assert self.app is not None
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": RAW_BODY, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await self.app(dict(SCOPE), receive, send)
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        return status, b"".join(
            m.get("body", b"") for m in sent if m["type"] == "http.response.body"
        )

    async def one(self) -> None:
        if self.app is not None:
            status, raw = await self._asgi()
            body = json.loads(raw)
            ok = status == 200 and body["status"] == RunStatus.SUCCESS
        else:
            req = RunCodeRequest.model_validate(BODY)
            resp = await self.service.run_code(req, Deadline.after(30))
            ok = resp.status == RunStatus.SUCCESS and resp.run_result is not None
            body = resp.model_dump()
        if not ok:
            raise RuntimeError(f"run failed: {json.dumps(body)[:500]}")

    async def batch(self, runs: int, concurrency: int) -> tuple[float, float]:
        """CPU and wall seconds of `runs` runs, `concurrency` at a time."""
        todo = iter(range(runs))

        async def worker() -> None:
            for _ in todo:
                await self.one()

        c0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.process_time() - c0, time.perf_counter() - t0


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    service = SandboxService(SandboxSettings(max_concurrency=args.max_concurrency))
    await service.start()
    # CPU time of this thread, not wall time: a syscall that wakes the zygote is not charged
    # for the time the zygote then holds the CPU
    profiler = cProfile.Profile(time.thread_time) if args.profile else None
    try:
        driver = Driver(service, args.http)
        await driver.batch(50, 4)  # warm-up
        report: dict[str, Any] = {"http": args.http, "runs": args.runs}
        for name, conc in (("c1", 1), (f"c{args.concurrency}", args.concurrency)):
            if profiler is not None:
                profiler.enable()
            cpu, wall = await driver.batch(args.runs, conc)
            if profiler is not None:
                profiler.disable()
            report[name] = {
                "service_cpu_ms_per_run": round(cpu * 1000 / args.runs, 3),
                "wall_ms_per_run": round(wall * 1000 / args.runs, 3),
            }
        report["load_avg"] = os.getloadavg()
        report["python_mode"] = service.status().get("python_mode")
    finally:
        await service.close()
    if profiler is not None:
        profiler.dump_stats(args.profile)
    return report


async def measure_served(args: argparse.Namespace) -> dict[str, Any]:
    server = start_server(True, args.max_concurrency)
    try:
        await closed_loop(server.url, 4, 50)  # warm-up
        report: dict[str, Any] = {"served": True, "runs": args.runs}
        for name, conc in (("c1", 1), (f"c{args.concurrency}", args.concurrency)):
            c0, t0 = server.cpu_s(), time.perf_counter()
            result = await closed_loop(server.url, conc, args.runs)
            cpu, wall = server.cpu_s() - c0, time.perf_counter() - t0
            report[name] = {
                "server_cpu_ms_per_run": round(cpu * 1000 / args.runs, 3),
                "wall_ms_per_run": round(wall * 1000 / args.runs, 3),
                "failed": result.get("failed"),
            }
        report["load_avg"] = os.getloadavg()
    finally:
        server.stop()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--http", action="store_true", help="through the router (ASGI)")
    parser.add_argument("--profile", help="write a cProfile of the measured runs here")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--served", action="store_true", help="a real server, over HTTP")
    args = parser.parse_args(argv)
    run = uvloop.run if args.loop == "uvloop" else asyncio.run
    report = run(measure_served(args) if args.served else measure(args))
    print(json.dumps({**report, "loop": args.loop}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
