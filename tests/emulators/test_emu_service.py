"""The emulator service on a real server on loopback: delays, deadlines, faults, bad input."""

from __future__ import annotations

import json
import socket
import sys
import time

import httpx
import numpy as np
import pytest
from emu_support import FAST, INJECTED, LEAD, TIMER, start_server
from scipy import stats
from testkit import ServerProcess, free_port

from stress import LoadSpec, arun_load
from toolenv_core.latency import load_profile
from toolenv_core.latency.profile import shipped_profile_path


def test_exact_replay_delay_and_headers(client: httpx.Client) -> None:
    started = time.monotonic()
    r = client.post("/v1/emulators/search/call", json={"query": "q", "delay_s": 0.25})
    elapsed = time.monotonic() - started
    assert r.status_code == 200 and r.headers[INJECTED] == "250.000"
    assert 0.25 <= elapsed < 1.5
    # the handler woke on purpose `lead` early (the response path it measured), never earlier
    lead = float(r.headers[LEAD])
    assert 0 <= lead <= 2.0
    assert 0 <= float(r.headers[TIMER]) + lead < 50


def test_the_pacing_lead_is_learnt_from_the_replies(client: httpx.Client) -> None:
    """Every reply takes some time to be written after the handler wakes: the lead grows from 0."""
    client.put(
        "/v1/emulators/reward/profile",
        json={"tool": "reward", "model": {"kind": "constant", "value_s": 0.001}, "source": "t"},
    ).raise_for_status()
    leads = [
        float(client.post("/v1/emulators/reward/call", json={"batch_size": 1}).headers[LEAD])
        for _ in range(60)
    ]
    assert min(leads) >= 0 and leads[-1] > 0  # replies left late, so it wakes earlier now
    assert max(leads) <= 2.0  # bounded: a stall never makes replies leave early by more


@pytest.mark.parametrize(
    ("path", "body", "status", "loc"),
    [
        ("/retrieve", {"queries": []}, 422, ["body", "queries"]),
        ("/retrieve", {"queries": ["ok", "  "]}, 422, ["body", "queries", 1]),
        ("/retrieve", {"queries": ["q"], "topk": 0}, 422, ["body", "topk"]),
        ("/retrieve", {"queries": ["q"], "topk": 51}, 422, ["body", "topk"]),
        ("/retrieve", {"topk": 3}, 422, ["body", "queries"]),
        ("/v1/emulators/search/call", {}, 422, ["body", "query"]),
        ("/v1/emulators/search/call", {"query": "a", "queries": ["b"]}, 422, ["body", "query"]),
        ("/v1/emulators/search/call", {"queries": []}, 422, ["body", "queries"]),
        ("/v1/emulators/search/call", {"query": "a", "delay_s": -1}, 422, ["body", "delay_s"]),
        (
            "/v1/emulators/search/call",
            {"query": "a", "response_tokens": 3},
            422,
            ["body", "response_tokens"],
        ),
        ("/v1/emulators/search/call", {"query": "a", "colour": "red"}, 422, ["body", "colour"]),
        (
            "/v1/emulators/reward/call",
            {"batch_size": 2, "response_lengths": [1]},
            422,
            ["body", "response_lengths"],
        ),
        ("/v1/emulators/reward/call", {"batch_size": 0}, 422, ["body", "batch_size"]),
        # a JSON boolean is not read as 1 (`topk: true` was one document)
        ("/retrieve", {"queries": ["q"], "topk": True}, 422, ["body", "topk"]),
        ("/v1/emulators/search/call", {"query": "a", "delay_s": True}, 422, ["body", "delay_s"]),
        ("/v1/emulators/search/call", {"query": "a", "step": True}, 422, ["body", "step"]),
        ("/v1/emulators/reward/call", {"batch_size": True}, 422, ["body", "batch_size"]),
        (
            "/v1/emulators/reward/call",
            {"response_lengths": [3, True]},
            422,
            ["body", "response_lengths", 1],
        ),
    ],
)
def test_bad_input_statuses(
    client: httpx.Client, path: str, body: dict, status: int, loc: list
) -> None:
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["detail"][0]["loc"] == loc


def test_bad_headers_and_unknown_paths(client: httpx.Client) -> None:
    r = client.post("/retrieve", json={"queries": ["q"]}, headers={"X-Toolenv-Deadline-Ms": "soon"})
    assert r.status_code == 400 and "X-Toolenv-Deadline-Ms" in r.json()["detail"]
    for bad in (b"not json", b"[" * 100_000 + b"]" * 100_000):  # too deep: a 500 before
        malformed = client.post("/retrieve", content=bad)
        assert malformed.status_code == 400
        assert malformed.json() == {"detail": "request body is not valid JSON"}
    assert client.post("/v1/emulators/nope/call", json={}).status_code == 404


def test_deadline_cuts_a_slow_call_at_the_deadline(client: httpx.Client) -> None:
    client.put("/v1/emulators/search/profile", json={"model": {"kind": "constant", "value_s": 5}})
    started = time.monotonic()
    r = client.post("/retrieve", json={"queries": ["q"]}, headers={"X-Toolenv-Deadline-Ms": "300"})
    elapsed = time.monotonic() - started
    assert r.status_code == 504 and "deadline" in r.json()["detail"]
    assert r.headers["x-toolenv-deadline-expired"] == "1"
    assert 0.29 <= elapsed < 1.0
    assert 295 <= float(r.headers[INJECTED]) <= 301


def test_an_unbounded_draw_is_cut_at_the_deadline_not_a_500(client: httpx.Client) -> None:
    """sigma 1e6 (a typo): about half the draws overflow the float range. Each such call is a
    504 at the deadline saying so; it was a 500 with a traceback (exp() overflow, then an
    infinite `delay_s` in the JSON body). An overflowed draw is capped at `max_delay_s` (3600)
    like any other."""
    wide = {"model": {"kind": "lognormal", "median_s": 0.1, "sigma": 1e6}}
    assert client.put("/v1/emulators/search/profile", json=wide).status_code == 200
    answers = [
        client.post("/retrieve", json={"queries": ["q"]}, headers={"X-Toolenv-Deadline-Ms": "50"})
        for _ in range(20)
    ]
    assert {r.status_code for r in answers} == {200, 504}, [r.text for r in answers]
    cut = next(r for r in answers if r.status_code == 504).json()
    assert cut["delay_s"] == 3600.0 and "takes 3.6e+03 s, past" in cut["detail"]


@pytest.mark.parametrize("fault", ["hang", "throttle", "error", "slow_body"])
def test_faults_on_the_wire(client: httpx.Client, fault: str) -> None:
    spec = {"type": fault, "rate": 1.0}
    if fault == "throttle":
        spec["retry_after_s"] = 2.5
    if fault == "error":
        spec["status"] = 504  # the tool's own 504, not the deadline's
    if fault == "slow_body":
        spec |= {"duration_s": 0.4, "chunks": 4}
    client.put(
        "/v1/emulators/search/profile",
        json={
            "model": {
                "kind": "faulty",
                "model": {"kind": "constant", "value_s": 0.05},
                "faults": [spec],
            }
        },
    )
    started = time.monotonic()
    r = client.post("/retrieve", json={"queries": ["q"]}, headers={"X-Toolenv-Deadline-Ms": "400"})
    elapsed = time.monotonic() - started
    assert r.headers["x-toolenv-fault"] == fault
    # a 504 at the deadline says so (the gateway's timeout); an error fault's 504 would not
    assert (r.headers.get("x-toolenv-deadline-expired") == "1") == (fault == "hang")
    if fault == "hang":  # no answer until the caller's deadline, then 504 - never later
        assert r.status_code == 504 and 0.395 <= elapsed < 1.0
    elif fault == "throttle":
        assert r.status_code == 429 and r.headers["retry-after"] == "3" and elapsed < 0.3
    elif fault == "error":
        assert r.status_code == 504 and 0.05 <= elapsed < 0.5
    else:
        assert r.status_code == 200 and len(r.json()["result"][0]) == 3
        assert 0.05 + 0.3 <= elapsed < 1.2


async def test_fidelity_at_a_small_rate_matches_the_profile(server: ServerProcess) -> None:
    """100 requests/s open loop for 3 s: scheduled and realized delays follow the shipped profile."""
    profile = load_profile(shipped_profile_path("search_default"))
    with httpx.Client(base_url=server.url, timeout=30) as c:
        c.put(
            "/v1/emulators/search/profile", json=profile.model_dump(mode="json", exclude_none=True)
        ).raise_for_status()
    rate, seconds = 100, 3
    result = await arun_load(
        LoadSpec(
            url=server.url + "/retrieve",
            bodies=[{"queries": [f"fidelity {i}"]} for i in range(rate * seconds)],
            arrival="constant",
            rate=rate,
            duration_s=seconds,
            timeout_s=30,
            preconnect=80,
            capture_headers=[INJECTED, LEAD],
        )
    )
    assert result.n == rate * seconds
    assert list(result.outcomes) == ["ok"] * result.n and set(result.status.tolist()) == {200}
    injected = np.array([float(v) for v in result.captured_values(INJECTED)]) / 1000
    realized = result.done - result.sent  # from the moment each request left the client
    # 300 draws: the 5% KS critical value is 0.078. What the server scheduled is a pure draw:
    assert stats.kstest(injected, profile.model.cdf).statistic < 0.1
    # What the client saw adds the loop's and the machine's latency: a wide margin for a busy
    # 2-core machine, still far below what a wrong unit or a missing sleep gives (KS > 0.4).
    timer_error = realized - injected
    # The service wakes early by the median response path it measured (the lead it reports,
    # at most 2 ms), so that a reply leaves on schedule at the median; never earlier than that
    # lead (one clock for client and server: the request arrived after it was sent).
    lead = np.array([float(v) for v in result.captured_values(LEAD)]) / 1000
    assert lead.max() <= 0.002
    assert (timer_error + lead).min() >= 0
    assert np.median(timer_error) < 0.1
    assert stats.kstest(realized, profile.model.cdf).statistic < 0.25


async def test_replies_reach_the_client_on_time_at_the_median(client: httpx.Client) -> None:
    """Bounded open loop (400 requests at 200/s, sends on a timerfd) at a constant 20 ms: the
    service wakes early by its response path and its loop's intake latency (the lead it reports,
    0.6-0.7 ms here), so the reply reaches the client, at the median, late by less than 0.6 of
    that lead (and 0.45 ms) and early by less than half of it (in one of up to three runs),
    counted from when the request left the client; never before it was sent plus the delay
    minus that lead. No correction makes replies late by the whole lead and more; a double
    count early by about the lead. What is left is the client's own side, which the service
    cannot see (0.2-0.33 ms on a quiet 2-core machine: a fixed 0.2 ms bound failed there, on
    every version)."""
    client.put(
        "/v1/emulators/search/profile",
        json={"tool": "search", "model": {"kind": "constant", "value_s": 0.02}, "source": "t"},
    ).raise_for_status()
    url = str(client.base_url).rstrip("/")
    spec = dict(
        url=url + "/retrieve", body={"queries": ["on time"]}, arrival="constant", rate=200,
        duration_s=2.0, timeout_s=30, preconnect=16, capture_headers=[INJECTED, TIMER, LEAD],
        precise_sends=True, spin_s=0.0001,
    )  # fmt: skip
    await arun_load(LoadSpec(**spec))  # the pacer learns the path and the intake

    def on_time(median_error: float, median_lead: float) -> bool:
        return -0.5 * median_lead < median_error < min(0.6 * median_lead, 0.00045)

    # A wrong correction shows in every run; a loaded machine delays a whole run (a fresh-clone
    # CI run measured +0.22 ms once), so up to three runs are measured and one must be on time.
    medians: list[tuple[float, float]] = []  # (error, lead) of each run
    while len(medians) < 3 and not (medians and on_time(*medians[-1])):
        result = await arun_load(LoadSpec(**spec))
        assert list(result.outcomes) == ["ok"] * result.n and result.n == 400
        injected = np.array([float(v) for v in result.captured_values(INJECTED)]) / 1000
        lead = np.array([float(v) for v in result.captured_values(LEAD)]) / 1000
        woke = np.array([float(v) for v in result.captured_values(TIMER)]) / 1000
        assert np.all(injected == 0.02) and 0 < np.median(lead) <= 0.002
        assert np.median(woke) < 0  # the handler woke early on purpose
        error = result.done - result.sent - injected
        assert (error + lead).min() >= 0
        medians.append((float(np.median(error)), float(np.median(lead))))
    assert on_time(*medians[-1]), medians


def _raw(port: int, request: bytes) -> tuple[bytes, float]:
    """Send `request` on a fresh connection; what comes back until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        started = time.monotonic()
        data = b""
        while b"}" not in data and (chunk := sock.recv(65536)):
            data += chunk
        return data, time.monotonic() - started


def test_a_body_is_bounded_in_size_and_time() -> None:
    # served alone, a declared body that never came held the connection with no answer, and a
    # huge one was read whole: now the gateway's 408 and 413, with its words
    port = free_port()
    argv = [sys.executable, "-m", "toolenv", "emulators", "serve", "--port", str(port)]
    env = {"TOOLENV_EMULATORS_BODY_TIMEOUT_S": "1", "TOOLENV_EMULATORS_MAX_BODY_BYTES": "4096"}
    s = ServerProcess(argv, f"http://127.0.0.1:{port}", env).start("/readyz", timeout=60)
    try:
        head = "HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        # the direct lane (/retrieve) and a framework route (the profile) answer alike
        for line in ("POST /retrieve", "PUT /v1/emulators/search/profile"):
            data, waited = _raw(port, f'{line} {head}content-length: 100\r\n\r\n{{"q'.encode())
            assert data.startswith(b"HTTP/1.1 408"), data[:300]
            assert b"did not arrive within 1 s (3 bytes of 100)" in data, data
            assert b"connection: close" in data.lower() and 0.9 <= waited < 3.0
            data, waited = _raw(port, f"{line} {head}content-length: 99999\r\n\r\n{{".encode())
            assert data.startswith(b"HTTP/1.1 413"), data[:300]
            assert b"request body exceeds the limit of 4096 bytes" in data and waited < 0.9
        # a route that takes no body answers as it would without the limit (it was a 413)
        for line, status in (("GET /healthz", 200), ("GET /nope", 404), ("GET /retrieve", 405)):
            data, _ = _raw(port, f"{line} {head}content-length: 99999\r\n\r\n".encode())
            assert data.startswith(f"HTTP/1.1 {status} ".encode()), data[:300]
        chunk = b"x" * 5000  # no Content-Length: counted as it arrives
        data, _ = _raw(port, f"POST /retrieve {head}transfer-encoding: chunked\r\n\r\n".encode()
                       + b"%x\r\n%s\r\n0\r\n\r\n" % (len(chunk), chunk))  # fmt: skip
        assert data.startswith(b"HTTP/1.1 413"), data[:300]
        r = httpx.post(s.url + "/retrieve", json={"queries": ["q"], "topk": 1}, timeout=10)
        assert r.status_code == 200, r.text  # a whole body is served as always
    finally:
        s.stop()


def test_a_delay_counts_from_when_the_request_reached_the_process(server: ServerProcess) -> None:
    """Headers now, the body 1.5 s later: the 1 s delay had already run out when the body came,
    so the reply follows the body at once (a client times a call from its first byte too)."""
    body = json.dumps({"query": "q", "delay_s": 1.0}).encode()
    head = (
        b"POST /v1/emulators/search/call HTTP/1.1\r\nHost: t\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(head)
        time.sleep(1.5)
        body_sent = time.monotonic()
        conn.sendall(body)
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += conn.recv(65536)
        answered_after_body = time.monotonic() - body_sent
    status, *lines = reply.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    assert status.startswith("HTTP/1.1 200")
    assert answered_after_body < 0.7  # not another full second
    assert headers[INJECTED] == "1000.000"
    assert float(headers[TIMER]) >= 400  # it woke ~0.5 s past the delay: the body was late


def test_a_caller_that_leaves_mid_body_leaves_no_traceback() -> None:
    """A client gone before its body was whole reached uvicorn as "Exception in ASGI
    application" with a ClientDisconnect traceback, once per such call."""
    s = start_server()
    try:
        port = int(s.url.rsplit(":", 1)[1])
        for method, path in [
            ("POST", "/retrieve"),
            ("POST", "/v1/emulators/reward/call"),
            ("PUT", "/v1/emulators/search/profile"),
        ]:
            head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(head.encode() + b'{"queries":')
                time.sleep(0.3)  # the handler is reading the body when the client leaves
        assert httpx.post(s.url + "/retrieve", json={"queries": ["q"]}).status_code == 200
    finally:
        s.stop()
    out = s.output()
    assert "Traceback" not in out and "Exception in ASGI application" not in out, out


def test_a_deadline_counts_from_the_requests_arrival_like_its_delay() -> None:
    """The budget was counted from when the handler ran, the delay from arrival: a call that
    waited (here behind a pipelined one on its connection; under load, in the loop's queue) got
    its 504 that much after its deadline, and one due just after it answered 200 past it."""
    s = start_server()
    try:
        faults = [{"type": "hang", "rate": 1.0}]
        hang = {"model": {"kind": "faulty", "model": FAST["model"], "faults": faults}}
        assert httpx.put(s.url + "/v1/emulators/search/profile", json=hang).status_code == 200
        port = int(s.url.rsplit(":", 1)[1])
        first = json.dumps({"query": "q", "delay_s": 0.5}).encode()  # exact: no fault
        second = json.dumps({"queries": ["q"]}).encode()
        head = b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n"
        pipelined = head % (b"/v1/emulators/search/call", b"", len(first)) + first
        pipelined += head % (b"/retrieve", b"X-Toolenv-Deadline-Ms: 200\r\n", len(second))
        pipelined += second
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(pipelined)
            data = b""
            while data.count(b"HTTP/1.1 ") < 2 or not data.endswith(b"}"):
                data += sock.recv(65536)
        reply = data[data.rindex(b"HTTP/1.1 ") :].decode()
        assert reply.startswith("HTTP/1.1 504"), reply
        # scheduled: the caller's deadline, 200 ms after its request arrived (it was ~700)
        assert "x-toolenv-injected-delay-ms: 200.000\r\n" in reply, reply
    finally:
        s.stop()


def test_a_405_allows_every_method_of_its_path(client: httpx.Client) -> None:
    """Starlette's 405 named the first matching route's methods: `/healthz` (a GET and a HEAD
    route) said `Allow: HEAD`, the profile path (GET and PUT) `Allow: GET`."""
    for method, path, allowed in [
        ("DELETE", "/healthz", "GET, HEAD"),
        ("PATCH", "/v1/emulators/search/profile", "GET, PUT"),
        ("GET", "/retrieve", "POST"),
    ]:
        r = client.request(method, path)
        assert r.status_code == 405 and r.headers["allow"] == allowed, (path, r.headers)
        assert r.json() == {"detail": "Method Not Allowed"}
