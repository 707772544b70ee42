"""`toolenv stress` refusals and targets: bad options, output paths, URL bodies, tools, SLOs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cli_support import app, invoke, runner

from stress.cli import EXIT_OK, EXIT_USAGE
from stress.http import encode_body
from stress.options import parse_duration
from stress.slo import SLO, SLOError
from stress.targets import RUN_CODE_PAYLOADS, TargetError, resolve_target


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


def test_two_outputs_at_one_path_are_refused_before_the_run(fast_server: str, tmp_path) -> None:
    """`--out r --hdr r` wrote the HDR log over the JSON report and exited 0 (`--plot` too)."""
    args = ["--url", fast_server + "/x", "--rate", "100", "--duration", "0.1s", "--quiet"]
    report = tmp_path / "r"
    for first, second in (("--out", "--hdr"), ("--out", "--plot"), ("--plot", "--hdr")):
        also = tmp_path / ".." / tmp_path.name / "r"  # the same file, named another way
        result = invoke(*args, first, str(report), second, str(also))
        assert result.exit_code == EXIT_USAGE, result.output
        assert f"error: {second} {also}: is {first} too; name another file" in result.output
        assert not report.exists()  # no run


def test_an_error_names_a_path_with_brackets_as_given(tmp_path) -> None:
    """rich read the message's `[v2]` as a markup tag (`.../res/o.json` said), and a `[/b]` was
    a MarkupError traceback instead of the one line."""
    args = ["--url", "http://127.0.0.1:1/x", "--rate", "1", "--duration", "0.1s", "--quiet"]
    for name in ("res[v2]", "res[/b]"):
        out = tmp_path / name / "o.json"
        result = invoke(*args, "--out", str(out))
        assert result.exit_code == EXIT_USAGE, (result.output, result.exception)
        assert f"error: --out {out}: " in result.output.replace("\n", ""), result.output


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
