"""Bounds a new user can reach over HTTP: no profile makes a call wait past `max_delay_s`."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from testkit import ServerProcess, free_port

from emulators.search.documents import DocumentCache

INJECTED = "x-toolenv-injected-delay-ms"


@pytest.fixture(scope="module")
def capped() -> Iterator[ServerProcess]:
    """An emulator served alone whose calls may sleep at most 0.5 s."""
    port = free_port()
    argv = [sys.executable, "-m", "toolenv", "emulators", "serve", "--port", str(port)]
    env = {"TOOLENV_EMULATORS_MAX_DELAY_S": "0.5"}
    s = ServerProcess(argv, f"http://127.0.0.1:{port}", env).start("/readyz", timeout=60)
    yield s
    s.stop()


@pytest.mark.parametrize("tool", ["search", "reward"])
def test_an_absurd_drawn_delay_is_capped_at_max_delay_s(capped: ServerProcess, tool: str) -> None:
    # a constant 1e300 s was accepted and, served alone without a deadline, the search call
    # never answered (reward was capped): now both sleep max_delay_s, one rule for every tool
    with httpx.Client(base_url=capped.url, timeout=10) as c:
        profile = {"model": {"kind": "constant", "value_s": 1e300}}
        assert c.put(f"/v1/emulators/{tool}/profile", json=profile).status_code == 200
        body = {"query": "q"} if tool == "search" else {"batch_size": 64}
        started = time.monotonic()
        r = c.post(f"/v1/emulators/{tool}/call", json=body)
        waited = time.monotonic() - started
        assert r.status_code == 200, r.text
        assert float(r.headers[INJECTED]) == 500.0
        assert 0.45 <= waited < 3.0
        if tool == "search":  # the Search-R1 route draws from the same capped rule
            r = c.post("/retrieve", json={"queries": ["q"]})
            assert r.status_code == 200 and float(r.headers[INJECTED]) == 500.0


def test_a_504_names_the_delay_readably(capped: ServerProcess) -> None:
    # the message printed the drawn delay with `.3f`: 301 digits for 1e300
    with httpx.Client(base_url=capped.url, timeout=10) as c:
        profile = {"model": {"kind": "constant", "value_s": 0.4}}
        assert c.put("/v1/emulators/search/profile", json=profile).status_code == 200
        r = c.post(
            "/v1/emulators/search/call",
            json={"query": "q"},
            headers={"X-Toolenv-Deadline-Ms": "50"},
        )
        assert r.status_code == 504, r.text
        assert r.json()["detail"] == "the emulated call takes 0.4 s, past the caller's deadline"


def test_slow_body_and_hang_without_deadline_are_capped(capped: ServerProcess) -> None:
    # a slow body trickled over its `duration_s` and a hang lasted hang_without_deadline_s (60 s),
    # whatever max_delay_s said
    with httpx.Client(base_url=capped.url, timeout=10) as c:
        for fault in (
            {"type": "slow_body", "rate": 1.0, "duration_s": 1e300, "chunks": 2},
            {"type": "hang", "rate": 1.0},
        ):
            profile = {
                "model": {"kind": "faulty", "model": {"kind": "constant", "value_s": 0.0},
                          "faults": [fault]},
            }  # fmt: skip
            assert c.put("/v1/emulators/search/profile", json=profile).status_code == 200
            started = time.monotonic()
            r = c.post("/v1/emulators/search/call", json={"query": "q"})
            waited = time.monotonic() - started
            assert r.status_code == (200 if fault["type"] == "slow_body" else 504), r.text
            assert waited < 3.0, (fault, waited)
    # ...and a hang lasted as long as the caller's deadline, 10 s here, hours if it said so
    started = time.monotonic()
    r = httpx.post(capped.url + "/retrieve", json={"queries": ["q"]},
                   headers={"X-Toolenv-Deadline-Ms": "10000"}, timeout=30)  # fmt: skip
    waited = time.monotonic() - started
    assert r.status_code == 504 and 0.45 <= waited < 3.0, (r.text, waited)
    assert float(r.headers[INJECTED]) == 500.0
    # the emulator gave up at its own bound, not at the caller's deadline
    assert "x-toolenv-deadline-expired" not in r.headers


def test_a_long_sleep_stops_when_its_client_disconnects() -> None:
    # uvicorn does not cancel a request whose client left: the handler slept on to its delay, so
    # a server stopped then waited out its 5 s graceful shutdown and logged the CancelledError
    port = free_port()
    argv = [sys.executable, "-m", "toolenv", "emulators", "serve", "--port", str(port)]
    s = ServerProcess(argv, f"http://127.0.0.1:{port}").start("/readyz", timeout=60)
    try:
        # a client that stays is answered as before, watched or not
        profile = {"model": {"kind": "constant", "value_s": 1.2}}
        assert httpx.put(f"{s.url}/v1/emulators/search/profile", json=profile).status_code == 200
        started = time.monotonic()
        r = httpx.post(f"{s.url}/v1/emulators/search/call", json={"query": "q"}, timeout=10)
        assert r.status_code == 200 and 1.2 <= time.monotonic() - started < 3.0
        profile = {"model": {"kind": "constant", "value_s": 30.0}}
        for tool in ("search", "reward"):
            r = httpx.put(f"{s.url}/v1/emulators/{tool}/profile", json=profile)
            assert r.status_code == 200
        calls = {
            b"/v1/emulators/search/call": b'{"query":"q"}',
            b"/retrieve": b'{"queries":["q"]}',
            b"/v1/emulators/reward/call": b'{"batch_size":64}',
        }
        for path, payload in calls.items():
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(
                    b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (path, len(payload), payload)
                )
                time.sleep(0.3)  # the handler is asleep now; then the client goes away
        time.sleep(0.3)
    finally:
        started = time.monotonic()
        s.stop()
        stopped_in = time.monotonic() - started
    assert s.proc is not None and s.proc.stdout is not None
    log = s.proc.stdout.read().decode(errors="replace")
    assert stopped_in < 3.0, (stopped_in, log[-2000:])
    assert "CancelledError" not in log and "Traceback" not in log, log[-2000:]


def _call_log(path: Path, *latencies: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            f"Step0, Request ID: {i}, Tool: search, Latency: {x} seconds\n"
            for i, x in enumerate(latencies)
        )
    )
    return path


def test_a_profile_put_reads_traces_only_from_the_trace_dirs(tmp_path: Path) -> None:
    # `paths` could name any file on the server, and the 422 told whether it existed
    cache, extra, outside = tmp_path / "cache", tmp_path / "extra", tmp_path / "outside"
    _call_log(cache / "runs" / "calls.log", 0.01, 0.02)
    _call_log(extra / "more.log", 0.03)
    secret = _call_log(outside / "secret.log", 0.04)
    (cache / "link.log").symlink_to(secret)
    startup = tmp_path / "startup.yaml"  # the operator's file may name any path
    startup.write_text(f"model: {{kind: trace, paths: ['{secret}']}}\n")
    port = free_port()
    argv = [sys.executable, "-m", "toolenv", "emulators", "serve", "--port", str(port),
            "--profile", str(startup)]  # fmt: skip
    env = {"TOOLENV_TRACES_CACHE_DIR": str(cache), "TOOLENV_EMULATORS_TRACE_DIRS": f'["{extra}"]'}
    s = ServerProcess(argv, f"http://127.0.0.1:{port}", env).start("/readyz", timeout=60)
    try:
        with httpx.Client(base_url=s.url, timeout=10) as c:
            r = c.post("/v1/emulators/search/call", json={"query": "q"})
            assert r.status_code == 200 and float(r.headers[INJECTED]) == 40.0

            def put(path: str) -> httpx.Response:
                profile = {"model": {"kind": "trace", "paths": [path]}}
                return c.put("/v1/emulators/search/profile", json=profile)

            for allowed, ms in (("runs/calls.log", 10.0), ("calls.log", 10.0),
                                (str(extra / "more.log"), 30.0)):  # fmt: skip
                assert put(allowed).status_code == 200, put(allowed).text
                r = c.post("/v1/emulators/search/call", json={"query": "q"})
                assert float(r.headers[INJECTED]) == ms, allowed
            missing = put("runs/missing.log")  # inside: saying it is missing reveals nothing
            assert missing.status_code == 422 and "no such file" in missing.text
            denied = {
                p: put(p)
                for p in (
                    str(secret),
                    str(outside / "nope.log"),
                    "../outside/secret.log",
                    "/etc/passwd",
                    "/etc/nope",
                )
            }
            for p, r in denied.items():
                assert r.status_code == 422, (p, r.text)
                detail = r.json()["detail"][0]
                assert detail["loc"] == ["body", "model", "paths", 0], (p, detail)
                # the same words for a file that exists and one that does not
                assert detail["msg"].removeprefix(p) == denied["/etc/nope"].json()["detail"][0][
                    "msg"
                ].removeprefix("/etc/nope"), (p, detail)
            # a link in the cache to a file outside is not followed out (nor named)
            link = put("link.log")
            assert link.status_code == 422 and str(outside) not in link.text, link.text
            # nested models are checked too
            nested = {"model": {"kind": "mixture", "components": [
                {"weight": 1, "model": {"kind": "trace", "paths": [str(secret)]}}]}}  # fmt: skip
            r = c.put("/v1/emulators/search/profile", json=nested)
            assert r.status_code == 422
            assert r.json()["detail"][0]["loc"][-2:] == ["paths", 0], r.text
    finally:
        s.stop()


def test_the_document_cache_is_bounded_in_bytes_as_well_as_entries() -> None:
    # it was bounded by count alone: 8,192 unique queries at 200,000 tokens each kept ~11 GB
    cache = DocumentCache(seed=1, size=100, max_bytes=500_000)
    big = [cache.get(f"big {i}", 3, 20_000, False) for i in range(8)]
    assert all(len(b) > 100_000 for b in big)
    assert cache.store is not None
    assert 0 < cache.store.currsize <= 500_000 and len(cache.store) < 5
    assert cache.get("big 7", 3, 20_000, False) is big[7]  # the latest is still kept
    small = DocumentCache(seed=1, size=4, max_bytes=10_000_000)
    for i in range(10):
        small.get(f"small {i}", 3, 30, False)
    assert small.store is not None and len(small.store) == 4
    huge = DocumentCache(seed=1, size=10, max_bytes=1_000).get("huge", 3, 1_000, False)
    assert len(huge) > 1_000  # larger than the whole cache: served, not kept


def test_a_config_files_trace_cache_is_where_its_profiles_and_puts_read(tmp_path: Path) -> None:
    # `emulators serve -c FILE` read its profiles' trace names, and a PUT's, in the trace cache
    # of TOOLENV_CONFIG (else the default), never in FILE's own `traces.cache_dir`: the start
    # failed with "nor in the trace cache ~/.cache/toolenv/polytrace"
    cache = tmp_path / "cache"
    _call_log(cache / "runs" / "calls.log", 0.01)
    _call_log(cache / "runs" / "other.log", 0.03)
    config = tmp_path / "toolenv.yaml"
    config.write_text(
        f"traces: {{cache_dir: '{cache}'}}\n"
        "emulators: {search_profile: {model: {kind: trace, paths: ['runs/calls.log']}}}\n"
    )
    port = free_port()
    argv = [sys.executable, "-m", "toolenv", "emulators", "serve", "--port", str(port),
            "-c", str(config)]  # fmt: skip
    env = {"TOOLENV_CONFIG": "", "TOOLENV_TRACES_CACHE_DIR": ""}  # empty: unset
    s = ServerProcess(argv, f"http://127.0.0.1:{port}", env).start("/readyz", timeout=60)
    try:
        with httpx.Client(base_url=s.url, timeout=10) as c:
            r = c.post("/v1/emulators/search/call", json={"query": "q"})
            assert r.status_code == 200 and float(r.headers[INJECTED]) == 10.0
            profile = {"model": {"kind": "trace", "paths": ["other.log"]}}
            r = c.put("/v1/emulators/search/profile", json=profile)
            assert r.status_code == 200, r.text
            r = c.post("/v1/emulators/search/call", json={"query": "q"})
            assert float(r.headers[INJECTED]) == 30.0
    finally:
        s.stop()
