"""`make bench`: run every package's benchmark module and collect their JSON reports.

Each package owns its benchmark (`<package>/bench.py`, runnable as `python -m <package>.bench
--out FILE`), which prints its figures as ratios against a baseline measured in the same run.
This runner only finds them, runs them one after another (they would disturb each other's
timings), and writes a summary under `bench-results/`.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

BENCHMARK_MODULES = [
    "sandboxd.bench",
    "emulators.bench",
    "gateway.bench",
    "rollout_client.stress.bench",
]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    only = set(argv)
    out_dir = Path("bench-results")
    out_dir.mkdir(exist_ok=True)
    summary: dict[str, object] = {}
    failed = []
    for module in BENCHMARK_MODULES:
        package = module.split(".")[0]
        if only and package not in only:
            continue
        if importlib.util.find_spec(module) is None:
            print(f"== {module}: not present, skipped", flush=True)
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
