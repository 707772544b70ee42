"""The compose stack's failures: crashed, killed and restarted services, the calls they cut,
and trace capture across a restart.

It shares the stack of test_compose.py (conftest.py) and runs after it, in file order, because
it crashes and restarts the stack's services.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable

import httpx
from compose_support import PROGRAMS, REPO, Stack, run_code


def _crash(stack: Stack, service: str) -> None:
    """SIGKILL the service's process (the child of the container's init): a crash."""
    stack.exec(service, "sh", "-c", "kill -9 $(cat /proc/1/task/1/children)")


def _wait_for(predicate: object, timeout: float, step: float = 0.1) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():  # type: ignore[operator]
            return time.monotonic() - start
        time.sleep(step)
    raise AssertionError(f"condition not met within {timeout} s")


def _sandbox_answers(stack: Stack) -> bool:
    ping = "import urllib.request as u; u.urlopen('http://127.0.0.1:8002/v1/ping', timeout=1)"
    out = stack.compose("exec", "-T", "sandbox", "python", "-c", ping, timeout=30)
    return out.returncode == 0


def test_crashed_sandbox_restarts_and_readyz_follows(stack: Stack) -> None:
    _crash(stack, "sandbox")
    # Calls during the restart: a clear 503 naming the tool (sandbox calls are not retried). The
    # first may instead find its pooled connection reset by the dying service: a 502 naming it.
    statuses = []
    for _ in range(3):
        r = run_code(stack, "print(1)")
        assert "sandbox" in r.text, r.text
        statuses.append(r.status_code)
        if r.status_code == 503:
            break
    assert statuses[-1] == 503 and set(statuses) <= {502, 503}, statuses
    _wait_for(lambda: stack.client.get("/readyz").status_code == 503, timeout=6)
    assert "sandbox" in stack.client.get("/readyz").json()["detail"]
    # restarts on its own; once it answers, /readyz follows within one health interval (2 s)
    _wait_for(lambda: _sandbox_answers(stack), timeout=90, step=0.2)
    followed = _wait_for(lambda: stack.client.get("/readyz").status_code == 200, timeout=10)
    assert followed <= 2.5, followed
    r = run_code(stack, PROGRAMS["c"], "c")
    assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "42\n", r.text


def test_idempotent_calls_ride_out_a_restart(stack: Stack) -> None:
    retried_before = _metric(stack, "toolenv_gateway_retried_total", 'tool="search"')
    _crash(stack, "search")
    r = stack.client.post("/retrieve", json={"queries": ["hamlet"], "topk": 2})
    assert r.status_code == 200, r.text
    assert len(r.json()["result"][0]) == 2
    assert _metric(stack, "toolenv_gateway_retried_total", 'tool="search"') > retried_before
    stack.wait_healthy("search")


def test_a_burst_beyond_the_retry_budget_says_so(stack: Stack) -> None:
    """Before: with search down, a burst of calls spent the retry budget and the rest failed at
    once with the same 503 as a call that had retried for 12 s: nothing said that the budget,
    not the outage, ended them (docs/compose.md promised that calls ride out a restart)."""
    stopped = stack.compose("stop", "search")
    assert stopped.returncode == 0, stopped.stderr
    try:
        # One call first: its backoff (0.1, 0.2, 0.4 s, ...) stops fitting before its 800 ms
        # deadline after the fourth attempt; the retry at the deadline is its last (all 8
        # attempts went out before, the rest back to back in the last 50 ms).
        time.sleep(1.5)  # the retry budget's per-second floor is whole again
        one = stack.client.post(
            "/retrieve", json={"queries": ["q"]}, headers={"X-Toolenv-Deadline-Ms": "800"}
        )
        made = re.search(r"; (\d+) attempts made", one.text)
        assert one.status_code == 503 and made and 2 <= int(made[1]) <= 5, one.text

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
                return await asyncio.gather(
                    *(
                        client.post(
                            "/retrieve",
                            json={"queries": [f"q{i}"], "topk": 2},
                            # generous: on a loaded machine, the first attempts' failures
                            # (a name lookup, a connect) once outlasted a 3 s deadline, every
                            # call a 504 that never reached its retries
                            headers={"X-Toolenv-Deadline-Ms": "10000"},
                        )
                        for i in range(64)
                    )
                )

        answers = asyncio.run(burst())
    finally:
        started = stack.compose("start", "search")
    assert started.returncode == 0, started.stderr
    assert all(r.status_code in (503, 504) and "search" in r.text for r in answers)
    refused = [r for r in answers if "retry budget is spent" in r.text]
    said = collections.Counter(f"{r.status_code} {r.json()['error'][:160]}" for r in answers)
    assert refused, said.most_common(5)
    assert "retry.budget_ratio" in refused[0].json()["error"], refused[0].text
    stack.wait_healthy("search")


def _answer_across_restart(
    stack: Stack, service: str, send: Callable[[], httpx.Response]
) -> httpx.Response:
    """`send` in flight while `docker compose restart SERVICE` runs: its answer (an answer, not
    a dropped connection, is asserted)."""
    answers: list[httpx.Response | httpx.HTTPError] = []

    def call() -> None:
        try:
            answers.append(send())
        except httpx.HTTPError as exc:  # e.g. the connection closed with no answer at all
            answers.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    # the restart waits for the call to be in flight: sent 1 s before it, it once reached the
    # service only after the restart had begun (a busy machine), and a search call was retried
    _wait_for(lambda: _in_flight(stack) > 0, timeout=10)
    time.sleep(0.5)  # from the gateway's slot to the service
    restart = stack.compose("restart", service)
    caller.join(60)
    assert restart.returncode == 0, restart.stderr
    assert answers and isinstance(answers[0], httpx.Response), answers
    return answers[0]


def test_a_search_restart_answers_the_call_it_cuts(stack: Stack) -> None:
    """`docker compose restart search` lets a call in flight run for the emulators' 5 s grace,
    then cuts it: before, the caller got uvicorn's plain-text 500 through the gateway, which
    read as a failing service; now a 503 saying the service stopped and what to do."""
    stack.wait_healthy("search")
    # and healthy to the gateway, whose view lags Docker's: after the burst test stopped search,
    # the long call went out before it, and reached the emulator only after the restart
    _wait_for(lambda: stack.client.get("/readyz").status_code == 200, timeout=30)
    quick = stack.client.post("/retrieve", json={"queries": ["hamlet"], "topk": 1})
    assert quick.status_code == 200, quick.text
    body = {"arguments": {"query": "hamlet", "topk": 1, "delay_s": 20}, "deadline_ms": 40000}
    r = _answer_across_restart(
        stack, "search", lambda: stack.client.post("/v1/tools/search/call", json=body)
    )
    assert r.status_code == 200 and r.json()["status"] == "error", r.text
    assert r.json()["error"] == "tool 'search' answered HTTP 503", r.text
    assert "emulators stopped before this call finished" in r.json()["result"]["detail"], r.text
    stack.wait_healthy("search")


def _in_flight(stack: Stack) -> float:
    """Calls holding a gateway concurrency slot, over every tool."""
    lines = stack.client.get("/metrics").text.splitlines()
    return sum(
        float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("toolenv_gateway_in_flight{")
    )


def _metric(stack: Stack, name: str, label: str) -> float:
    for line in stack.client.get("/metrics").text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_killed_sandbox_container_fails_the_run_cleanly_and_the_pool_refills(
    stack: Stack,
) -> None:
    stack.wait_healthy("sandbox")
    result: dict[str, object] = {}

    def call() -> None:
        started = time.monotonic()
        code = "import time\nprint('started', flush=True)\ntime.sleep(30)\n"
        result["response"] = run_code(stack, code, run_timeout=40)
        result["elapsed"] = time.monotonic() - started

    t = threading.Thread(target=call)
    t.start()
    _wait_for(lambda: stack.sandbox_state()["running"] == 1, timeout=10, step=0.2)
    os.kill(stack.inspect("sandbox")["State"]["Pid"], signal.SIGKILL)  # the container's init
    t.join(60)
    r = result["response"]
    assert isinstance(r, httpx.Response)
    assert r.status_code in (502, 503), r.text
    assert "sandbox" in r.text
    assert result["elapsed"] < 10  # failed when the container died, not at the run timeout
    stack.wait_healthy("sandbox")
    _wait_for(stack.python_ready, 30, 0.5)
    state = stack.sandbox_state()
    assert state["procs"] == [] and state["tasks"] == [] and state["dirs"] == [], state
    _wait_for(lambda: stack.client.get("/readyz").status_code == 200, timeout=10)
    r = run_code(stack, PROGRAMS["cpp"], "cpp")
    assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "42\n", r.text


def test_trace_capture_on_the_volume_survives_a_gateway_restart(stack: Stack) -> None:
    trajectory = f"compose-{time.time_ns()}"

    def calls(n: int, turn0: int) -> None:
        for turn in range(turn0, turn0 + n):
            r = stack.client.post(
                "/v1/tools/search/call",
                json={"arguments": {"query": "rl"}},
                headers={"X-Trajectory-Id": trajectory, "X-Turn": str(turn), "X-Step": "0"},
            )
            assert r.status_code == 200, r.text

    def recorded() -> list[int]:
        out = stack.exec("gateway", "cat", "/var/lib/toolenv/traces/gateway.jsonl")
        return sorted(json.loads(x)["turn"] for x in out.splitlines() if trajectory in x)

    calls(20, 0)
    for batch in (1, 2):
        started = time.monotonic()
        restart = stack.compose("restart", "gateway")
        assert restart.returncode == 0, restart.stderr
        stack.wait_healthy("gateway")
        took = time.monotonic() - started
        got = recorded()
        logs = stack.compose("logs", "--no-color", "--tail", "40", "gateway").stdout
        assert got == list(range(20 if batch == 1 else 35)), (batch, took, got, logs)
        if batch == 1:
            calls(15, 20)


def test_a_gateway_restart_lets_the_call_in_flight_finish(stack: Stack) -> None:
    """SIGTERM stops the gateway gracefully (calls in flight may finish for `shutdown_grace_s`,
    30 s): Docker must not SIGKILL it first, which cut a longer call with no answer at 10 s."""
    code = "import time\nprint('start', flush=True)\ntime.sleep(14)\nprint('done')"
    r = _answer_across_restart(stack, "gateway", lambda: run_code(stack, code, run_timeout=20))
    assert r.status_code == 200, r.text
    assert r.json()["run_result"]["stdout"] == "start\ndone\n", r.text
    stack.wait_healthy("gateway")


def test_a_gateway_restart_answers_the_call_it_cuts(stack: Stack) -> None:
    """A call longer than the gateway's `shutdown_grace_s` (30 s) is cut when it stops: before,
    its caller got no answer at all (the connection closed); now a 503 that says why."""
    stack.wait_healthy("gateway")
    body = {"arguments": {"query": "hamlet", "topk": 1, "delay_s": 45}, "deadline_ms": 60000}
    r = _answer_across_restart(
        stack, "gateway", lambda: stack.client.post("/v1/tools/search/call", json=body)
    )
    assert r.status_code == 503, r.text
    assert "the gateway stopped before this call finished" in r.json()["detail"], r.text
    assert "shutdown_grace_s (30 s)" in r.json()["detail"], r.text
    stack.wait_healthy("gateway")


def test_a_sandbox_restart_lets_the_run_in_flight_finish(stack: Stack) -> None:
    """SIGTERM stops sandboxd gracefully too: runs in flight may finish for its
    `shutdown_grace_s` (30 s), and Docker's SIGKILL comes after (`stop_grace_period: 35s`).
    With uvicorn's 10 s and Docker's 10 s a longer run was cut and the caller got a 502."""
    stack.wait_healthy("sandbox")
    answers: list[httpx.Response | httpx.HTTPError] = []
    code = "import time\nprint('start', flush=True)\ntime.sleep(14)\nprint('done')"

    def call() -> None:
        try:
            answers.append(run_code(stack, code, run_timeout=20))
        except httpx.HTTPError as exc:
            answers.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    _wait_for(lambda: stack.sandbox_state()["running"] == 1, timeout=10, step=0.2)
    restart = subprocess.Popen(
        ["docker", "compose", "restart", "sandbox"], cwd=REPO, env=stack.env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    time.sleep(3)  # draining: a new call is refused at once, naming the tool
    during = run_code(stack, "print(1)")
    assert during.status_code in (502, 503) and "sandbox" in during.text, during.text
    _, err = restart.communicate(timeout=60)
    caller.join(60)
    assert restart.returncode == 0, err
    assert answers and isinstance(answers[0], httpx.Response), answers
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["run_result"]["stdout"] == "start\ndone\n", answers[0].text
    stack.wait_healthy("sandbox")
    _wait_for(stack.python_ready, 30, 0.5)
    state = stack.sandbox_state()
    assert state["procs"] == [] and state["tasks"] == [] and state["dirs"] == [], state
    _wait_for(lambda: stack.client.get("/readyz").status_code == 200, timeout=10)
    assert run_code(stack, "print(1)").status_code == 200


def test_an_upstream_down_leaves_the_gateway_healthy(stack: Stack) -> None:
    """The gateway's own healthcheck passes while an upstream is down (/readyz names it). Before,
    it asked /readyz: after a minute without the sandbox Docker marked the gateway `unhealthy`,
    and the `docker compose up -d --wait` that brought the sandbox back failed at once with
    `container <project>-gateway-1 is unhealthy`, though the gateway was ready 2 s later."""
    stopped = stack.compose("stop", "sandbox")
    assert stopped.returncode == 0, stopped.stderr
    try:
        _wait_for(lambda: stack.client.get("/readyz").status_code == 503, timeout=10)
        assert "sandbox" in stack.client.get("/readyz").json()["detail"]
        check = stack.inspect("gateway")["Config"]["Healthcheck"]["Test"]
        assert check[0] == "CMD", check
        probe = stack.compose("exec", "-T", "gateway", *check[1:], timeout=30)
        assert probe.returncode == 0, probe.stdout + probe.stderr
    finally:
        up = stack.compose("up", "-d", "--wait", "--wait-timeout", "120")
    assert up.returncode == 0, up.stderr
    _wait_for(lambda: stack.client.get("/readyz").status_code == 200, timeout=10)
    assert run_code(stack, PROGRAMS["bash"], "bash").json()["run_result"]["stdout"] == "42\n"
