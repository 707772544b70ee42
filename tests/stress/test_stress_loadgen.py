"""The load generator's client against real loopback servers (uvicorn + httptools in a subprocess)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from stress import (
    BODY_KEY,
    LoadSpec,
    LoadSpecError,
    RemoteTargetError,
    arun_load,
    check_loopback,
    loop,
    run_load,
)
from stress.spec import schedule_offsets
from stress.testing import serve
from toolenv_core.net import free_port


@pytest.mark.parametrize("path", ["/plain", "/chunked", "/close"])
def test_bodies_and_connection_close_all_complete(zero_server: str, path: str) -> None:
    result = run_load(LoadSpec(url=zero_server + path, body={"q": 1}, rate=200, duration_s=0.5))
    summary = result.summary()
    assert result.n == 100
    assert summary["outcomes"]["ok"]["count"] == 100, summary["outcomes"]
    assert summary["status_counts"] == {"200": 100}
    # scheduled <= sent <= done for every request
    assert np.all(result.sent >= result.scheduled - 1e-9)
    assert np.all(result.done >= result.sent)


def test_http_errors_are_counted_by_status(zero_server: str) -> None:
    result = run_load(LoadSpec(url=zero_server + "/status/503", rate=100, duration_s=0.5))
    summary = result.summary()
    assert summary["status_counts"] == {"503": 50}
    assert set(summary["outcomes"]) == {"http_503"}
    assert summary["error_rate"] == 1.0


def test_captured_header_per_request(zero_server: str) -> None:
    result = run_load(
        LoadSpec(
            url=zero_server + "/x",
            rate=100,
            duration_s=0.3,
            capture_headers=["X-Toolenv-Injected-Delay-Ms"],
        )
    )
    values = result.captured_values("X-Toolenv-Injected-Delay-Ms")
    assert len(values) == 30 and all(v == "0.000" for v in values)
    assert result.records[0].headers == {"X-Toolenv-Injected-Delay-Ms": "0.000"}


@pytest.mark.parametrize(
    ("path", "limit", "want"),
    [
        ("/plain", 4096, '{"ok":true}'),
        ("/chunked", 4096, '{"parts":[1,2,3]}'),
        ("/chunked", 12, '{"parts":[1,'),
    ],
)
def test_body_prefix_is_kept_only_when_asked(
    zero_server: str, path: str, limit: int, want: str
) -> None:
    spec = LoadSpec(
        url=zero_server + path, arrival="closed", concurrency=2, max_requests=20, duration_s=5
    )
    assert all(r.headers == {} for r in run_load(spec).records)
    spec.capture_body_bytes = limit
    result = run_load(spec)
    assert result.n == 20
    assert result.captured_values(BODY_KEY) == [want] * 20


def test_connection_refused_is_an_error_not_a_hang() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connects are refused
        result = run_load(
            LoadSpec(url=f"http://127.0.0.1:{port}/", rate=100, duration_s=0.3, timeout_s=2)
        )
    assert result.summary()["outcomes"]["connect_error"]["count"] == 30
    # each kind of error once (the same refusal was listed five times)
    assert len(result.connect_errors) == 1 and "refused" in result.connect_errors[0].lower()


def test_server_that_resets_mid_request_counts_connection_closed() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def accept_and_close() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
            conn.close()

    thread = threading.Thread(target=accept_and_close, daemon=True)
    thread.start()
    try:
        result = run_load(
            LoadSpec(url=f"http://127.0.0.1:{port}/", rate=50, duration_s=0.2, timeout_s=2)
        )
    finally:
        stop.set()
        thread.join()
        listener.close()
    assert set(result.summary()["outcomes"]) == {"connection_closed"}


def test_a_connect_that_times_out_says_so() -> None:
    """A listener whose accept queue is full drops the SYNs: the connect timed out and the
    report's line read "connect errors: TimeoutError: " with nothing after it."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # one queued connection, never accepted; the rest time out
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/x"
        result = run_load(LoadSpec(url=url, rate=20, duration_s=0.2, timeout_s=0.3, preconnect=0))
    assert "connect_error" in result.summary()["outcomes"]
    assert result.connect_errors == ["TimeoutError: no connection within the 0.3 s timeout"]


def test_head_requests_end_with_the_answers_head(zero_server: str) -> None:
    """A HEAD answer declares its GET's Content-Length and sends no body: every request waited
    for that body and timed out ("the target never answered", exit 3)."""
    spec = LoadSpec(url=zero_server + "/x", method="HEAD", arrival="closed", concurrency=1,
                    max_requests=5, duration_s=10, timeout_s=3)  # fmt: skip
    result = run_load(spec)
    assert result.summary()["status_counts"] == {"200": 5}  # one connection, kept alive


def test_a_host_header_replaces_the_urls() -> None:
    """`-H 'Host: api.example'` (a virtual host) was sent beside the URL's: two Host headers."""
    heads: list[bytes] = []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)

        def answer_one() -> None:
            conn, _ = listener.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(4096)
                heads.append(data.split(b"\r\n\r\n")[0])
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

        thread = threading.Thread(target=answer_one, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/x"
        spec = LoadSpec(url=url, headers={"HOST": "api.example"}, max_requests=1, connections=1)
        result = run_load(spec)
        thread.join(5)
    assert result.summary()["status_counts"] == {"200": 1}
    hosts = [line for line in heads[0].split(b"\r\n") if line.lower().startswith(b"host:")]
    assert hosts == [b"host: api.example"]


def test_timeout_is_enforced(zero_server: str) -> None:
    with serve("uniform", low_ms=800, high_ms=800) as url:
        result = run_load(LoadSpec(url=url + "/x", rate=20, duration_s=0.25, timeout_s=0.2))
    summary = result.summary()
    assert summary["outcomes"]["timeout"]["count"] == 5
    assert summary["timeout_rate"] == 1.0
    # timed out after about timeout_s, not after the server's 800 ms
    assert summary["outcomes"]["timeout"]["uncorrected_ms"]["max"] < 600


def test_a_request_that_waited_for_a_connection_has_its_timeout_from_its_schedule() -> None:
    """One connection, 1 s answers, due at 0 and 0.1 s: the second waits for the first (until
    1 s) and its answer comes at 2 s, 1.9 s after its schedule. It was `ok` under a 1.6 s timeout
    (the timer started at its send, 1 s late); its timeout runs from its schedule."""
    with serve("uniform", low_ms=1000, high_ms=1000) as url:
        spec = LoadSpec(url=url + "/x", rate=10, duration_s=0.2, connections=1, timeout_s=1.6)
        result = run_load(spec)
    assert [r.outcome for r in result.records] == ["ok", "timeout"], result.records
    assert 1600 <= result.records[1].latency_ms < 1900  # its timeout, not its answer's 1.9 s


def test_closed_loop_keeps_n_callers(zero_server: str) -> None:
    result = run_load(
        LoadSpec(url=zero_server + "/x", arrival="closed", concurrency=4, duration_s=0.5)
    )
    assert result.n > 50
    assert result.summary()["outcomes"]["ok"]["count"] == result.n
    # never more than 4 outstanding: at each send, at most 3 others are between sent and done
    sent, done = result.sent, result.done
    for i in range(0, result.n, max(1, result.n // 50)):
        overlap = np.count_nonzero((sent <= sent[i]) & (done > sent[i]))
        assert overlap <= 4


def test_a_closed_loop_has_room_for_its_whole_request_cap(
    zero_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its per-request arrays held at most a million: a closed loop under --max-requests 5000000
    stopped at 1,000,000 requests and reported "stopped by --duration"."""
    sizes: list[int] = []

    class Sized(loop.Recorder):
        def __init__(self, capacity: int) -> None:
            sizes.append(capacity)
            super().__init__(capacity)

    monkeypatch.setattr(loop, "Recorder", Sized)
    spec = LoadSpec(url=zero_server + "/x", arrival="closed", concurrency=1,
                    max_requests=1_500_000, duration_s=0.1)  # fmt: skip
    run_load(spec)
    assert sizes == [1_500_000]


def test_request_cap_bounds_the_run(zero_server: str) -> None:
    result = run_load(LoadSpec(url=zero_server + "/x", rate=1000, duration_s=5, max_requests=40))
    assert result.n == 40


def test_poisson_arrivals_are_seeded_and_have_the_rate(zero_server: str) -> None:
    spec = dict(url=zero_server + "/x", rate=400, duration_s=1.0, arrival="poisson", seed=7)
    a, b = run_load(LoadSpec(**spec)), run_load(LoadSpec(**spec))
    assert np.array_equal(a.scheduled, b.scheduled)
    assert 300 < a.n < 500
    gaps = np.diff(a.scheduled)
    assert np.std(gaps) > 0.5 * np.mean(gaps)  # exponential gaps, not constant


def test_a_poisson_schedule_fills_its_window() -> None:
    """A Poisson schedule drew exactly rate x duration gaps: in 45% of 20 s runs at 200 rps they
    ran out before the end (up to 0.7 s without a request), the count never went above 4,000
    and its mean fell short. Now the count is random, as a Poisson process's is."""
    spec = dict(url="http://127.0.0.1:9/", arrival="poisson", rate=200, duration_s=20.0)
    runs = [schedule_offsets(LoadSpec(**spec, seed=seed)) for seed in range(200)]
    counts = np.array([len(o) for o in runs])
    assert min(o[-1] for o in runs) > 19.9
    assert np.mean(counts > 4000) > 0.3
    assert abs(counts.mean() - 4001) < 15  # the first at 0, then Poisson(4000); sd/sqrt(200) 4.5
    capped = LoadSpec(**spec, seed=1, max_requests=4000)
    assert len(schedule_offsets(capped)) == 4000 and capped.request_cap() == 4000


async def test_arun_load_inside_a_running_loop(zero_server: str) -> None:
    result = await arun_load(LoadSpec(url=zero_server + "/x", rate=100, duration_s=0.2))
    assert result.summary()["outcomes"]["ok"]["count"] == 20


def test_precise_sends_leave_on_schedule_not_a_loop_tick_late(zero_server: str) -> None:
    """Open loop at 500 rps, Poisson: sends woken by the loop's millisecond timers lag their
    schedule by a fraction of a millisecond at the median; woken by a timerfd 0.1 ms early and
    polled for the rest, they leave within microseconds of it (a quarter of them at least, and
    the median well below the loop's), and never before. The median alone read 0.05-0.09 ms on
    a machine whose process was often descheduled, against 0.30-0.43 ms for the loop's timers:
    a fixed 0.05 ms bound on it failed there."""
    spec = dict(url=zero_server + "/x", rate=500, duration_s=1.0, arrival="poisson", seed=3)
    loop_timers = run_load(LoadSpec(**spec)).scheduling_error_ms
    precise = run_load(LoadSpec(**spec, precise_sends=True, spin_s=0.0001)).scheduling_error_ms
    assert precise.min() >= 0
    assert np.percentile(precise, 25) < 0.01, np.percentile(precise, [25, 50])
    assert np.median(precise) < 0.5 * np.median(loop_timers), (precise, loop_timers)


def test_unbounded_or_bad_specs_are_refused() -> None:
    with pytest.raises(LoadSpecError, match="duration_s"):
        run_load(LoadSpec(url="http://127.0.0.1:1/", duration_s=0))
    with pytest.raises(LoadSpecError, match="max_requests"):
        run_load(LoadSpec(url="http://127.0.0.1:1/", max_requests=0))
    with pytest.raises(LoadSpecError, match="rate"):
        run_load(LoadSpec(url="http://127.0.0.1:1/", rate=-1))


def test_remote_targets_are_refused_unless_allowed() -> None:
    check_loopback("127.0.0.1", allow_remote=False)
    check_loopback("127.3.4.5", allow_remote=False)
    check_loopback("::1", allow_remote=False)
    check_loopback("localhost", allow_remote=False)
    with pytest.raises(RemoteTargetError, match="--allow-remote"):
        check_loopback("10.1.2.3", allow_remote=False)
    with pytest.raises(RemoteTargetError, match="--allow-remote"):
        run_load(LoadSpec(url="http://192.0.2.1:80/", duration_s=1))
    check_loopback("10.1.2.3", allow_remote=True)


@pytest.fixture(scope="module")
def fastapi_server() -> str:
    """A FastAPI app on uvicorn (in a thread): JSON, a streamed (chunked) body, a 500."""
    app = FastAPI()

    @app.post("/json")
    async def as_json(body: dict) -> dict:
        return {"echo": body}

    @app.post("/stream")
    async def stream() -> StreamingResponse:
        async def parts():
            for i in range(3):
                await asyncio.sleep(0.002)
                yield f"part{i}\n".encode()

        return StreamingResponse(parts(), media_type="text/plain")

    @app.post("/boom")
    async def boom() -> dict:
        raise RuntimeError("boom")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.mark.parametrize(
    "path, outcome",
    [("/json", "ok"), ("/stream", "ok"), ("/boom", "http_500")],
)
def test_against_fastapi(fastapi_server: str, path: str, outcome: str) -> None:
    result = run_load(
        LoadSpec(url=fastapi_server + path, body={"a": [1, 2]}, rate=100, duration_s=0.3)
    )
    assert set(result.summary()["outcomes"]) == {outcome}
    assert result.summary()["outcomes"][outcome]["count"] == 30
    if path == "/stream":  # the streamed body took >= 3 x 2 ms to arrive: we waited for all of it
        assert result.summary()["outcomes"]["ok"]["uncorrected_ms"]["p50"] >= 6.0


def test_max_in_flight_drops_rather_than_queueing_without_bound() -> None:
    with serve("uniform", low_ms=600, high_ms=600) as url:
        result = run_load(LoadSpec(url=url + "/x", rate=200, duration_s=0.5, max_in_flight=40))
    outcomes = result.summary()["outcomes"]
    # 100 due within 0.5 s, each held 600 ms: only the first 40 can be out at once
    assert outcomes["ok"]["count"] == 40
    assert outcomes["dropped"]["count"] == 60
    assert np.all(np.isnan(result.sent[result.outcomes == "dropped"]))
    # 40 sent over the 0.5 s schedule: 80 rps, not the target's 200 (the span of the sends)
    assert 70 < result.achieved_rate < 90
