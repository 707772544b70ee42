"""Outputs of a run: the live display, the final table, JSON, the PNG plot and the HDR log."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
from rich.console import Console, Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from toolenv_core.outputs import written_whole
from toolenv_core.plotting import pyplot

from .ramp import RampResult, RampStep
from .result import LoadResult
from .slo import SLOVerdict
from .spec import Progress
from .stats import PERCENTILES


def _ms(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if value >= 10_000:
        return f"{value / 1000:.2f} s"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _latency(value: float | None) -> str:
    """A latency in running text, with its unit: `12.3 ms`, or `11.34 s` from 10 s on (the text
    appended " ms" to that: "11.34 s ms"); `-` when there is none."""
    text = _ms(value)
    return text if text == "-" or text.endswith(" s") else f"{text} ms"


def _pct(x: float) -> str:
    return f"{x * 100:.2f}%"


# ------------------------------------------------------------------------------ live


class LiveView:
    """Renders `Progress` snapshots for rich.live.Live (refreshed by the generator's own ticks)."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.last: Progress | None = None

    def update(self, progress: Progress) -> None:
        self.last = progress

    def __rich__(self) -> Any:
        p = self.last
        if p is None or p.elapsed_s < 0:  # workers tick while they wait for the common start
            return Text(f"{self.title}: starting ...")
        elapsed = min(p.elapsed_s, p.duration_s)
        bar = ProgressBar(total=p.duration_s, completed=elapsed, width=30)
        line = Text.assemble(
            (f"{self.title}  ", "bold"),
            f"{elapsed:5.1f}/{p.duration_s:g} s  ",  # 500ms read "0.3/0 s"
            f"sent {p.scheduled}  done {p.completed}  in flight {p.in_flight}  ",
            (f"errors {p.errors}  ", "red" if p.errors else ""),
            f"{p.recent_rate:7.1f} rps  ",
            f"p50 {_latency(p.recent_p50_ms)}  p99 {_latency(p.recent_p99_ms)} (last tick, from schedule)",
        )
        return Group(bar, line)


# ------------------------------------------------------------------------------ table


def describe(summary: dict[str, Any]) -> str:
    spec = summary["spec"]
    if spec["arrival"] == "closed":
        load = f"closed loop, {spec['concurrency']} callers"
    else:
        load = f"open loop ({spec['arrival']}) at {spec['rate']:g} rps"
    cap, duration = summary.get("request_cap"), spec["duration_s"]
    if cap is None:
        bound = f"for {duration:g} s"
    else:
        bound = f"until {_requests(cap)} or {duration:g} s, whichever first"
    return f"{spec['method']} {spec['url']}  {load} {bound}"


def _requests(n: int) -> str:
    """`1 request`, `4,040 requests` ("1 requests" read wrong)."""
    return f"{n:,} request" + ("" if n == 1 else "s")


def stopped_line(summary: dict[str, Any]) -> str:
    """Which bound ended the run, and when its last request was due."""
    flag = {"max_requests": "--max-requests", "interrupted": "Ctrl-C"}.get(
        summary["stopped_by"], "--duration"
    )
    return (
        f"stopped by {flag}: {_requests(summary['requests'])}, sent over "
        f"{summary['sending_s']:.2f} s of the {summary['duration_s']:g} s"
    )


def summary_table(summary: dict[str, Any]) -> Table:
    table = Table()
    table.add_column("outcome")
    table.add_column("count", justify="right")
    table.add_column("share", justify="right")
    table.add_column("measured from")
    for name, _ in PERCENTILES:
        table.add_column(f"{name} ms", justify="right")
    table.add_column("max ms", justify="right")
    for name, entry in summary["outcomes"].items():
        rows = [("schedule", entry["corrected_ms"])]
        if entry.get("differs"):
            rows.append(("send", entry["uncorrected_ms"]))
        for i, (origin, figures) in enumerate(rows):
            table.add_row(
                name if i == 0 else "",
                str(entry["count"]) if i == 0 else "",
                _pct(entry["share"]) if i == 0 else "",
                origin,
                *(_ms(figures[p]) for p, _ in PERCENTILES),
                _ms(figures["max"]),
                style="green" if name == "ok" else ("red" if i == 0 else "dim red"),
            )
    return table


def rates_line(summary: dict[str, Any]) -> str:
    target = summary["target_rate"]
    target_text = f" (target {target:g})" if target else ""
    status = ", ".join(f"{k}: {v}" for k, v in summary["status_counts"].items()) or "none"
    sched = summary["scheduling_error_ms"]
    return (
        f"{stopped_line(summary)}\n"
        f"requests {summary['requests']}  responses {summary['responses']}  "
        f"sent {summary['achieved_rate']:.1f} rps{target_text}, "
        f"throughput {summary['throughput']:.1f} ok/s\n"
        f"errors {_pct(summary['error_rate'])}  timeouts {_pct(summary['timeout_rate'])}  "
        f"statuses {status}\n"
        f"behind schedule: generator p50 {_latency(sched['p50'])}, p99 {_latency(sched['p99'])}; "
        f"send (+ connection wait) p99 {_latency(summary['send_lag_ms']['p99'])}"
    )


def slo_table(verdicts: list[SLOVerdict]) -> Table:
    table = Table(title="SLOs", title_justify="left")
    table.add_column("slo")
    table.add_column("actual", justify="right")
    table.add_column("verdict")
    for v in verdicts:
        table.add_row(
            v.slo.bound,
            v.slo.format(v.actual),
            Text("met", style="green") if v.ok else Text("BROKEN", style="bold red"),
        )
    return table


def print_report(console: Console, summary: dict[str, Any], verdicts: list[SLOVerdict]) -> None:
    # a line of its own, not the table's title: a title wraps at the table's width
    console.print(describe(summary), markup=False, highlight=False)
    console.print(summary_table(summary))
    console.print(rates_line(summary))
    if summary.get("connect_errors"):
        console.print(f"[red]connect errors:[/red] {'; '.join(summary['connect_errors'])}")
    if verdicts:
        console.print(slo_table(verdicts))


def ramp_step_line(step: RampStep) -> str:
    ok = step.summary["outcomes"].get("ok", {}).get("corrected_ms", {})
    verdict = (
        "met" if step.ok else "BROKEN: " + ", ".join(v.slo.text for v in step.verdicts if not v.ok)
    )
    return (
        f"{step.rate:>9.1f} rps -> sent {step.summary['achieved_rate']:8.1f}  "
        f"p50 {_latency(ok.get('p50'))}  p99 {_latency(ok.get('p99'))}  "
        f"errors {_pct(step.summary['error_rate'])}  {verdict}"
    )


def _step_verdict(step: RampStep) -> Text:
    if not step.ok:
        return Text("BROKEN", style="bold red")
    return Text("cut short", style="yellow") if step.interrupted else Text("met", style="green")


def ramp_table(ramp: RampResult) -> Table:
    table = Table(title="ramp", title_justify="left")
    for col in ("target rps", "sent rps", "p50 ms", "p99 ms", "p99.9 ms", "errors", "SLOs"):
        table.add_column(col, justify="right" if col != "SLOs" else "left")
    for s in ramp.steps:
        ok = s.summary["outcomes"].get("ok", {}).get("corrected_ms", {})
        table.add_row(
            f"{s.rate:g}",
            f"{s.summary['achieved_rate']:.1f}",
            _ms(ok.get("p50")),
            _ms(ok.get("p99")),
            _ms(ok.get("p99.9")),
            _pct(s.summary["error_rate"]),
            _step_verdict(s),
        )
    table.caption = (
        f"knee: {ramp.knee_rate:g} rps"
        if ramp.knee_rate is not None
        else "knee: none (first step broke)"
        if ramp.broke_at is not None
        else "knee: none"
    ) + (
        f"; broke at {ramp.broke_at:g} rps"
        if ramp.broke_at is not None
        else f"; stopped by Ctrl-C at {ramp.interrupted_at:g} rps"
        if ramp.interrupted_at is not None
        else "; never broke"
    )
    return table


# ------------------------------------------------------------------------------ files


def write_hdr(result: LoadResult, out: IO[str] | Path) -> None:
    """An HdrHistogram interval log (one tagged line per outcome and origin; values in us).

    Readable by `hdrh.log.HistogramLogReader` and HdrHistogram's HistogramLogAnalyzer.
    """
    if isinstance(out, Path):
        with written_whole(out) as fh:
            write_hdr(result, fh)
        return
    out.write("#[Histogram log format version 1.2]\n")
    out.write(f"#[StartTime: {time.time() - result.wall_s:.3f} (seconds since epoch)]\n")
    out.write("#toolenv stress: latency in microseconds; tags <outcome>.<corrected|uncorrected>\n")
    out.write('"StartTimestamp","Interval_Length","Interval_Max","Interval_Compressed_Histogram"\n')
    names = [str(n) for n in np.unique(result.outcomes.astype(str))] if result.n else []
    for name in sorted(names, key=lambda n: (n != "ok", n)):
        if name in ("dropped", "unfinished"):
            continue
        for corrected in (True, False):
            hist = result.histogram(name, corrected=corrected)
            if hist.get_total_count() == 0:
                continue
            tag = f"{name}.{'corrected' if corrected else 'uncorrected'}"
            payload = hist.encode().decode()
            out.write(
                f"Tag={tag},0.000,{result.wall_s:.3f},{hist.get_max_value() / 1000.0:.3f},{payload}\n"
            )


def write_plot(result: LoadResult, path: Path, title: str | None = None) -> None:
    """Percentile spectrum (corrected vs uncorrected) and latency over time, as a PNG."""
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    quantiles = np.array([0, 50, 75, 90, 95, 99, 99.5, 99.9, 99.95, 99.99, 99.999])
    xs = 1.0 / (1.0 - np.minimum(quantiles, 99.999) / 100.0)
    for corrected, style, label in ((True, "-", "from schedule"), (False, "--", "from send")):
        hist = result.histogram("ok", corrected=corrected)
        if hist.get_total_count() == 0:
            continue
        ys = [hist.get_value_at_percentile(q) / 1000.0 for q in quantiles]
        ax1.plot(xs, ys, style, marker="o", markersize=3, label=f"ok, {label}")
    for name in sorted({str(n) for n in result.outcomes} - {"ok", "dropped", "unfinished"}):
        hist = result.histogram(name, corrected=True)
        if hist.get_total_count():
            ys = [hist.get_value_at_percentile(q) / 1000.0 for q in quantiles]
            ax1.plot(xs, ys, ":", marker="x", markersize=3, label=f"{name}, from schedule")
    ax1.set_xscale("log")
    ax1.set_xticks(xs[::2])
    ax1.set_xticklabels([f"{q:g}%" for q in quantiles[::2]])
    ax1.set_xlabel("percentile")
    ax1.set_ylabel("latency (ms)")
    ax1.set_title("percentile spectrum")
    ax1.grid(True, which="both", alpha=0.3)
    if ax1.get_legend_handles_labels()[0]:  # none sent, or none answered: no empty legend
        ax1.legend(fontsize=8)  # (matplotlib warned "No artists with labels" on stderr)

    lat = (result.done - result.scheduled) * 1000.0
    ok = (result.outcomes == "ok") & ~np.isnan(lat)
    bad = ~(result.outcomes == "ok") & ~np.isnan(lat)
    idx = np.flatnonzero(ok)
    if len(idx) > 20_000:
        idx = np.random.default_rng(0).choice(idx, 20_000, replace=False)
    if len(idx):  # a run of errors only: no "ok request" in the legend
        ax2.scatter(result.scheduled[idx], lat[idx], s=2, alpha=0.3, label="ok request")
    if bad.any():
        ax2.scatter(result.scheduled[bad], lat[bad], s=4, color="red", alpha=0.6, label="error")
    buckets = result.summary()["over_time"]
    p99 = [b["p99_ms"] for b in buckets]
    if not all(math.isnan(v) for v in p99):  # none answered ok: no line under its name
        ts = [b["t_s"] for b in buckets]
        ax2.plot(ts, p99, color="black", linewidth=1, label="p99 per slice")
    ax2.set_xlabel("scheduled send time (s)")
    ax2.set_ylabel("latency from schedule (ms)")
    ax2.set_title("latency over time")
    ax2.grid(True, alpha=0.3)
    if ax2.get_legend_handles_labels()[0]:
        # where it hides the fewest points: fixed upper right, it hid a late spike, the run's max
        ax2.legend(fontsize=8, loc="best")
    fig.suptitle(title or describe(result.summary()), fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=72, format="png")  # exactly `path`: matplotlib adds `.png` otherwise
    finally:
        plt.close(fig)
