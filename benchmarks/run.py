"""`make bench`: run every package's benchmark module and collect their JSON reports.

Each benchmark is a module here (`benchmarks/<what>_bench.py`, runnable as
`python -m benchmarks.<what>_bench --out FILE`) that prints its figures as ratios against a
baseline measured in the same run. This runner runs them one after another (they would disturb
each other's timings) and writes a summary under `bench-results/`. `make bench ARGS=sandboxd`
runs only the benchmarks whose name starts with one of the words given.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

BENCHMARK_MODULES = [
    "benchmarks.sandboxd_bench",
    "benchmarks.emulators_bench",
    "benchmarks.gateway_bench",
    "benchmarks.stress_bench",
    "benchmarks.rollout_virtual_bench",
]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    only = set(argv)
    out_dir = Path("bench-results")
    out_dir.mkdir(exist_ok=True)
    summary: dict[str, object] = {}
    failed = []
    for module in BENCHMARK_MODULES:
        name = module.split(".")[-1]
        if only and not any(name.startswith(word) for word in only):
            continue
        out = out_dir / f"{module}.json"
        print(f"== {module}", flush=True)
        started = time.monotonic()
        rc = subprocess.call([sys.executable, "-m", module, "--out", str(out)])
        summary[module] = {
            "exit_code": rc,
            "seconds": round(time.monotonic() - started, 1),
            "report": str(out) if out.exists() else None,
        }
        if rc != 0:
            failed.append(module)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
