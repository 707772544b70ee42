"""`make bench`: run every package's benchmark module and collect their JSON reports.

Each benchmark is a module here (`benchmarks/<what>_bench.py`, runnable as
`python -m benchmarks.<what>_bench --out FILE`) that prints its figures as ratios against a
baseline measured in the same run; they share one harness (`benchmarks.harness`: free port,
spawn, wait ready, stop). This runner runs them one after another (they would disturb each
other's timings) and writes a summary under `bench-results/`. `make bench ARGS=sandboxd` runs
only the benchmarks whose name starts with one of the words given; `ARGS="--quick stress"` runs
the short version (a smoke test: noisy figures).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from .harness import unwind_on_sigterm

BENCHMARK_MODULES = [
    "benchmarks.sandboxd_bench",
    "benchmarks.fork_server_bench",
    "benchmarks.fork_server_budget",
    "benchmarks.run_tests_budget",
    "benchmarks.emulators_bench",
    "benchmarks.gateway_bench",
    "benchmarks.stress_bench",
    "benchmarks.ray_bench",
    "benchmarks.rollout_virtual_bench",
]


def run_one(argv: list[str]) -> int:
    """One benchmark in its own process group, so that Ctrl-C (or SIGTERM) reaches it once, from
    here, and it is waited for while it stops what it started. `subprocess.call` killed it 0.25 s
    after Ctrl-C, half-way through stopping its servers, which then ran on in their sessions."""
    child = subprocess.Popen(argv, process_group=0)
    try:
        return child.wait()
    except BaseException as exc:  # a second Ctrl-C while it stops leaves it to finish alone
        child.send_signal(signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM)
        child.wait()
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "only",
        nargs="*",
        help="run only the benchmarks whose name starts with one of these words "
        f"(of {', '.join(m.split('.')[-1] for m in BENCHMARK_MODULES)})",
    )
    parser.add_argument("--quick", action="store_true", help="each benchmark's short version")
    parser.add_argument("--out-dir", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    unwind_on_sigterm()
    only = set(args.only)
    names = [m.split(".")[-1] for m in BENCHMARK_MODULES]
    unmatched = sorted(w for w in only if not any(n.startswith(w) for n in names))
    if unmatched:  # a typo ran nothing and said `{}`, exit 0
        parser.error(f"no benchmark starts with {', '.join(unmatched)}; known: {', '.join(names)}")
    out_dir = args.out_dir
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file of that name, or no room for a folder: said in a traceback
        parser.error(f"argument --out-dir: cannot make {out_dir}: {exc.strerror}")
    summary: dict[str, object] = {}
    failed = []
    for module in BENCHMARK_MODULES:
        name = module.split(".")[-1]
        if only and not any(name.startswith(word) for word in only):
            continue
        out = out_dir / f"{module}.json"
        # an earlier run's report (and the plot beside it) would be taken for this run's when
        # this one writes none
        out.unlink(missing_ok=True)
        out.with_suffix(".png").unlink(missing_ok=True)
        print(f"== {module}", flush=True)
        started = time.monotonic()
        extra = ["--quick"] if args.quick else []
        rc = run_one([sys.executable, "-m", module, "--out", str(out), *extra])
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
