"""Sandbox runs through the Ray gateway (1 and 2 nodes) against the local gateway, same run.

    python -m benchmarks.ray_bench --out bench-results/benchmarks.ray_bench.json [--seconds 8] [--one-node] [--quick]

Every node is a network namespace on this machine (`toolenv.ray.netns`), so all set-ups share
the same cores: "2 nodes" is the same total CPU split over two raylets, and the figure that
matters is the ratio to the local gateway measured in the same run. Load (the project's own
`stress`, closed loop) runs inside the head's namespace against each gateway's loopback:
`print(1)` sequentially (per-call latency: the p50 difference is what Ray adds) and with 16
callers (runs/s). Rounds alternate local and Ray so drift hits both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.table import Table

from stress import LoadSpec, run_load
from toolenv.ray.netns import NetnsCluster
from toolenv_core.plotting import pyplot

from .harness import positive_float, report_path, unwind_on_sigterm, write_report
from .ray_cpu import cpu_by_group, threads_by_group

CODE = {"code": "print(1)", "language": "python"}
SEARCH = {"queries": ["who wrote hamlet"], "topk": 3}  # a zero-delay emulator: the path's own cost
PATHS = {"sandbox": ("/run_code", CODE), "search": ("/retrieve", SEARCH)}
LOCAL_PORT, RAY_PORT = 8080, 8000
CALLERS = 16


def _sandbox(config: dict[str, Any]) -> dict[str, Any]:
    sandbox = {"warm_sandboxes": 8, "max_concurrency": CALLERS}  # Ray: max_ongoing_requests
    emulators = {"search_profile": {"tool": "search", "model": {"kind": "constant", "value_s": 0}}}
    return {**config, "sandbox": sandbox, "emulators": emulators,
            "gateway": {"log_level": "warning"}}  # fmt: skip


def _ray_config(nodes: int) -> dict[str, Any]:
    # Room for every caller in each replica, as the local gateway has (16 programs at once):
    # when every replica is full, Serve's router probes their queue lengths with a Ray actor
    # call per request (about 1 ms of CPU per call here, docs/ray.md).
    per_replica = CALLERS
    return _sandbox(
        {
            "ray": {
                "http_port": RAY_PORT,
                "gateway": {"num_cpus": 0, "resources": {"node_head": 0.01}},
                "sandbox": {
                    "num_cpus": 1,
                    "max_ongoing_requests": per_replica,
                    "min_replicas": 2,
                    "max_replicas": 2,
                },
                "emulators": {"num_cpus": 0},
            }
        }
    )


# ------------------------------------------------------------------ inside the namespace


def load(url: str, callers: int, seconds: float, tool: str = "sandbox") -> dict[str, Any]:
    """One closed-loop run (waits for /readyz first); runs/s and latency of the answered calls."""
    end = time.monotonic() + 180
    while True:
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > end:
            raise SystemExit(f"{url} never became ready")
        time.sleep(0.5)
    path, body = PATHS[tool]
    spec = LoadSpec(url=url + path, body=body, arrival="closed", concurrency=callers,
                    duration_s=seconds, timeout_s=30)  # fmt: skip
    result = run_load(spec)
    ok = result.latencies_ms("ok", corrected=False)
    return {
        "ok": int(ok.size),
        "sent": int(result.n),
        "runs_per_s": ok.size / result.wall_s,
        "p50_ms": float(statistics.median(ok)) if ok.size else None,
        "p99_ms": float(sorted(ok)[int(0.99 * (ok.size - 1))]) if ok.size else None,
    }


# ------------------------------------------------------------------ orchestration


def _in_ns(cluster: NetnsCluster, argv: list[str], timeout: float = 600) -> str:
    done = subprocess.run(cluster.exec_argv(argv), env=cluster.env(), capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    if done.returncode != 0:
        said = [ln for ln in done.stderr.splitlines() if "Warning" not in ln and "Field(" not in ln]
        raise RuntimeError(f"{argv[:4]} failed: " + "\n".join(said)[-4000:])
    return done.stdout


def _measure(
    cluster: NetnsCluster, port: int, callers: int, seconds: float, tool: str = "sandbox"
) -> dict[str, Any]:
    """One load run, with the CPU each kind of process spent per answered call, and the CPU
    and context switches of each kind of thread of the gateways and replicas."""
    argv = [sys.executable, "-m", "benchmarks.ray_bench", "load", f"http://127.0.0.1:{port}",
            "--callers", str(callers), "--seconds", str(seconds), "--tool", tool]  # fmt: skip
    before, threads_before = cpu_by_group(cluster), threads_by_group(cluster)
    result = json.loads(_in_ns(cluster, argv).strip().splitlines()[-1])
    after, threads_after = cpu_by_group(cluster), threads_by_group(cluster)
    calls = max(result["ok"], 1)
    result["cpu_ms_per_call"] = {
        group: round((after[group] - before.get(group, 0.0)) * 1000 / calls, 3) for group in after
    }
    per_call: dict[str, dict[str, list[float]]] = {}
    for (group, kind), (cpu, switches) in threads_after.items():
        cpu0, switches0 = threads_before.get((group, kind), (0.0, 0))
        values = [round((cpu - cpu0) * 1000 / calls, 3), round((switches - switches0) / calls, 2)]
        if any(values):
            per_call.setdefault(group, {})[kind] = values
    result["threads_per_call"] = per_call  # group -> thread kind -> [CPU ms, switches]
    return result


def _deploy(cluster: NetnsCluster, config: dict[str, Any], workdir: Path) -> None:
    path = workdir / "ray.yaml"
    path.write_text(yaml.safe_dump(config))
    _in_ns(cluster, [sys.executable, "-m", "toolenv", "serve", "--ray", cluster.address,
                     "-c", str(path), "--detach"])  # fmt: skip


def _local_gateway(cluster: NetnsCluster, workdir: Path) -> subprocess.Popen[bytes]:
    path = workdir / "local.yaml"
    path.write_text(yaml.safe_dump(_sandbox({})))
    argv = [sys.executable, "-m", "toolenv", "serve", "--port", str(LOCAL_PORT), "-c", str(path)]
    return subprocess.Popen(cluster.exec_argv(argv), env=cluster.env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


def _rounds(cluster: NetnsCluster, rounds: int, seconds: float, local: bool) -> dict[str, Any]:
    """Alternate the Ray gateway and (when `local`) the local one, sequential then 16 callers."""
    out: dict[str, list[dict[str, Any]]] = {"ray_seq": [], "ray_conc": [], "ray_search": []}
    if local:
        out |= {"local_seq": [], "local_conc": [], "local_search": []}
    for _ in range(rounds):
        for name, port in (("local", LOCAL_PORT), ("ray", RAY_PORT)):
            if name == "local" and not local:
                continue
            out[f"{name}_seq"].append(_measure(cluster, port, 1, seconds / 2))
            out[f"{name}_conc"].append(_measure(cluster, port, CALLERS, seconds))
            out[f"{name}_search"].append(_measure(cluster, port, CALLERS, seconds / 2, "search"))
    return {k: _median(v) for k, v in out.items()}


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("runs_per_s", "p50_ms", "p99_ms")
    out = {k: round(statistics.median(r[k] for r in runs), 2) for k in keys}
    groups = {g for r in runs for g in r["cpu_ms_per_call"]}
    out["cpu_ms_per_call"] = {
        g: round(statistics.median(r["cpu_ms_per_call"].get(g, 0.0) for r in runs), 2)
        for g in sorted(groups)
    }
    kinds = {(g, k) for r in runs for g, ks in r["threads_per_call"].items() for k in ks}
    threads: dict[str, dict[str, list[float]]] = {}
    for g, k in sorted(kinds):
        values = [r["threads_per_call"].get(g, {}).get(k, [0.0, 0.0]) for r in runs]
        threads.setdefault(g, {})[k] = [
            round(statistics.median(v[0] for v in values), 3),
            round(statistics.median(v[1] for v in values), 2),
        ]
    out["threads_per_call"] = threads
    return out | {"runs": runs}


def _switches(measured: dict[str, Any], group: str) -> float:
    """Context switches per call of one group's threads."""
    return round(sum(v[1] for v in measured["threads_per_call"].get(group, {}).values()), 1)


def _path_cpu(measured: dict[str, Any], local: bool) -> float:
    """CPU per call of one path: the local gateway process, or every Ray process."""
    cpu = measured["cpu_ms_per_call"]
    if local:
        return round(cpu.get("local_gateway", 0.0), 2)
    return round(sum(v for g, v in cpu.items() if g != "local_gateway"), 2)


def bench(seconds: float, rounds: int, console: Console, two_nodes: bool = True) -> dict[str, Any]:
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="toolenv-ray-bench-") as tmp:
        workdir = Path(tmp)
        with console.status("one node: cluster, local gateway and the Ray deployment"):
            cluster = NetnsCluster(workers=0, num_cpus=2).start()
        try:
            local = _local_gateway(cluster, workdir)
            try:
                with console.status("one node: deploying on Ray"):
                    _deploy(cluster, _ray_config(1), workdir)
                _measure(cluster, LOCAL_PORT, 4, 1)  # warm both paths
                _measure(cluster, RAY_PORT, 4, 1)
                with console.status(f"one node: {rounds} rounds, local and Ray alternating"):
                    report["one_node"] = _rounds(cluster, rounds, seconds, local=True)
            finally:
                local.terminate()
                local.wait(30)
        finally:
            cluster.stop()
        if two_nodes:
            report["two_nodes"] = _two_nodes(rounds, seconds, workdir, console)
    report["summary"] = _summary(report)
    return report


def _two_nodes(rounds: int, seconds: float, workdir: Path, console: Console) -> dict[str, Any]:
    with console.status("two nodes: cluster and the Ray deployment"):
        cluster = NetnsCluster(workers=1, num_cpus=1).start()
    try:
        _deploy(cluster, _ray_config(2), workdir)
        _measure(cluster, RAY_PORT, 4, 1)
        with console.status(f"two nodes: {rounds} rounds"):
            return _rounds(cluster, rounds, seconds, local=False)
    finally:
        cluster.stop()


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    """The headline figures; the 2-node ones only when that part ran."""
    one = report["one_node"]
    summary = {
        "local_p50_ms": one["local_seq"]["p50_ms"],
        "ray_p50_ms": one["ray_seq"]["p50_ms"],
        "ray_p50_overhead_ms": round(one["ray_seq"]["p50_ms"] - one["local_seq"]["p50_ms"], 2),
        "local_runs_per_s": one["local_conc"]["runs_per_s"],
        "ray_1node_runs_per_s": one["ray_conc"]["runs_per_s"],
        "ray_1node_ratio": round(one["ray_conc"]["runs_per_s"] / one["local_conc"]["runs_per_s"], 3),
        "local_search_calls_per_s": one["local_search"]["runs_per_s"],
        "ray_search_calls_per_s": one["ray_search"]["runs_per_s"],
        "local_search_p50_ms": one["local_search"]["p50_ms"],
        "ray_search_p50_ms": one["ray_search"]["p50_ms"],
        "local_cpu_ms_per_call": _path_cpu(one["local_conc"], local=True),
        "ray_1node_cpu_ms_per_call": _path_cpu(one["ray_conc"], local=False),
        "local_search_cpu_ms_per_call": _path_cpu(one["local_search"], local=True),
        "ray_search_cpu_ms_per_call": _path_cpu(one["ray_search"], local=False),
        "local_switches_per_call": _switches(one["local_conc"], "local_gateway"),
        "ray_gateway_switches_per_call": _switches(one["ray_conc"], "ray_gateway"),
        "ray_sandbox_switches_per_call": _switches(one["ray_conc"], "ray_sandbox"),
    }  # fmt: skip
    if "two_nodes" in report:
        two = report["two_nodes"]
        summary |= {
            "ray_2nodes_runs_per_s": two["ray_conc"]["runs_per_s"],
            "ray_2nodes_ratio": round(two["ray_conc"]["runs_per_s"] / one["local_conc"]["runs_per_s"], 3),
            "ray_2nodes_cpu_ms_per_call": _path_cpu(two["ray_conc"], local=False),
        }  # fmt: skip
    return summary


def print_report(console: Console, report: dict[str, Any]) -> None:
    s = report["summary"]
    table = Table(
        title=f"sandbox print(1): Ray gateway vs local gateway (same run, {CALLERS} callers)"
    )
    for col in ("set-up", "p50 sequential", "runs/s", "vs local", "path CPU/call"):
        table.add_column(col)
    one = report["one_node"]
    table.add_row(
        "local gateway",
        f"{s['local_p50_ms']:.2f} ms",
        f"{s['local_runs_per_s']:.1f}",
        "1.00",
        f"{s['local_cpu_ms_per_call']:.2f} ms",
    )
    table.add_row(
        "Ray, 1 node",
        f"{s['ray_p50_ms']:.2f} ms",
        f"{s['ray_1node_runs_per_s']:.1f}",
        f"{s['ray_1node_ratio']:.2f}",
        f"{s['ray_1node_cpu_ms_per_call']:.2f} ms",
    )
    if "two_nodes" in report:
        table.add_row(
            "Ray, 2 nodes",
            f"{report['two_nodes']['ray_seq']['p50_ms']:.2f} ms",
            f"{s['ray_2nodes_runs_per_s']:.1f}",
            f"{s['ray_2nodes_ratio']:.2f}",
            f"{s['ray_2nodes_cpu_ms_per_call']:.2f} ms",
        )
    console.print(table)
    console.print(f"p50 overhead Ray adds per call: {s['ray_p50_overhead_ms']:.2f} ms (target <= 2 ms)"
                  f"; local p99 {one['local_seq']['p99_ms']:.1f} ms, Ray p99 {one['ray_seq']['p99_ms']:.1f} ms")  # fmt: skip
    for name, key in (("sequential", "ray_seq"), ("16 callers", "ray_conc")):
        cpu = one[key]["cpu_ms_per_call"]
        system = {g.split(":", 1)[1]: v for g, v in cpu.items() if g.startswith("ray_system:")}
        console.print(f"Ray path CPU per call by process ({name}, 1 node): "
                      + ", ".join(f"{g} {v:.2f} ms" for g, v in cpu.items()
                                  if g != "local_gateway" and ":" not in g)
                      + f", Ray's own processes {sum(system.values()):.2f} ms ("
                      + ", ".join(f"{k} {v:.2f}" for k, v in system.items() if v >= 0.01) + ")")  # fmt: skip
    console.print(f"context switches per call ({CALLERS} callers, 1 node): local gateway "
                  f"{s['local_switches_per_call']:.1f}; Ray gateway replica {s['ray_gateway_switches_per_call']:.1f}, "
                  f"sandbox replicas {s['ray_sandbox_switches_per_call']:.1f}")  # fmt: skip
    console.print(f"zero-delay search, {CALLERS} callers (the path's own cost): local "
                  f"{s['local_search_calls_per_s']:.0f} calls/s p50 {s['local_search_p50_ms']:.1f} ms; "
                  f"Ray {s['ray_search_calls_per_s']:.0f} calls/s p50 {s['ray_search_p50_ms']:.1f} ms; CPU/call local "
                  f"{s['local_search_cpu_ms_per_call']:.2f} ms, Ray {s['ray_search_cpu_ms_per_call']:.2f} ms")  # fmt: skip


def write_plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    s = report["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = ["local", "Ray 1 node", "Ray 2 nodes"][: 3 if "ray_2nodes_runs_per_s" in s else 2]
    runs = [s["local_runs_per_s"], s["ray_1node_runs_per_s"], s.get("ray_2nodes_runs_per_s")]
    a.bar(names, runs[: len(names)])
    a.set_title(f"runs/s, {CALLERS} callers")
    b.bar(names[:2], [s["local_p50_ms"], s["ray_p50_ms"]])
    b.set_title("p50 ms, sequential")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd")
    ld = sub.add_parser("load", help="(internal) one run inside the head's namespace")
    ld.add_argument("url")
    ld.add_argument("--callers", type=int, default=1)
    ld.add_argument("--seconds", type=float, default=5)
    ld.add_argument("--tool", choices=sorted(PATHS), default="sandbox")
    parser.add_argument(
        "--out", type=report_path, default=Path("bench-results/benchmarks.ray_bench.json")
    )
    parser.add_argument("--seconds", type=positive_float, help="per run (default: 8)")
    parser.add_argument("--rounds", type=int, help="(default: 3)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 s per run and 1 round by default (a smoke check, noisy; `make bench "
        "ARGS=--quick` passes it)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--one-node", action="store_true",
                        help="skip the 2-node cluster (A/B runs of the 1-node path)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.cmd == "load":
        print(json.dumps(load(args.url, args.callers, args.seconds, args.tool)))
        return 0
    args.seconds = args.seconds or (2.0 if args.quick else 8.0)
    args.rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    if args.rounds < 1:  # the medians of no round failed after the clusters had run
        parser.error(f"argument --rounds: {args.rounds} is not a count above 0")
    unwind_on_sigterm()  # the clusters and the local gateway are stopped by `finally`
    console = Console(stderr=True)
    report = bench(args.seconds, args.rounds, console, two_nodes=not args.one_node)
    write_report(report, args.out)
    write_plot(report, args.out.with_suffix(".png"))
    if args.json:
        print(json.dumps(report["summary"], indent=2))
    else:
        print_report(Console(), report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
