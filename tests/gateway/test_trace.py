"""Trace capture: calls carrying X-Trajectory-Id become PolyTrace tool-call records, replayable."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time

import httpx
import pytest
from gw_support import proxy_tool
from typer.testing import CliRunner

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway.trace import TraceWriter, read_captured_calls
from toolenv.cli import build_app
from toolenv_core.headers import trajectory_header
from toolenv_core.polytrace.latencies import tool_latencies
from toolenv_core.polytrace.multiturn import read_multiturn

toolenv_app = build_app()


def test_capture_writes_tool_call_records_and_they_replay(upstream, gateway, tmp_path) -> None:
    up = upstream("a")
    capture = tmp_path / "calls" / "capture.jsonl"
    gw = gateway(
        [proxy_tool("search", up.url), proxy_tool("code", up.url)], trace_path=str(capture)
    )

    def call(tool: str, arguments: dict, traj: str | None, step: int, turn: int, deadline_ms=5000):
        headers = {"X-Step": str(step), "X-Turn": str(turn)}
        if traj:
            headers["X-Trajectory-Id"] = traj
        body = {"arguments": arguments, "deadline_ms": deadline_ms}
        return httpx.post(f"{gw.url}/v1/tools/{tool}/call", json=body, headers=headers, timeout=10)

    assert call("search", {"q": 1}, "t-1", 4, 0).status_code == 200
    assert call("search", {"q": 2, "sleep_s": 0.05}, "t-1", 4, 1).status_code == 200
    assert call("code", {"sleep_s": 5}, "t-1", 4, 1, deadline_ms=100).status_code == 504
    assert call("search", {"q": 3}, "t-2", 4, 0).status_code == 200
    assert call("search", {"q": 4}, None, 4, 0).status_code == 200  # not captured
    pass_through = httpx.post(
        gw.url + "/retrieve", json={}, timeout=10, headers={"X-Trajectory-Id": "t-3"}
    )
    assert pass_through.status_code == 404  # no search-kind tool: nothing called, nothing captured
    gw.stop()  # flushes the writer

    raw = [json.loads(line) for line in capture.read_text().splitlines()]
    assert len(raw) == 4
    records = list(read_captured_calls(capture))
    assert [(r.trajectory_id, r.step, r.turn, r.tool_name, r.status) for r in records] == [
        ("t-1", 4, 0, "search", "success"),
        ("t-1", 4, 1, "search", "success"),
        ("t-1", 4, 1, "code", "timeout"),
        ("t-2", 4, 0, "search", "success"),
    ]
    # the upstream's and the gateway's timers run on uvloop, whose timers count whole
    # milliseconds: a 50 ms sleep or a 100 ms deadline may end up to 1 ms early
    assert records[1].latency_s >= 0.049 and records[2].latency_s >= 0.099
    assert records[0].response_bytes > 0 and records[2].response_bytes == 0

    out = tmp_path / "multiturn_workload_step_4.jsonl"
    result = CliRunner().invoke(
        toolenv_app, ["gateway", "trace-to-multiturn", str(capture), str(out)]
    )
    assert result.exit_code == 0, result.output
    trajectories = list(read_multiturn(out))
    assert [t.trajectory_id for t in trajectories] == ["t-1", "t-2"]
    assert [len(t.tool_calls) for t in trajectories] == [3, 1]
    assert [c.turn for c in trajectories[0].tool_calls_after(1)] == [1, 1]
    latencies = tool_latencies([out], "search")  # what `toolenv emulators fit` reads
    assert len(latencies) == 3 and latencies.max() >= 0.05


def test_a_bad_call_record_is_dropped_alone_and_counted(tmp_path) -> None:
    async def main() -> TraceWriter:
        writer = TraceWriter(tmp_path / "capture.jsonl", flush_interval_s=0.01)
        await writer.start()
        good = {
            "tool_name": "search",
            "turn": 1,
            "latency_s": 0.01,
            "trajectory_id": "t",
            "step": 2,
        }
        writer.record(good)
        writer.record({**good, "latency_s": -1.0})  # not a ToolCallRecord: negative latency
        writer.record({**good, "turn": 2})
        await writer.close()
        return writer

    writer = asyncio.run(main())
    records = list(read_captured_calls(tmp_path / "capture.jsonl"))
    assert [r.turn for r in records] == [1, 2]
    assert records[0].step == 2 and records[0].trajectory_id == "t"
    assert writer.written == 2 and writer.invalid == 1 and writer.dropped == 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (every write fails)")
def test_a_capture_whose_writes_fail_says_so_at_once_and_still_shuts_down(caplog) -> None:
    """Before: the writer task died on the first failed write (a full disk) and said nothing until
    shut-down; once the queue was full, shut-down waited on it forever."""
    caplog.set_level(logging.INFO, logger="toolenv.gateway")
    call = {"tool_name": "search", "turn": 0, "latency_s": 0.01, "trajectory_id": "t"}

    def stopped() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.getMessage().startswith("trace capture stopped")]

    async def main() -> TraceWriter:
        writer = TraceWriter("/dev/full", max_pending=4, flush_interval_s=0.001)
        await writer.start()  # opening /dev/full works; every write to it fails (ENOSPC)
        writer.record(call)
        for _ in range(1000):  # until the writer has tried (and failed) to write it
            if stopped() or writer._task.done():
                break
            await asyncio.sleep(0.005)
        for _ in range(10):  # more than the queue holds: some dropped at the door
            writer.record(call)
        await asyncio.wait_for(writer.close(), 10)  # hung here before
        return writer

    writer = asyncio.run(main())
    assert len(stopped()) == 1 and vars(stopped()[0])["trace_path"] == "/dev/full"
    assert writer.written == 0 and writer.dropped == 11
    # one error line, as the docs say: closing the file (its buffer flushed once more, failing
    # again) added "trace writer did not finish: [Errno 28] No space left on device"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["trace capture stopped: calls from now on are not recorded"], errors


@pytest.mark.parametrize(
    ("name", "value"),
    [("X-Turn", "-3"), ("X-Turn", "two"), ("X-Turn", "1.5"), ("X-Step", "-1"), ("X-Step", "²")],
)
def test_a_malformed_turn_or_step_header_is_a_400_naming_it(
    upstream, gateway, tmp_path, name, value
) -> None:
    """Before: `X-Turn: -3` was recorded as turn 0 and a bad `X-Step` as no step, silently."""
    up = upstream("a")
    capture = tmp_path / "capture.jsonl"
    gw = gateway([proxy_tool("search", up.url, kind="search")], trace_path=str(capture))
    headers = {"X-Trajectory-Id": "t-1", "X-Step": "0", "X-Turn": "0"}
    headers[name] = value.encode("latin-1")  # as sent on the wire (httpx sends str as ASCII)
    for path, body in (("/v1/tools/search/call", {"arguments": {}}), ("/retrieve", {})):
        r = httpx.post(gw.url + path, json=body, headers=headers, timeout=10)
        assert r.status_code == 400, (path, r.text)
        detail = r.json()["detail"]
        assert detail == f"{name} must be a non-negative integer (0, 1, 2, ...), got {value!r}"
        assert r.json()["request_id"]
    gw.stop()
    assert up.stats()["started"] == 0  # the tool never saw the call
    assert not capture.exists() or capture.read_text() == ""


@pytest.mark.parametrize("framing", ["content-length", "chunked"])  # the lane; the app's path
def test_a_step_or_turn_past_a_64_bit_count_is_a_400_and_the_largest_is_recorded(
    upstream, gateway, tmp_path, framing
) -> None:
    """Before: `X-Step` / `X-Turn` of 5000 digits was a 500 (Python's int conversion limit), and
    one of 26 digits was recorded as the step."""
    up = upstream("a")
    capture = tmp_path / "capture.jsonl"
    gw = gateway([proxy_tool("search", up.url, kind="search")], trace_path=str(capture))

    def post(name: str, value: str) -> httpx.Response:
        headers = {"X-Trajectory-Id": "t-big", name: value}
        data = json.dumps({"arguments": {}}).encode()
        content = iter([data]) if framing == "chunked" else data  # an iterator is sent chunked
        return httpx.post(
            gw.url + "/v1/tools/search/call", content=content, headers=headers, timeout=10
        )

    for name in ("X-Step", "X-Turn"):
        for value in ("9" * 5000, str(2**63)):
            r = post(name, value)
            assert r.status_code == 400, (name, len(value), r.text)
            assert r.json()["detail"].startswith(f"{name} must be at most {2**63 - 1} ")
    assert up.stats()["started"] == 0  # the tool never saw those
    assert post("X-Step", "0" * 30 + str(2**63 - 1)).status_code == 200
    assert post("X-Step", "0" * 5000 + "7").status_code == 200  # leading zeros: still 7
    gw.stop()
    records = list(read_captured_calls(capture))
    assert [r.step for r in records] == [2**63 - 1, 7]


def test_a_trajectory_id_over_256_characters_is_a_400_and_256_is_fine(
    upstream, gateway, tmp_path
) -> None:
    """Before: a longer `X-Trajectory-Id` was cut to 256 characters in the capture, silently (two
    trajectories sharing their first 256 characters were merged)."""
    up = upstream("a")
    capture = tmp_path / "capture.jsonl"
    gw = gateway([proxy_tool("search", up.url, kind="search")], trace_path=str(capture))
    for path, body in (("/v1/tools/search/call", {"arguments": {}}), ("/retrieve", {})):
        r = httpx.post(gw.url + path, json=body, headers={"X-Trajectory-Id": "t" * 257}, timeout=10)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["detail"] == (
            "X-Trajectory-Id must be at most 256 characters, got 257 (send a shorter id, "
            "e.g. a hash of the long one)"
        )
    assert up.stats()["started"] == 0
    r = httpx.post(
        gw.url + "/retrieve", json={}, headers={"X-Trajectory-Id": "t" * 256}, timeout=10
    )
    assert r.status_code == 200, r.text
    gw.stop()
    assert [r.trajectory_id for r in read_captured_calls(capture)] == ["t" * 256]


def test_a_utf8_trajectory_id_is_captured_as_sent(upstream, gateway, tmp_path) -> None:
    """Header bytes reach the app decoded as Latin-1: a UTF-8 id ("t-é", 4 bytes) was recorded
    as "t-Ã©". Bytes that are not UTF-8 keep their Latin-1 reading."""
    up = upstream("a")
    capture = tmp_path / "capture.jsonl"
    gw = gateway([proxy_tool("search", up.url, kind="search")], trace_path=str(capture))
    for raw in ("t-é".encode(), "траектория-2".encode()):
        for path, body in (("/v1/tools/search/call", {"arguments": {}}), ("/retrieve", {})):
            r = httpx.post(gw.url + path, json=body, headers={"X-Trajectory-Id": raw}, timeout=10)
            assert r.status_code == 200, (path, r.text)
    gw.stop()
    ids = [r.trajectory_id for r in read_captured_calls(capture)]
    assert ids == ["t-é", "t-é", "траектория-2", "траектория-2"]
    assert trajectory_header(b"t-\xe9".decode("latin-1")) == "t-\xe9"  # not UTF-8: as read
    assert trajectory_header("t-1") == "t-1"


@pytest.mark.parametrize("where", ["under_a_file", "a_directory"])
def test_a_trace_path_that_cannot_be_written_is_one_settings_line(tmp_path, where) -> None:
    """Before: a `trace_path` under a file was a traceback from the server's start-up (exit 3),
    and a directory started a gateway whose capture recorded nothing, silently."""
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "capture.jsonl" if where == "under_a_file" else tmp_path
    with pytest.raises(ValueError, match=r"^invalid gateway settings: trace_path: cannot append"):
        create_app(GatewaySettings(trace_path=str(path)))
    if where == "under_a_file":  # through the CLI (the directory case would start serving)
        args = ["gateway", "serve", "--port", "1"]
        result = CliRunner().invoke(
            toolenv_app, args, env={"TOOLENV_GATEWAY_TRACE_PATH": str(path)}
        )
        assert result.exit_code == 2, (result.output, result.exception)
        assert result.stderr.startswith(
            "error: invalid gateway settings: trace_path: cannot append to "
            f"{path} ({tmp_path / 'file'} is not a directory)"
        ), result.stderr
        assert result.stderr.count("\n") == 1


def _hang_up(url: str, path: str, body: dict, headers: dict[str, str]) -> None:
    """Send a call and hang up before its answer (the client's read timeout closes the socket)."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + path, json=body, headers=headers, timeout=0.3)


def test_a_call_whose_caller_hung_up_is_captured_too(upstream, gateway, tmp_path) -> None:
    """Before: a call ended by its caller hanging up (an RL client aborting a rollout) was
    counted in `caller_gone` but left no line in the capture, so the trace held fewer calls than
    the gateway served (and none of the aborted ones a replay should reproduce)."""
    up = upstream("slow")
    capture = tmp_path / "capture.jsonl"
    gw = gateway([proxy_tool("search", up.url, kind="search")], trace_path=str(capture))
    calls = [("/retrieve", {"sleep_s": 30}), ("/v1/tools/search/call", {"arguments": {"sleep_s": 30}})]  # fmt: skip
    for turn, (path, body) in enumerate(calls):
        _hang_up(
            gw.url, path, body, {"X-Trajectory-Id": "gone", "X-Step": "2", "X-Turn": str(turn)}
        )
    runtime = gw.toolset.tools["search"]
    for _ in range(100):  # until the gateway has seen both callers go
        if runtime.m.outcomes["caller_gone"].value == 2:
            break
        time.sleep(0.02)
    gw.stop()  # flushes the writer
    records = list(read_captured_calls(capture))
    assert [(r.trajectory_id, r.step, r.turn, r.status) for r in records] == [
        ("gone", 2, 0, "caller_gone"),
        ("gone", 2, 1, "caller_gone"),
    ]
    assert all(0.25 <= r.latency_s < 5 and r.response_bytes == 0 for r in records), records


def test_a_call_cut_by_the_shutdown_is_labelled_so_not_as_its_caller_gone(
    upstream, gateway, tmp_path, caplog
) -> None:
    """Before: a call still running when the shutdown grace ran out (answered 503) was counted,
    captured and logged as `caller_gone`, though its caller was still waiting for it; on the
    lane (a Content-Length body) and on the ordinary path (a chunked body) alike."""
    caplog.set_level(logging.INFO, logger="toolenv.gateway")
    up = upstream("slow")
    capture = tmp_path / "capture.jsonl"
    gw = gateway([proxy_tool("search", up.url, kind="search")], trace_path=str(capture))
    body = json.dumps({"arguments": {"sleep_s": 30}}).encode()
    answers: dict[str, httpx.Response | Exception] = {}

    def send(turn: int, content: object) -> None:
        try:
            answers[str(turn)] = httpx.post(
                gw.url + "/v1/tools/search/call", content=content, timeout=30,
                headers={"content-type": "application/json", "X-Trajectory-Id": "cut",
                         "X-Turn": str(turn)},
            )  # fmt: skip
        except httpx.HTTPError as exc:
            answers[str(turn)] = exc

    threads = [
        threading.Thread(target=send, args=(0, body)),  # the lane
        threading.Thread(target=send, args=(1, iter([body]))),  # chunked: the ordinary path
    ]
    for thread in threads:
        thread.start()
    for _ in range(100):  # both calls are at the upstream
        if up.stats()["started"] == 2:
            break
        time.sleep(0.05)
    gw.stop()  # the test server's grace is 2 s: both calls are cut then
    for thread in threads:
        thread.join(timeout=10)
    assert all(isinstance(r, httpx.Response) and r.status_code == 503 for r in answers.values())
    outcomes = gw.toolset.tools["search"].m.outcomes
    assert (outcomes["cut_by_shutdown"].value, outcomes["caller_gone"].value) == (2, 0)
    records = sorted(read_captured_calls(capture), key=lambda r: r.turn)
    assert [(r.turn, r.status) for r in records] == [(0, "cut_by_shutdown"), (1, "cut_by_shutdown")]
    logged = [getattr(r, "outcome", None) for r in caplog.records if r.getMessage() == "tool call"]
    assert logged == ["cut_by_shutdown", "cut_by_shutdown"], logged


def test_a_restart_on_a_torn_capture_cuts_the_torn_record_and_appends_whole_lines(
    tmp_path, caplog
) -> None:
    """Before: a gateway killed mid-write left a record without its newline, and the restarted
    gateway appended its first record to it: one line that was not JSON, mid-capture, so
    `trace-to-multiturn` refused the whole capture (exit 2) and that new record was lost too."""
    caplog.set_level(logging.WARNING, logger="toolenv.gateway")
    capture = tmp_path / "capture.jsonl"
    whole = {"tool_name": "search", "turn": 0, "latency_s": 0.01, "trajectory_id": "before"}
    capture.write_text(json.dumps(whole) + '\n{"turn":0,"tool_name":"sea')
    after = {**whole, "trajectory_id": "after"}

    async def main() -> None:
        writer = TraceWriter(capture, flush_interval_s=0.001)
        await writer.start()
        writer.record(after)
        await writer.close()

    asyncio.run(main())
    assert [c.trajectory_id for c in read_captured_calls(capture)] == ["before", "after"]
    cut = [r for r in caplog.records if r.getMessage().startswith("trace capture: the file ended")]
    assert len(cut) == 1 and vars(cut[0])["cut_bytes"] == len('{"turn":0,"tool_name":"sea')
    result = CliRunner().invoke(
        toolenv_app, ["gateway", "trace-to-multiturn", str(capture), str(tmp_path / "out.jsonl")]
    )
    assert result.exit_code == 0, result.output


def test_a_capture_moved_or_removed_goes_on_in_a_new_file_at_its_path(tmp_path, caplog) -> None:
    """Before: the writer kept the file it opened, so after a rotation (`mv capture.jsonl
    capture.1`) every later call went into the moved file and none to `trace_path`, and after an
    `rm` they went nowhere (counted written all the same)."""
    caplog.set_level(logging.WARNING, logger="toolenv.gateway")
    capture = tmp_path / "capture.jsonl"

    def call(trajectory: str) -> dict:
        return {"tool_name": "search", "turn": 0, "latency_s": 0.01, "trajectory_id": trajectory}

    async def main() -> None:
        writer = TraceWriter(capture, flush_interval_s=0.001)
        await writer.start()

        async def written(n: int) -> None:
            for _ in range(1000):
                if writer.written == n:
                    return
                await asyncio.sleep(0.005)
            raise AssertionError(f"{writer.written} written, not {n}")

        writer.record(call("first"))
        await written(1)
        capture.rename(tmp_path / "capture.1")  # rotated
        writer.record(call("second"))
        await written(2)
        (tmp_path / "capture.1").rename(tmp_path / "kept")
        capture.unlink()  # removed
        writer.record(call("third"))
        await written(3)
        await writer.close()

    asyncio.run(main())
    assert [c.trajectory_id for c in read_captured_calls(tmp_path / "kept")] == ["first"]
    assert [c.trajectory_id for c in read_captured_calls(capture)] == ["third"]
    moved = [r for r in caplog.records if r.getMessage().startswith("trace capture: the file was")]
    assert len(moved) == 2


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path) -> None:
    """Only a torn record is cut: a whole one lacking just its newline is ended with one."""
    capture = tmp_path / "capture.jsonl"
    whole = {"tool_name": "search", "turn": 0, "latency_s": 0.01, "trajectory_id": "kept"}
    capture.write_text(json.dumps(whole))

    async def main() -> None:
        writer = TraceWriter(capture, flush_interval_s=0.001)
        await writer.start()
        writer.record({**whole, "trajectory_id": "new"})
        await writer.close()

    asyncio.run(main())
    assert [c.trajectory_id for c in read_captured_calls(capture)] == ["kept", "new"]
