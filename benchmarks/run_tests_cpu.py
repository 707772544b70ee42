"""`python -m benchmarks.run_tests_cpu`: where the CPU of a python `/v1/run_tests` case goes.

No HTTP: a real `SandboxService` (process backend, fork server on, `--max-concurrency`) runs
`--requests` requests of 100 small cases each (the request of `fork_server_bench`), after one
warm-up request. Per case it reports the wall time, the CPU of the service's process
(`time.process_time`), of the case processes (each case's CPU time, as its forker reaped it)
and of the fork server's side (`/proc/<zygote>/stat`, own plus reaped children: the zygote,
the request's runner and its template, the cases) minus the cases': the runner's share. The
machine's busy time over the same span is printed too (it includes whatever else runs).
`--no-batch` runs the same requests with one runner per case, for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from sandboxd.service import SandboxService
from sandboxd.settings import SandboxSettings
from sandboxd.wire import RunTestsRequest
from toolenv_core.deadline import Deadline

from .fork_server_bench import RUN_TESTS_BODY
from .fork_server_cpu import tree_usage
from .harness import machine_busy_s


async def measure(requests: int, concurrency: int, batch: bool) -> dict[str, Any]:
    settings = SandboxSettings(max_concurrency=concurrency, fork_server_batch=batch)
    service = SandboxService(settings)
    await service.start()
    try:
        req = RunTestsRequest.model_validate(RUN_TESTS_BODY)
        await service.run_tests(req, Deadline.after(120))  # warm-up
        server = service.backend.fork_server  # type: ignore[union-attr]
        assert server is not None and server.current is not None
        bwrap = server.current.proc.pid
        zygote = int(Path(f"/proc/{bwrap}/task/{bwrap}/children").read_text().split()[0])
        z0, f0 = tree_usage(zygote)
        b0, s0, t0 = machine_busy_s(), time.process_time(), time.perf_counter()
        case_cpu = 0.0
        for _ in range(requests):
            r = await service.run_tests(req, Deadline.after(120))
            if r.passed != r.total:
                raise RuntimeError(f"run_tests failed: {r.model_dump_json()[:500]}")
            case_cpu += sum(c.run_result.cpu_time or 0.0 for c in r.cases if c.run_result)
        t1, s1, b1 = time.perf_counter(), time.process_time(), machine_busy_s()
        await asyncio.sleep(0.2)  # the last runner's exit reaches the zygote's accounts
        z1, f1 = tree_usage(zygote)
        status = service.status()
    finally:
        await service.close()
    n = requests * len(req.cases)
    ms = 1000 / n
    return {
        "batch": batch,
        "cases": n,
        "wall_ms_per_case": round((t1 - t0) * ms, 3),
        "service_cpu_ms_per_case": round((s1 - s0) * ms, 3),
        "case_cpu_ms_per_case": round(case_cpu * ms, 3),
        "runner_side_cpu_ms_per_case": round((z1 - z0 - case_cpu) * ms, 3),
        "zygote_tree_faults_per_case": round((f1 - f0) / n, 1),
        "machine_busy_ms_per_case": round((b1 - b0) * ms, 3),
        "load_avg": os.getloadavg(),
        "run_tests_batches": status.get("run_tests_batches"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--no-batch", action="store_true", help="one runner per case")
    args = parser.parse_args(argv)
    report = asyncio.run(measure(args.requests, args.max_concurrency, not args.no_batch))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
