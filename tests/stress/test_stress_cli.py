"""The `toolenv stress` command: outputs, SLO exit codes, ramp, targets, refusals (real servers)."""

from __future__ import annotations

import io
import json
import math
import signal
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from hdrh.log import HistogramLogReader
from rich.console import Console
from typer.testing import CliRunner

from stress import LoadSpec, run_load
from stress.cli import (
    EXIT_ALL_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NO_RESPONSE,
    EXIT_OK,
    EXIT_SLO_BROKEN,
    EXIT_USAGE,
    build_app,
    parse_duration,
)
from stress.http import encode_body
from stress.report import LiveView, rates_line, write_plot
from stress.result import LoadResult
from stress.slo import SLO, SLOError
from stress.spec import Progress
from stress.targets import RUN_CODE_PAYLOADS, TargetError, resolve_target
from stress.testing import serve
from toolenv_core.net import free_port

runner = CliRunner()
app = build_app()


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False, env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def fast_server() -> str:
    with serve("uniform", low_ms=2, high_ms=4, seed=3) as url:
        yield url


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


def test_a_duration_of_one_hour_is_accepted_and_more_is_refused(fast_server: str) -> None:
    assert parse_duration("1h") == 3600 and parse_duration("0.5h") == 1800
    assert parse_duration("90m") == 5400 and parse_duration("250ms") == 0.25
    result = invoke(
        "--url", fast_server + "/x", "--duration", "1h", "--max-requests", "3", "--json"
    )  # fmt: skip
    assert result.exit_code == EXIT_OK, result.output
    report = json.loads(result.stdout)
    assert report["spec"]["duration_s"] == 3600 and report["requests"] == 3
    over = invoke("--url", fast_server + "/x", "--duration", "61m", "--quiet")
    assert over.exit_code == EXIT_USAGE and "--duration must be in (0, 3600]" in over.output


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


def test_a_long_error_stays_one_line_when_piped() -> None:
    """Piped (a CI log, `2> err.txt`) rich assumes 80 columns and broke a longer error over two
    lines ("... give --json or --out" / "FILE too"): a grep for the line got half of it."""
    args = ["--url", "http://127.0.0.1:9/x", "--records", "--quiet"]
    result = runner.invoke(app, args, catch_exceptions=False, env={"COLUMNS": None})
    assert result.exit_code == EXIT_USAGE
    said = "error: --records adds every request to the JSON report: give --json or --out FILE too"
    assert said in result.output.splitlines(), result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--url", "http://10.9.8.7:80/x"], "--allow-remote"),
        (["--url", "https://127.0.0.1/x"], "http://"),
        (["--url", "http://127.0.0.1:9/x", "--slo", "p99=fast"], "not a duration"),
        # a spec error named LoadSpec's field (duration_s), not the option the user typed
        (["--url", "http://127.0.0.1:9/x", "--duration", "0s"], "--duration must be in (0, 3600]"),
        (["--url", "http://127.0.0.1:9/x", "--timeout", "0s"], "--timeout must be positive"),
        (["--url", "http://127.0.0.1:9/x", "--max-requests", "0"], "--max-requests must be in"),
        (["--url", "http://127.0.0.1:9/x", "--rate", "0"], "--rate must be a positive number"),
        (
            ["--url", "http://127.0.0.1:9/x", "--arrival", "closed", "--concurrency", "0"],
            "--concurrency must be in [1, 10000]",
        ),
        (
            ["--url", "http://127.0.0.1:9/x", "--max-in-flight", "0"],
            "--max-in-flight and --connections must be at least 1",
        ),
        (
            ["--url", "http://127.0.0.1:9/x", "--workers", "4", "--max-requests", "2"],
            "--workers (4) is more than --max-requests (2)",
        ),
        (
            ["--url", "http://127.0.0.1:9/x", "--arrival", "closed", "--workers", "2"],
            "--workers > 1 is for open-loop runs",
        ),
        # a ramp step's duration is its own option
        (
            ["--url", "http://127.0.0.1:9/x", "--ramp", "--step-duration", "2h"],
            "--step-duration must be in (0, 3600], got 7200",
        ),
        # a bad duration named no option ("Invalid value: 'abc' is not a duration")
        (["--url", "http://127.0.0.1:9/x", "--timeout", "abc"], "'--timeout': 'abc' is not a"),
        (["--url", "http://127.0.0.1:9/x", "--duration", "1x"], "'--duration': '1x' is not a"),
        (["--url", "http://127.0.0.1:9/x", "--step-duration", "?"], "'--step-duration': '?'"),
        (["--url", "http://127.0.0.1:9/x", "--body", "{not json"], "not JSON"),
        (
            ["--gateway", "http://127.0.0.1:9", "--tool", "run_code", "--payload", "nope"],
            "built-in",
        ),
        (["--url", "http://127.0.0.1:9/x", "--arrival", "sideways"], "--arrival must be constant"),
        # with --tool, --body was read as the arguments but its error named --arguments, and of
        # several argument sources all but one were ignored without a word
        (["--gateway", "http://127.0.0.1:9", "--tool", "search", "--body", "{x"], "--body is not"),
        (
            [
                "--gateway",
                "http://127.0.0.1:9",
                "--tool",
                "search",
                "--arguments",
                "{}",
                "--body",
                "{}",
            ],
            "give one of --arguments, --body",
        ),
        (
            [
                "--gateway",
                "http://127.0.0.1:9",
                "--tool",
                "run_code",
                "--payload",
                "cpu",
                "--body",
                "{}",
            ],
            "give one of --payload, --body",
        ),
        # sent as a POST all the same, without a word
        (
            ["--gateway", "http://127.0.0.1:9", "--tool", "search", "--method", "GET"],
            "--method GET goes with --url: a gateway tool call is a POST",
        ),
        (["--url", "http://127.0.0.1:9/x", "--workers", "0"], "--workers must be at least 1"),
        # each worker took at least one: 2 workers had 2 requests out under --max-in-flight 1
        (
            ["--url", "http://127.0.0.1:9/x", "--workers", "2", "--max-in-flight", "1"],
            "--workers (2) is more than --max-in-flight or --connections allow",
        ),
        # 1,000 spawned interpreters were started (0.2 s apart) before the first request
        (["--url", "http://127.0.0.1:9/x", "--workers", "1000"], "at most 64"),
        (["--url", "http://127.0.0.1:9/x", "--preconnect", "-1"], "--preconnect must be >= 0"),
        # numpy's Poisson generator refused it after the checks: a traceback, exit 1
        (
            ["--url", "http://127.0.0.1:9/x", "--arrival", "poisson", "--seed", "-1"],
            "--seed must be >= 0, got -1",
        ),
        (
            ["--url", "http://127.0.0.1:9/x", "--ramp", "--ramp-step", "-5"],
            "--ramp-step must be >= 0",
        ),
        # a NaN factor ran one step and reported "never broke" (exit 0); a NaN max, no step (exit 3)
        (["--url", "http://127.0.0.1:9/x", "--ramp", "--ramp-factor", "nan"], "must be finite"),
        (["--url", "http://127.0.0.1:9/x", "--ramp", "--ramp-max", "nan"], "must be finite"),
        # a step past the most a run takes was a traceback (exit 1) after the steps before it
        (
            ["--url", "http://127.0.0.1:9/x", "--ramp", "--ramp-max", "2e6"],
            "--ramp-max must be below 1,000,000 rps, got 2e+06",
        ),
        (["--url", "http://127.0.0.1:9/x", "--out", "/nonexistent/r.json"], "no directory"),
        # cut at 100 steps without a word: "knee: 100 rps; never broke" (exit 0) of a ramp
        # asked to go to 1,000
        (
            ["--url", "http://127.0.0.1:9/x", "--ramp", "--rate", "1", "--ramp-step", "1"]
            + ["--ramp-max", "1000"],
            "by --ramp-step 1 takes more than 100 steps",
        ),
        (
            ["--url", "http://127.0.0.1:9/x", "--ramp", "--ramp-factor", "1.01"],
            "--rate 100 to --ramp-max 10000 rps by --ramp-factor 1.01 takes more than 100",
        ),
        # a closed loop has no target rate: --ramp was a traceback (exit 1) after the checks,
        # and a rate SLO was always BROKEN (exit 1)
        (["--url", "http://127.0.0.1:9/x", "--arrival", "closed", "--ramp"], "--arrival constant"),
        (
            ["--url", "http://127.0.0.1:9/x", "--arrival", "closed", "--slo", "rate=95%"],
            "--slo rate=95%: a closed loop has no target rate",
        ),
        # the other loop's option was dropped without a word: --concurrency 32 ran an open loop
        # at the default 100 rps
        (
            ["--url", "http://127.0.0.1:9/x", "--concurrency", "32"],
            "--concurrency sets a closed loop's callers, and --arrival constant is an open loop",
        ),
        (
            ["--url", "http://127.0.0.1:9/x", "--arrival", "closed", "--rate", "50"],
            "--rate sets an open loop's rate",
        ),
        (
            ["--url", "http://127.0.0.1:9/x", "--arrival", "closed", "--max-in-flight", "5"],
            "--max-in-flight bounds an open loop's outstanding requests",
        ),
        # a ramp's option without --ramp ran one plain run, and --duration with it was dropped
        (["--url", "http://127.0.0.1:9/x", "--ramp-max", "500"], "--ramp-max shapes a ramp"),
        (["--url", "http://127.0.0.1:9/x", "--step-duration", "1s"], "add --ramp, or drop"),
        (["--url", "http://127.0.0.1:9/x", "--ramp", "--duration", "3s"], "--step-duration long"),
        # the message named neither option nor value ("ramp needs 0 < start rate <= ramp max")
        (
            ["--url", "http://127.0.0.1:9/x", "--ramp", "--rate", "200", "--ramp-max", "100"],
            "--rate 200 rps, above --ramp-max 100",
        ),
        # what HTTP/1.1 cannot carry in a request head was a traceback (exit 1, "SLO broken"),
        # a header smuggled in by CR LF, or a whole run of 400s (exit 4)
        (["--url", "http://127.0.0.1:9/x", "-H", "X-A: \u65e5"], "outside Latin-1"),
        (["--url", "http://127.0.0.1:9/x", "-H", "X-A: a\r\nX-B: b"], "control character"),
        (["--url", "http://127.0.0.1:9/x", "-H", "Bad Name: v"], "header name 'Bad Name'"),
        (["--url", "http://127.0.0.1:9/x", "-H", ": v"], "header name ''"),
        (["--url", "http://127.0.0.1:9/x", "--capture-header", "\u65e5"], "header name"),
        (["--url", "http://127.0.0.1:9/x", "--method", "GE T"], "--method 'GE T' is not an HTTP"),
        # sent beside the generator's own framing: two Content-Lengths, or (GET) the next
        # request read as this one's body, a run of 400s and mixed-up answers
        (["--url", "http://127.0.0.1:9/x", "-H", "Content-Length: 5"], "framed by the generator"),
        (["--url", "http://127.0.0.1:9/x", "-H", "transfer-encoding: chunked"], "drop this"),
        (["--url", "http://127.0.0.1:9/\u65e5"], "percent-encode"),
        (["--url", "http://127.0.0.1:9/x y"], "percent-encode"),
        (["--url", "http://127.0.0.1:99999/x"], "'http://127.0.0.1:99999/x': Port out of range"),
        # read as port 80: the load went to whatever listened there
        (["--url", "http://127.0.0.1:0/x"], "'http://127.0.0.1:0/x' names port 0"),
        # they were not sent (no Authorization), and the report's title showed the password
        (["--url", "http://u:pw@127.0.0.1:9/x"], "'http://***@127.0.0.1:9/x' carries credentials"),
        # the records went nowhere, without a word
        (["--url", "http://127.0.0.1:9/x", "--records"], "give --json or --out FILE"),
        # the values were kept per request and shown nowhere
        (
            ["--url", "http://127.0.0.1:9/x", "--capture-header", "X-A", "--json"],
            "--capture-header keeps a header's value in each request's record: give --records",
        ),
    ],
)
def test_bad_options_exit_2_with_a_message(args: list[str], message: str) -> None:
    result = invoke(*args, "--quiet")
    assert result.exit_code == EXIT_USAGE
    assert message in result.output


def test_an_output_that_is_a_directory_is_refused_before_the_run(
    fast_server: str, tmp_path
) -> None:
    """A directory given to --out or --hdr was found only after the run; --plot wrote DIR.png
    beside it and exited 0. Each is now one line before any request is sent."""
    args = ["--url", fast_server + "/x", "--rate", "100", "--duration", "0.1s", "--quiet"]
    for option in ("--out", "--plot", "--hdr"):
        result = invoke(*args, option, str(tmp_path))
        assert result.exit_code == EXIT_USAGE, result.output
        assert f"error: {option} {tmp_path}: is a directory" in result.output
        assert "requests" not in result.output  # no run, so no report
    assert not tmp_path.with_suffix(".png").exists()


def test_an_error_names_a_path_with_brackets_as_given(tmp_path) -> None:
    """rich read the message's `[v2]` as a markup tag (`.../res/o.json` said), and a `[/b]` was
    a MarkupError traceback instead of the one line."""
    args = ["--url", "http://127.0.0.1:1/x", "--rate", "1", "--duration", "0.1s", "--quiet"]
    for name in ("res[v2]", "res[/b]"):
        out = tmp_path / name / "o.json"
        result = invoke(*args, "--out", str(out))
        assert result.exit_code == EXIT_USAGE, (result.output, result.exception)
        assert f"error: --out {out}: " in result.output.replace("\n", ""), result.output


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


def test_gateway_tool_targets() -> None:
    t = resolve_target(gateway="http://127.0.0.1:8080/", tool="search", arguments='{"query": "x"}')
    assert t.url == "http://127.0.0.1:8080/v1/tools/search/call"
    assert t.body == {"arguments": {"query": "x"}}
    t = resolve_target(gateway="http://127.0.0.1:8080", tool="run_code", payload="hostile")
    assert t.url == "http://127.0.0.1:8080/v1/tools/sandbox/call"  # the gateway's name for it
    assert (
        t.body["arguments"]["language"] == "python" and "while True" in t.body["arguments"]["code"]
    )
    for name in ("trivial", "cpu-bound", "memory-heavy", "hostile"):
        assert set(RUN_CODE_PAYLOADS[name]) >= {"code", "language", "run_timeout"}
    with pytest.raises(TargetError):
        resolve_target(url="http://x/", gateway="http://y/", tool="search")


@pytest.mark.parametrize("text", ['"who wrote hamlet"', "null", '{"topk": 3}', "[1, 2]", "7"])
def test_a_url_body_goes_as_the_json_it_was_given(text: str, tmp_path: Path) -> None:
    """A JSON string body went as its raw text (`"q"` sent `q`, not JSON, under a JSON
    content type) and `null` as no body at all."""
    path = tmp_path / "body.json"
    path.write_text(text)
    for given in ({"body": text}, {"body_file": path}):
        sent = encode_body(resolve_target(url="http://127.0.0.1:9/x", **given).body)
        assert json.loads(sent) == json.loads(text)


@pytest.mark.parametrize(
    ("method", "sent"), [("HEAD", b""), ("get", b""), ("DELETE", b""), ("post", b"{}")]
)
def test_a_url_without_a_body_sends_one_only_where_it_means_something(
    method: str, sent: bytes
) -> None:
    """A HEAD (or DELETE, OPTIONS) went out with a JSON `{}` body: only GET sent none."""
    assert encode_body(resolve_target(url="http://127.0.0.1:9/x", method=method).body) == sent


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


def test_slo_grammar() -> None:
    assert SLO.parse("p99=500ms").limit == 500
    assert SLO.parse("p99.9=2s").limit == 2000
    assert SLO.parse("max=800us").limit == pytest.approx(0.8)
    assert SLO.parse("errors=0.1%").limit == pytest.approx(0.001)
    assert SLO.parse("timeouts=0").limit == 0
    summary = {
        "outcomes": {},
        "error_rate": 0.0,
        "timeout_rate": 0.0,
        "target_rate": 100,
        "achieved_rate": 96,
    }
    assert SLO.parse("rate=95%").check(summary).ok
    assert not SLO.parse("p99=1s").check(summary).ok  # no successful request: cannot be met
    assert math.isnan(SLO.parse("p99=1s").check(summary).actual)
    for bad in ("p99", "p42=1ms", "errors=lots", "errors=150%", "rate=200%", "rate=1.5"):
        with pytest.raises(SLOError):
            SLO.parse(bad)


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
