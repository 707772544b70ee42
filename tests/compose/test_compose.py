"""The compose stack: every language, least privilege, both directories, keys, start-up errors.

One stack (conftest.py) serves these tests and then test_compose_failures.py's, which crash and
restart its services (file order).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from compose_support import IMAGE, PROGRAMS, REPO, Stack, run_code
from testkit import free_port

CAP_SETFCAP = 1 << 31


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
        # bwrap's init reaps a bash, C or C++ program: its CPU time is its run's cgroup's
        assert body["run_result"]["cpu_time"] is not None, (language, body)
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
