"""The `toolenv stress` command on real servers: outputs, SLO exit codes, Ctrl-C, ramps, reports."""

from __future__ import annotations

import io
import json
import math
import signal
import threading
import warnings
from pathlib import Path

import matplotlib.figure
import matplotlib.pyplot
import numpy as np
import pytest
from cli_support import app, invoke, runner
from hdrh.log import HistogramLogReader
from rich.console import Console

from stress import LoadSpec, run_load
from stress.cli import (
    EXIT_ALL_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NO_RESPONSE,
    EXIT_OK,
    EXIT_SLO_BROKEN,
)
from stress.report import LiveView, rates_line, write_plot
from stress.result import LoadResult
from stress.spec import Progress
from stress.testing import serve
from toolenv_core.net import free_port


def test_table_json_plot_and_hdr(fast_server: str, tmp_path: Path) -> None:
    plot, hdr, out = tmp_path / "p.png", tmp_path / "h.hdr", tmp_path / "r.json"
    result = invoke(
        "--url", fast_server + "/x", "--rate", "200", "--duration", "1s", "--quiet",
        "--plot", str(plot), "--hdr", str(hdr), "--out", str(out), "--slo", "p99=1s",
    )  # fmt: skip
    assert result.exit_code == EXIT_OK, result.output
    assert "open loop (constant) at 200 rps" in result.output
    assert "p99.9 ms" in result.output and "met" in result.output
    report = json.loads(out.read_text())
    assert report["outcomes"]["ok"]["count"] == 200
    for key in ("p50", "p90", "p99", "p99.9", "max"):
        assert 2.0 <= report["outcomes"]["ok"]["corrected_ms"][key] < 1000
    assert report["target_rate"] == 200 and report["achieved_rate"] > 150
    assert report["over_time"] and sum(b["count"] for b in report["over_time"]) == 200
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    # the HDR log decodes with the reference reader into the same count
    from hdrh.histogram import HdrHistogram

    reader = HistogramLogReader(str(hdr), HdrHistogram(1, 3_600_000_000, 3))
    first = reader.get_next_interval_histogram()
    assert first.get_tag() == "ok.corrected"
    assert first.get_total_count() == 200
    assert first.get_value_at_percentile(50) / 1000 == pytest.approx(
        report["outcomes"]["ok"]["corrected_ms"]["p50"], rel=0.01
    )


def test_broken_slo_sets_exit_code_1(fast_server: str) -> None:
    result = invoke(
        "--url",
        fast_server + "/x",
        "--rate",
        "100",
        "--duration",
        "0.5s",
        "--slo",
        "p50=1ms",
        "--json",
    )
    assert result.exit_code == EXIT_SLO_BROKEN
    report = json.loads(result.stdout)
    assert report["slos"][0]["ok"] is False and report["slos"][0]["actual"] > 1.0


def test_error_slo_on_http_errors(fast_server: str) -> None:
    result = invoke(
        "--url", fast_server + "/status/503", "--rate", "100", "--duration", "0.3s",
        "--slo", "errors=0.1%", "--json",
    )  # fmt: skip
    assert result.exit_code == EXIT_SLO_BROKEN
    report = json.loads(result.stdout)
    assert report["status_counts"] == {"503": 30}
    assert report["error_rate"] == 1.0


def test_no_answer_exits_3() -> None:
    port = free_port()
    result = invoke(
        "--url", f"http://127.0.0.1:{port}/", "--rate", "50", "--duration", "0.2s", "--json"
    )
    assert result.exit_code == EXIT_NO_RESPONSE
    assert json.loads(result.stdout)["outcomes"]["connect_error"]["count"] == 10


def test_ctrl_c_prints_the_report_of_what_was_sent_and_exits_130(
    fast_server: str, tmp_path: Path
) -> None:
    """Ctrl-C (SIGINT) in the middle of a run exited 130 with nothing: no table, no --out."""
    out = tmp_path / "r.json"
    timer = threading.Timer(1.0, signal.raise_signal, (signal.SIGINT,))
    timer.start()
    args = ["--url", fast_server + "/x", "--rate", "100", "--duration", "60s", "--quiet"]
    result = invoke(*args, "--out", str(out))
    timer.join()
    assert result.exit_code == EXIT_INTERRUPTED, result.output
    assert "stopped by Ctrl-C: " in result.output and "interrupted:" in result.output
    report = json.loads(out.read_text())
    assert report["stopped_by"] == "interrupted" and 0 < report["requests"] < 6000


def test_a_ramp_step_cut_by_ctrl_c_is_no_knee(fast_server: str, tmp_path: Path) -> None:
    """A step Ctrl-C cut short met its SLOs on the part that ran, and the ramp read "knee: 150
    rps; never broke": a knee no whole step showed."""
    out = tmp_path / "r.json"
    args = ["--url", fast_server + "/x", "--ramp", "--rate", "100", "--step-duration", "2s"]
    timer = threading.Timer(3.0, signal.raise_signal, (signal.SIGINT,))  # in the second step
    timer.start()
    result = invoke(*args, "--quiet", "--out", str(out))
    timer.join()
    assert result.exit_code == EXIT_INTERRUPTED, result.output
    ramp = json.loads(out.read_text())["ramp"]
    assert [(s["rate"], s["interrupted"]) for s in ramp["steps"]] == [(100, False), (150, True)]
    assert ramp["knee_rate"] == 100 and ramp["interrupted_at"] == 150
    assert "knee: 100 rps; stopped by Ctrl-C at 150 rps" in result.output, result.output


def test_a_ramp_that_no_one_answers_says_so() -> None:
    """A single run says "the target never answered" beside its exit 3; a ramp exited 3 under
    a table of dashes without a word."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    result = invoke("--url", url, "--ramp", "--rate", "50", "--step-duration", "0.2s", "--quiet")
    assert result.exit_code == EXIT_NO_RESPONSE
    assert "the target never answered" in result.output


def test_every_request_failing_exits_4_even_without_an_slo(fast_server: str) -> None:
    result = invoke("--url", fast_server + "/status/404", "--rate", "100", "--duration", "0.3s")
    assert result.exit_code == EXIT_ALL_FAILED, result.output
    assert "not one request succeeded (http_404 30)" in result.output
    # one success among the failures is a run that worked (its error rate is in the report)
    ok = invoke("--url", fast_server + "/x", "--rate", "100", "--duration", "0.1s", "--quiet")
    assert ok.exit_code == EXIT_OK


def test_a_run_cut_short_by_max_requests_reports_its_real_throughput(fast_server: str) -> None:
    """2 requests at 100 rps span 0.02 s: about 100 ok/s, not 2 over the 10 s --duration."""
    result = invoke(
        "--url", fast_server + "/x", "--rate", "100", "--max-requests", "2", "--json"
    )  # fmt: skip
    assert result.exit_code == EXIT_OK, result.output
    report = json.loads(result.stdout)
    assert report["requests"] == 2 and report["outcomes"]["ok"]["count"] == 2
    assert 0.02 <= report["wall_s"] < 1.0
    assert 2 / 1.0 < report["throughput"] <= 2 / 0.02 + 1e-9
    table = invoke("--url", fast_server + "/x", "--rate", "100", "--max-requests", "2")
    shown = float(table.output.split("throughput ")[1].split(" ok/s")[0])
    assert shown > 2.0


@pytest.mark.parametrize("bound", [["--max-requests", "1"], ["--duration", "1ms"]])
def test_one_request_is_sent_at_the_target_rate(fast_server: str, bound: list[str]) -> None:
    """One request sent on time is the target rate, as two or more are: it read 0.2 rps
    (1 over the 5 s --duration) under --max-requests 1, and 1000 rps at --duration 1ms."""
    args = ["--url", fast_server + "/x", "--rate", "100", "--duration", "5s", *bound, "--json"]
    report = json.loads(invoke(*args).stdout)
    assert report["sent"] == 1
    assert 50 < report["achieved_rate"] <= 100
    if bound[0] == "--max-requests":  # and the table says it in the singular
        shown = invoke(*args[:-1]).output
        assert "until 1 request or 5 s, whichever first" in shown, shown
        assert "stopped by --max-requests: 1 request, sent over" in shown, shown


def test_the_report_says_which_bound_stopped_the_run(fast_server: str) -> None:
    """Before: the header said "for 2 s" of a run the request cap stopped after 0.2 s."""
    url = fast_server + "/x"
    capped = ["--url", url, "--rate", "100", "--duration", "2s", "--max-requests", "20"]
    cut = invoke(*capped)
    assert cut.exit_code == EXIT_OK, cut.output
    assert "open loop (constant) at 100 rps until 20 requests or 2 s, whichever first" in cut.output
    assert " for 2 s" not in cut.output
    assert "stopped by --max-requests: 20 requests, sent over 0.19 s of the 2 s" in cut.output
    report = json.loads(invoke(*capped, "--json").stdout)
    assert report["stopped_by"] == "max_requests" and report["requests"] == 20
    # the cap cannot bind (20 requests at 100 rps in 0.2 s): the duration is the one bound
    timed = invoke("--url", url, "--rate", "100", "--duration", "0.2s", "--max-requests", "50")
    assert "open loop (constant) at 100 rps for 0.2 s" in timed.output, timed.output
    assert "stopped by --duration: 20 requests, sent over 0.19 s of the 0.2 s" in timed.output
    # a closed loop may meet either bound: both are named
    closed = ["--url", url, "--arrival", "closed", "--concurrency", "2", "--duration", "5s"]
    closed += ["--max-requests", "30"]
    report = json.loads(invoke(*closed, "--json").stdout)
    assert report["stopped_by"] == "max_requests" and report["requests"] == 30
    shown = invoke(*closed).output
    assert "closed loop, 2 callers until 30 requests or 5 s, whichever first" in shown
    assert "stopped by --max-requests: 30 requests" in shown


def test_the_table_keeps_every_figure_when_piped(fast_server: str, tmp_path: Path) -> None:
    """Without a terminal or COLUMNS (`| tee`, a CI log) rich assumes 80 columns and cut the
    summary's cells to "…", max included; the report keeps its full width instead."""
    out = tmp_path / "r.json"
    args = ["--url", fast_server + "/x", "--rate", "100", "--duration", "0.3s", "--out", str(out)]
    result = runner.invoke(app, args, catch_exceptions=False, env={"COLUMNS": None})
    assert result.exit_code == EXIT_OK, result.output
    assert "…" not in result.output
    assert "outcome" in result.output and "measured from" in result.output
    ok = json.loads(out.read_text())["outcomes"]["ok"]["corrected_ms"]
    row = next(line for line in result.output.splitlines() if "schedule" in line)
    assert abs(float(row.split("│")[-2]) - ok["max"]) < 0.1  # the max column, whole


def test_a_plot_of_no_request_warns_nothing(tmp_path: Path) -> None:
    """A run Ctrl-C ended before its first send drew its plot with matplotlib's "No artists
    with labels found to put in legend" warning on stderr."""
    empty = np.empty(0)
    result = LoadResult(
        spec=LoadSpec(url="http://127.0.0.1:9/x"), start=0.0, scheduled=empty, sent=empty,
        done=empty, status=np.empty(0, np.int16), error=np.empty(0, np.int8), captured={},
        wall_s=0.0, interrupted=True,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # what matplotlib warned
        write_plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_writes_the_file_it_names(fast_server: str, tmp_path) -> None:
    plot = tmp_path / "spectrum"  # no suffix: matplotlib wrote spectrum.png instead
    args = ["--url", fast_server + "/x", "--rate", "100", "--duration", "0.1s", "--quiet"]
    assert invoke(*args, "--plot", str(plot)).exit_code == EXIT_OK
    assert plot.read_bytes()[:4] == b"\x89PNG" and not plot.with_suffix(".png").exists()


def test_ramp_reports_the_knee(tmp_path: Path) -> None:
    # 20 ms per request, at most 4 connections: capacity ~200 rps, so 100 and 150 rps hold and
    # 300 rps queues up until p99 breaks.
    with serve("uniform", low_ms=20, high_ms=20) as url:
        result = invoke(
            "--url", url + "/x", "--ramp", "--rate", "100", "--ramp-factor", "1.5", "--ramp-max", "400",
            "--step-duration", "1s", "--connections", "4", "--slo", "p99=200ms", "--json",
            "--records",
        )  # fmt: skip
    assert result.exit_code == EXIT_OK, result.stdout
    report = json.loads(result.stdout)
    ramp = report["ramp"]
    rates = [s["rate"] for s in ramp["steps"]]
    assert rates[:2] == [100, 150]
    assert ramp["knee_rate"] in (150, 225) and ramp["broke_at"] in (225, 337.5)
    assert ramp["steps"][-1]["ok"] is False
    # --records are the last step's, as its --plot and --hdr (they went nowhere)
    assert len(report["records"]) == report["last_step"]["requests"] > 0


def test_a_closed_loop_sends_no_faster_than_its_callers_can(fast_server: str) -> None:
    """16 callers sending once (2-4 ms each) read thousands of rps above what they could send
    (the rate was over the last send's time, before the round's answers): at most callers over
    the quickest answer, and the whole run's sends over its length."""
    spec = LoadSpec(url=fast_server + "/x", arrival="closed", concurrency=16, max_requests=16)
    result = run_load(spec)
    assert result.n == 16 and len(result.latencies_ms()) == 16
    assert result.achieved_rate <= 16 / (result.latencies_ms().min() / 1000)
    assert result.achieved_rate == pytest.approx(16 / result.wall_s)


def test_the_report_names_a_credential_header_without_its_value(fast_server: str) -> None:
    """`-H 'Authorization: Bearer <key>'` (a gateway with API keys) was written out whole in the
    JSON report's spec, into every --out file."""
    result = invoke(
        "--url", fast_server + "/x", "--rate", "20", "--duration", "0.1s", "--json",
        "-H", "Authorization: Bearer s3cret", "-H", "X-Trace: t1",
    )  # fmt: skip
    assert result.exit_code == EXIT_OK, result.output
    assert "s3cret" not in result.stdout
    assert json.loads(result.stdout)["spec"]["headers"] == {"Authorization": "***", "X-Trace": "t1"}


def test_dropped_requests_show_no_latency(fast_server: str) -> None:
    """A request dropped past --max-in-flight was never sent, yet the table gave it a latency
    (the generator's own lag until it dropped it: "dropped ... p50 0.30 ms")."""
    result = invoke(
        "--url", fast_server + "/x", "--rate", "2000", "--duration", "0.05s",
        "--max-in-flight", "1", "--json",
    )  # fmt: skip
    dropped = json.loads(result.stdout)["outcomes"]["dropped"]
    assert dropped["count"] > 0
    assert set(dropped["corrected_ms"].values()) == {None}


def test_gateway_tool_call_reaches_the_tool_path(fast_server: str) -> None:
    result = invoke(
        "--gateway", fast_server, "--tool", "search", "--rate", "50", "--duration", "0.2s", "--json"
    )
    report = json.loads(result.stdout)
    assert report["spec"]["url"].endswith("/v1/tools/search/call")
    assert report["outcomes"]["ok"]["count"] == 10


def test_running_text_gives_each_latency_one_unit(fast_server: str) -> None:
    """From 10 s on a latency reads `11.34 s`; the lines around it appended " ms" as well
    ("send (+ connection wait) p99 11.34 s ms"), and the live view rounded a 500 ms run to
    "0.3/0 s"."""
    args = ["--url", fast_server + "/x", "--rate", "100", "--duration", "0.1s", "--json"]
    summary = json.loads(invoke(*args).stdout)
    summary["send_lag_ms"]["p99"] = 11_340.0
    summary["scheduling_error_ms"]["p50"] = 2.5
    text = rates_line(summary)
    assert "send (+ connection wait) p99 11.34 s" in text and "s ms" not in text
    assert "generator p50 2.50 ms" in text
    view = LiveView("stress")
    view.update(Progress(0.3, 0.5, 30, 29, 0, 1, 100.0, 12_000.0, 3.0))
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(view)
    live = console.export_text()
    assert "0.3/0.5 s" in live and "p50 12.00 s  p99 3.00 ms" in live
    # worker processes tick while they wait for their common start: not "-1.2/0.5 s"
    view.update(Progress(-1.2, 0.5, 0, 0, 0, 0, 0.0, math.nan, math.nan))
    console.print(view)
    assert "stress: starting ..." in console.export_text()


def test_the_latency_over_time_legend_hides_no_spike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The legend sat in the upper right whatever the data: a stall at the end of a run, its
    highest points, drew under it; and a run with no ok answer named a `p99 per slice` line that
    was not drawn."""
    drawn: list[matplotlib.figure.Figure] = []
    monkeypatch.setattr(matplotlib.pyplot, "close", drawn.append)
    n = 2000
    scheduled = np.linspace(0.0, 10.0, n, endpoint=False)
    latency = np.full(n, 0.01)
    latency[-5:] = 1.0  # the last 25 ms of sends met a 1 s stall
    for status in (200, 503):
        result = LoadResult(
            spec=LoadSpec(url="http://127.0.0.1:9/x", rate=200.0, duration_s=10.0), start=0.0,
            scheduled=scheduled, sent=scheduled, done=scheduled + latency,
            status=np.full(n, status, np.int16), error=np.zeros(n, np.int8), captured={},
            wall_s=11.0, interrupted=False,
        )  # fmt: skip
        write_plot(result, tmp_path / f"{status}.png")
        over_time = drawn.pop().axes[1]
        legend = over_time.get_legend().get_window_extent()
        spike = over_time.transData.transform((scheduled[-1], 1000.0 * latency[-1]))
        assert not legend.contains(*spike), (legend, spike)
        labels = over_time.get_legend_handles_labels()[1]
        assert labels == (["ok request", "p99 per slice"] if status == 200 else ["error"])
