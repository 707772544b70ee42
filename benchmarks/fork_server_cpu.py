"""`python -m benchmarks.fork_server_cpu`: what one fork-server run costs the zygote's side.

No HTTP and no service: this drives a real zygote (its own bwrap, the argv sandboxd starts it
with) through its control socket, as `sandboxd.process.forkserver.Zygote` does, and runs
`print(1)` `--runs` times at `--concurrency`, one prepared runner per run. It reports the CPU
time and the minor page faults of the zygote and everything it started (`/proc/<zygote>/stat`:
own plus reaped children), per run, so a change to the runner's set-up can be judged without
the service's and the load generator's noise. The kernel's asynchronous network-namespace
teardown (kworker threads) is not in these figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from sandboxd.process.forkserver import Runner, Zygote
from sandboxd.process.forkserver_argv import needs_user_namespace, zygote_argv

PYTHON = "/usr/bin/python3"
RLIMITS = [(resource.RLIMIT_CPU, 10), (resource.RLIMIT_NOFILE, 256)]


def tree_usage(pid: int) -> tuple[float, int]:
    """CPU seconds and minor faults of `pid` plus its reaped children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK"), int(fields[7]) + int(fields[8])  # minflt cminflt


class Driver:
    """One zygote, `concurrency` runners kept prepared, runs of `print(1)` on them."""

    def __init__(self, root: Path, concurrency: int) -> None:
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SystemExit("bwrap not found")
        self.root = root
        self.zygote = Zygote.start(zygote_argv(bwrap, root, PYTHON, needs_user_namespace()))
        self.keys = iter(range(1, 1 << 40))
        self.null = os.open(os.devnull, os.O_RDONLY)
        self.ready: list[Runner] = [self._spawn() for _ in range(concurrency)]

    def _spawn(self) -> Runner:
        runner = self.zygote.spawn(next(self.keys), None)
        self.zygote.idle.pop(runner.key)
        return runner

    def zygote_pid(self) -> int:
        """The zygote itself (bwrap's child)."""
        pid = self.zygote.proc.pid
        return int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])

    async def run_one(self, i: int) -> float:
        """One `print(1)` run: seconds from the request to its status."""
        workdir = self.root / f"run-{i}"
        workdir.mkdir()
        (workdir / "main.py").write_text("print(1)\n")
        workdir.chmod(0o777)
        runner = self.ready.pop()
        out_r, out_w = os.pipe()
        started = time.perf_counter()
        request = {"workdir": workdir.name, "rlimits": RLIMITS}
        try:
            run = await self.zygote.fork(runner, i, request, [self.null, out_w, out_w])
        finally:
            os.close(out_w)
        self.ready.append(self._spawn())  # as the service does: after the request went out
        ended = await run.ended
        elapsed = time.perf_counter() - started
        output = os.read(out_r, 4096)
        os.close(out_r)
        shutil.rmtree(workdir)
        if not isinstance(ended, tuple) or ended[0] != 0 or output != b"1\n":
            raise RuntimeError(f"run {i} failed: {ended!r} {output!r}")
        return elapsed

    def close(self) -> None:
        self.zygote.close()
        os.close(self.null)


async def measure(runs: int, concurrency: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="toolenv-forkcpu-", dir="/dev/shm"))
    root.chmod(0o755)
    driver = Driver(root, concurrency)
    try:
        for i in range(20):  # warm-up (and the zygote is up)
            await driver.run_one(-1 - i)
        zpid = driver.zygote_pid()
        cpu0, faults0 = tree_usage(zpid)
        own0 = os.times()
        pending = iter(range(runs))
        latencies: list[float] = []

        async def worker() -> None:
            for i in pending:
                latencies.append(await driver.run_one(i))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        own1 = os.times()
        await asyncio.sleep(0.3)  # the last runners reaped
        cpu1, faults1 = tree_usage(zpid)
    finally:
        driver.close()
        shutil.rmtree(root, ignore_errors=True)
    driver_cpu = (own1.user + own1.system) - (own0.user + own0.system)
    return {
        "runs": runs,
        "concurrency": concurrency,
        "runs_per_s": round(runs / elapsed, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 2),
        "zygote_cpu_ms_per_run": round((cpu1 - cpu0) / runs * 1000, 2),
        "minor_faults_per_run": round((faults1 - faults0) / runs),
        "driver_cpu_ms_per_run": round(driver_cpu / runs * 1000, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(measure(args.runs, args.concurrency))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
