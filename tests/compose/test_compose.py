"""The compose stack: every language, least privilege, both directories, faults and trace capture.

One stack (conftest.py) serves every test; the fault tests come last in file order because they
crash and restart its services.
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
from pathlib import Path

import httpx
from compose_support import IMAGE, REPO, Stack
from testkit import free_port

PROGRAMS = {
    "python": "print(6 * 7)",
    "bash": "echo $((6 * 7))",
    "c": '#include <stdio.h>\nint main(void) { printf("%d\\n", 6 * 7); return 0; }\n',
    "cpp": "#include <iostream>\nint main() { std::cout << 6 * 7 << std::endl; }\n",
}
CAP_SETFCAP = 1 << 31


def run_code(stack: Stack, code: str, language: str = "python", **kw: object) -> httpx.Response:
    return stack.client.post("/run_code", json={"code": code, "language": language, **kw})


def test_every_language_and_tool_answers_through_the_gateway(stack: Stack) -> None:
    assert stack.client.get("/readyz").status_code == 200
    # every language the gateway lists (a 404 before) runs
    listed = stack.client.get("/v1/languages")
    assert listed.status_code == 200, listed.text
    assert {lang["name"] for lang in listed.json()["languages"]} == set(PROGRAMS), listed.text
    for language, code in PROGRAMS.items():
        r = run_code(stack, code, language)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "Success", (language, body)
        assert body["run_result"]["stdout"].strip() == "42", (language, body)
    found = stack.client.post("/retrieve", json={"queries": ["who wrote hamlet"], "topk": 3})
    assert found.status_code == 200 and len(found.json()["result"][0]) == 3, found.text
    call = stack.client.post("/v1/tools/search/call", json={"arguments": {"query": "rl"}})
    assert call.status_code == 200 and call.json()["status"] == "ok", call.text
    tools = {t["function"]["name"] for t in stack.client.get("/v1/tools").json()["tools"]}
    assert {"sandbox", "search", "reward"} <= tools
    # what /docs renders: one operationId per operation (GET and HEAD /readyz shared one)
    paths = stack.client.get("/openapi.json").json()["paths"]
    ids = [op["operationId"] for path in paths.values() for op in path.values()]
    assert len(ids) == len(set(ids)), sorted(ids)


def test_up_from_the_compose_dir_is_the_same_project(stack: Stack) -> None:
    root = stack.compose("config")
    sub = stack.compose("config", cwd=REPO / "compose")
    assert root.returncode == 0 and root.stdout == sub.stdout, sub.stderr
    up = stack.compose("up", "-d", "--wait", "--wait-timeout", "120", cwd=REPO / "compose")
    assert up.returncode == 0, up.stderr
    r = run_code(stack, PROGRAMS["cpp"], "cpp")
    assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "42\n", r.text


def test_sandbox_container_runs_with_least_privilege(stack: Stack) -> None:
    host = stack.inspect("sandbox")["HostConfig"]
    assert host["Privileged"] is False
    assert host["CapDrop"] == ["ALL"]
    assert [c.removeprefix("CAP_") for c in host["CapAdd"]] == ["SETFCAP"]
    assert host["CgroupnsMode"] == "private"
    opts = host["SecurityOpt"]
    assert "no-new-privileges:true" in opts
    assert not any(o.endswith("unconfined") and not o.startswith("systempaths") for o in opts)
    profile = json.loads(next(o for o in opts if o.startswith("seccomp="))[len("seccomp=") :])
    unconditional = [r for r in profile["syscalls"] if "toolenv" in r.get("comment", "")]
    assert len(unconditional) == 1
    assert sorted(unconditional[0]["names"]) == sorted(
        ["clone", "unshare", "mount", "umount2", "pivot_root", "sethostname"]
    )
    sources = [m["Source"] for m in stack.inspect("sandbox")["Mounts"] if m["Type"] == "bind"]
    cgroup = [s for s in sources if s.startswith("/sys/fs/cgroup")]
    assert cgroup and all(s.endswith(f"/toolenv/{stack.project}") for s in cgroup), cgroup
    status = stack.exec("sandbox", "cat", "/proc/1/status")
    eff = int(re.search(r"CapEff:\s*([0-9a-f]+)", status).group(1), 16)
    assert eff == CAP_SETFCAP, hex(eff)
    # the host's hierarchy is not writable from the container: only the delegated subtree is
    probe = stack.compose(
        "exec", "-T", "sandbox", "sh", "-c", "mkdir /sys/fs/cgroup/devices/escape"
    )
    assert probe.returncode != 0
    # runs get their own cgroups in the delegated subtree, with the configured interpreter
    r = run_code(stack, "print(open('/proc/self/cgroup').read())")
    assert r.status_code == 200 and r.json()["status"] == "Success", r.text
    state = stack.sandbox_state()
    assert state["running"] == 0


STATUS = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8002/v1/sandbox/status').read().decode())"
IDENTITY = """import os
status = dict(line.split(':', 1) for line in open('/proc/self/status'))
print(os.getuid(), os.getgid(), *(status[k].strip() for k in ('CapEff', 'CapPrm', 'CapAmb', 'NoNewPrivs')))
print(os.stat('main.py').st_uid, os.listdir('/dev/pts'))
"""


def test_python_runs_through_the_fork_server_without_privileges(stack: Stack) -> None:
    """The zygote holds its capabilities in a user namespace of its own; a run is uid 65534 with
    none, owns its files, and has its own devpts."""
    status = json.loads(stack.exec("sandbox", "python", "-c", STATUS))
    assert status["python_mode"] == "fork_server", status["fork_server"]
    assert status["fork_server"]["user_namespace"] is True
    forks = status["fork_server"]["forks"]
    r = run_code(stack, IDENTITY)
    assert r.status_code == 200 and r.json()["status"] == "Success", r.text
    zero = "0000000000000000"
    assert r.json()["run_result"]["stdout"].splitlines() == [
        f"65534 65534 {zero} {zero} {zero} 1",
        "65534 ['ptmx']",
    ]
    after = json.loads(stack.exec("sandbox", "python", "-c", STATUS))["fork_server"]
    assert after["forks"] == forks + 1 and after["anomalies"] == 0


def test_api_keys_from_the_host_environment_reach_the_gateway(stack: Stack) -> None:
    """`TOOLENV_GATEWAY_API_KEYS=... docker compose up` (or the key in .env) turns keys on, as the
    compose file says; without it the gateway stays open on the loopback port."""
    keyed = {**stack.env, "TOOLENV_GATEWAY_API_KEYS": "compose-test-key"}
    try:
        up = subprocess.run(
            ["docker", "compose", "up", "-d", "--wait", "--wait-timeout", "120", "gateway"],
            cwd=REPO,
            env=keyed,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert up.returncode == 0, up.stderr
        assert stack.client.get("/readyz").status_code == 200  # probes need no key
        assert run_code(stack, "print(1)").status_code == 401
        auth = {"authorization": "Bearer compose-test-key"}
        r = stack.client.post("/run_code", json={"code": "print(1)"}, headers=auth)
        assert r.status_code == 200 and r.json()["status"] == "Success", r.text
    finally:
        up = stack.compose("up", "-d", "--wait", "--wait-timeout", "120", "gateway")
    assert up.returncode == 0, up.stderr
    assert run_code(stack, "print(1)").status_code == 200


def test_a_missing_model_dir_fails_up_naming_it(stack: Stack, tmp_path: Path) -> None:
    """A mistyped TOOLENV_MODEL_DIR (or no `make model` yet) stops `--profile cpu up` with the path;
    Docker made it, empty and root-owned, on the host before, and vLLM crash-looped on it."""
    missing = tmp_path / "no-such-model"
    env = {
        **stack.env,
        "TOOLENV_MODEL_DIR": str(missing),
        "TOOLENV_VLLM_CPU_IMAGE": IMAGE,  # any local image: the mount is refused before it runs
        "TOOLENV_VLLM_PORT": str(free_port()),
    }
    argv = ["docker", "compose", "--profile", "cpu"]
    try:
        up = subprocess.run(
            [*argv, "up", "-d", "--no-build", "vllm-cpu"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert up.returncode != 0, up.stderr
        assert f"bind source path does not exist: {missing}" in up.stderr, up.stderr
        assert not missing.exists()
    finally:
        subprocess.run(
            [*argv, "rm", "--stop", "--force", "-v", "vllm-cpu"],
            cwd=REPO,
            env=env,
            capture_output=True,
            timeout=120,
        )


def test_a_sandbox_container_bwrap_cannot_use_says_what_it_needs(stack: Stack) -> None:
    """Without CAP_SETFCAP bwrap cannot map uid 0: sandboxd exits naming the narrow settings the
    compose file gives it, not privileged mode (which its message advised)."""
    out = stack.compose(
        "run", "--rm", "--no-deps", "-T", "--cap-drop", "SETFCAP",
        "sandbox", "sandboxd", "serve", "--port", "8003", timeout=120,
    )  # fmt: skip
    said = out.stdout + out.stderr
    assert out.returncode == 3, said
    assert "bwrap: setting up uid map: Operation not permitted" in said, said
    assert "CAP_SETFCAP" in said and "docs/compose.md" in said and "run it privileged" not in said


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
