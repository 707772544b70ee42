"""Bench: one full Search-R1 step in virtual time (2,048 trajectories, all turns, recorded latencies).

    python -m benchmarks.rollout_virtual_bench --out FILE [--trace FILE] [--policies sync,async] [--quick]

Each policy runs `toolenv rollout run --engine sim --clock virtual --exact` in its own process
(so the peak RSS is that run's alone). Targets: <= 10 s of wall time per step, i.e. >= 40x faster
than the time it models, and < 1 GB of memory. The baseline measured in the same run is reading
and planning the same step without running it (the part no simulator can skip), so the ratio
says how much the simulation itself costs on top.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from toolenv_core.polytrace import TraceFormatError

from .harness import polytrace_file, report_path, write_report

DEFAULT_TRACE = "search_r1/multiturn_workload_step_0.jsonl"


def _child(cmd: list[str]) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (KB) of the child alone, and its stdout. Its stderr is kept aside
    and quoted when it fails (a `--policies` typo said only "exited 2")."""
    started = time.perf_counter()
    with tempfile.TemporaryFile() as stderr:
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
        assert child.stdout is not None
        stdout = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            stderr.seek(0)
            said = stderr.read().decode(errors="replace").strip()[-2000:]
            raise RuntimeError(f"{' '.join(cmd)} exited {child.returncode}: {said}")
    return wall, usage.ru_maxrss, stdout


def run_policy(trace: Path, policy: str, out: Path, batch: int) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "sim", "--clock", "virtual",
        "--exact", "--trace", str(trace), "--batch", str(batch), "--policy", policy,
        "--out", str(out), "--json", "--no-plots",
    ]  # fmt: skip
    wall, peak_kb, stdout = _child(cmd)
    report = json.loads(stdout)
    modelled = report["summary"]["total_makespan_s"]
    return {
        "policy": policy,
        "trajectories": report["summary"]["completed"],
        "modelled_makespan_s": modelled,
        "wall_s": round(wall, 2),
        "in_process_s": report["wall"]["elapsed_s"],
        "speed_over_modelled_time": round(modelled / wall, 1),
        "peak_rss_mb": round(peak_kb / 1024, 1),
    }


def baseline(trace: Path) -> tuple[float, int]:
    """Reading the trace and building the plans only, in a fresh process: its seconds, and the
    step's trajectories (2,048 in a Search-R1 step; another trace's own count is the batch: a
    trace of another size failed an `assert n == 2048` in a traceback)."""
    code = (
        "from rollout_client.workloads.replay import replay_plans;"
        f"print(sum(1 for _ in replay_plans([{str(trace)!r}], exact=True)))"
    )
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return time.perf_counter() - started, int(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=report_path, default=Path("bench-results/rollout_virtual.json")
    )
    parser.add_argument(
        "--trace",
        type=Path,
        help=f"a multiturn PolyTrace step (default: {DEFAULT_TRACE}, from the trace cache "
        "`toolenv traces fetch search_r1` fills, or $TOOLENV_POLYTRACE_DIR)",
    )
    parser.add_argument("--policies", default="sync,async,async+timeout+overlap")
    parser.add_argument("--quick", action="store_true", help="the async policy only")
    args = parser.parse_args()
    if args.quick:
        args.policies = "async"
    try:
        args.trace = polytrace_file(args.trace, DEFAULT_TRACE)
    except TraceFormatError as exc:
        parser.error(str(exc))
    if not args.trace.is_file():
        parser.error(f"--trace {args.trace}: a file of one step is needed, not a directory")
    parse_s, trajectories = baseline(args.trace)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for policy in args.policies.split(","):
            out = Path(tmp) / policy.replace("+", "_")
            row = run_policy(args.trace, policy, out, trajectories)
            row["wall_over_parse_baseline"] = round(row["wall_s"] / parse_s, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    worst = max(r["wall_s"] for r in rows)
    result = {
        "bench": "rollout_virtual",
        "trace": str(args.trace),
        "cpus": os.cpu_count(),
        "parse_baseline_s": round(parse_s, 2),
        "runs": rows,
        "targets": {
            "wall_s_per_step_max": 10.0,
            "peak_rss_mb_max": 1024,
            "met": worst <= 10.0 and max(r["peak_rss_mb"] for r in rows) < 1024,
        },
    }
    write_report(result, args.out)
    print(json.dumps(result["targets"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
