"""`toolenv serve` as a real subprocess on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest


def test_serve_answers_readyz_and_openapi_and_stops_on_sigint(toolenv_server) -> None:
    server = toolenv_server("serve")
    ready = httpx.get(server.url + "/readyz", timeout=5)
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"
    assert httpx.get(server.url + "/healthz", timeout=5).json() == {"status": "ok"}
    spec = httpx.get(server.url + "/openapi.json", timeout=5).json()
    assert spec["info"]["title"] == "toolenv gateway"
    assert "/readyz" in spec["paths"]
    assert server.stop(signal.SIGINT) == 0
    try:
        httpx.get(server.url + "/healthz", timeout=1)
        raise AssertionError("the server still answers after SIGINT")
    except httpx.ConnectError:
        pass


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["serve", "--port", "99999"], {}, "invalid gateway settings: port: "),
        (["emulators", "serve", "--port", "99999"], {}, "invalid emulators settings: port: "),
        (["sandboxd", "serve", "--port", "99999"], {}, "invalid sandbox settings: port: "),
        (["sandboxd", "serve", "--log-level", "bogus"], {},
         "invalid sandbox settings: log_level: Input should be 'critical', 'error', 'warning', "
         "'info', 'debug' or 'trace'\n"),
        (["emulators", "serve", "--corpus", "/nonexistent/corpus.jsonl"], {},
         "invalid emulators settings: corpus: Path does not point to a file"),
        (["config", "show"], {"TOOLENV_GATEWAY_PORT": "abc"}, "invalid gateway settings: port: "),
        (["gateway", "serve", "--mode", "proxy"], {},
         "invalid gateway settings: mode 'proxy' (--mode, TOOLENV_GATEWAY_MODE or gateway.mode) "
         "forces every tool into proxy mode, and tool 'sandbox': proxy mode needs at least one "
         "upstream URL (with no tools table, the tools are sandbox, search and reward)\n"),
        (["gateway", "serve"],
         {"TOOLENV_GATEWAY_TOOLS": '[{"name": "custom", "app": "nomodule:factory"}]'},
         "invalid gateway settings: tool 'custom': app 'nomodule:factory' cannot be loaded: "
         "ModuleNotFoundError: No module named 'nomodule'\n"),
        (["config", "show", "--json"], {"TOOLENV_GATEWAY_BODY_TIMEOUT_S": "inf"},
         "invalid gateway settings: body_timeout_s: Input should be a finite number\n"),
        (["config", "show", "--json"], {"TOOLENV_SANDBOX_MAX_TIMEOUT_S": "inf"},
         "invalid sandbox settings: max_timeout_s: Input should be a finite number\n"),
        # an unknown warm language was a traceback at start-up; a default beyond its bound was
        # applied as is (no run_timeout: 100 s; run_timeout 100: a 422)
        (["sandboxd", "settings"], {"TOOLENV_SANDBOX_WARM_LANGUAGES": '["cobol"]'},
         "invalid sandbox settings: warm_languages: unsupported language 'cobol'; supported: "
         "bash, c, cpp, python\n"),
        (["sandboxd", "settings"], {"TOOLENV_SANDBOX_DEFAULT_RUN_TIMEOUT_S": "100"},
         "invalid sandbox settings: default_run_timeout_s (100.0) exceeds max_timeout_s (60.0)\n"),
        (["sandboxd", "settings"], {"TOOLENV_SANDBOX_MAX_MEMORY_MB": "256"},
         "invalid sandbox settings: default_memory_mb (512) exceeds max_memory_mb (256)\n"),
        # a default deadline over its cap was cut to the cap without a word (the gateway's
        # default_deadline_ms over max_deadline_ms is refused)
        (["sandboxd", "settings"],
         {"TOOLENV_SANDBOX_DEFAULT_DEADLINE_S": "100", "TOOLENV_SANDBOX_MAX_DEADLINE_S": "10"},
         "invalid sandbox settings: default_deadline_s (100.0) exceeds max_deadline_s (10.0)\n"),
        (["emulators", "settings"],
         {"TOOLENV_EMULATORS_DEFAULT_DEADLINE_S": "100", "TOOLENV_EMULATORS_MAX_DEADLINE_S": "10"},
         "invalid emulators settings: default_deadline_s (100.0) exceeds max_deadline_s (10.0)\n"),
        # sandboxd runs any program sent to it and has no authentication: it bound 0.0.0.0
        (["sandboxd", "serve", "--host", "0.0.0.0", "--port", "1"], {},
         "refusing to bind 0.0.0.0: sandboxd has no authentication"),
        (["sandboxd", "serve", "--port", "1"], {"TOOLENV_SANDBOX_HOST": "::"},
         "refusing to bind ::: sandboxd has no authentication"),
        # a directory that is not there was taken, and every profile PUT from it refused
        (["emulators", "settings"], {"TOOLENV_EMULATORS_TRACE_DIRS": '["/nonexistent/traces"]'},
         "invalid emulators settings: trace_dirs.0: Path does not point to a directory\n"),
    ],
)  # fmt: skip
def test_a_bad_setting_is_one_line_and_exit_2(argv: list[str], env: dict, needle: str) -> None:
    # a port beyond 65535 used to be bound modulo 65536 while the log named the port asked for
    out = subprocess.run(
        [sys.executable, "-m", "toolenv", *argv],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"error: {needle}") and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.parametrize(
    "argv", [["serve"], ["gateway", "serve"], ["emulators", "serve"], ["sandboxd", "serve"]]
)
def test_a_port_in_use_is_one_line_and_exit_3(argv: list[str]) -> None:
    """It was uvicorn's raw `ERROR: [Errno 98] error while attempting to bind on address ...`
    (the gateway's after starting its tools, and stopping them again)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "toolenv", *argv, "--port", str(port)],
            # sandboxd's bwrap check is not what is tested (nothing runs: the port is taken)
            env={**os.environ, "TOOLENV_SANDBOX_INSECURE_NO_ISOLATION": "1"},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 3, out.stderr
    # the one line, alone: sandboxd said `sandboxd: ... on http://127.0.0.1:PORT` before it
    assert out.stderr.splitlines() == [
        f"error: 127.0.0.1:{port} is already in use (another server listens there): "
        "stop it, or choose another port with --port"
    ], out.stderr


@contextlib.contextmanager
def _started(argv: list[str]) -> Iterator[list[str]]:
    """`toolenv ARGV --port 0` (sandboxd without isolation), its stderr lines up to the one saying
    where it serves (60 s without one: the caller's assert says what came); stopped with SIGINT,
    which must end it cleanly."""
    server = subprocess.Popen(
        [sys.executable, "-m", "toolenv", *argv, "--host", "127.0.0.1", "--port", "0"],
        env={**os.environ, "TOOLENV_SANDBOX_INSECURE_NO_ISOLATION": "1"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in server.stderr], daemon=True).start()
    said: list[str] = []
    try:
        with contextlib.suppress(queue.Empty):
            while not said or " serving on http://" not in said[-1]:
                said.append(lines.get(timeout=60))
        yield said
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0


@pytest.mark.parametrize(
    "argv", [["serve"], ["gateway", "serve"], ["emulators", "serve"], ["sandboxd", "serve"]]
)
def test_a_server_says_the_url_it_serves_once_started(argv: list[str]) -> None:
    """Bound by toolenv (to say a port in use in one line), uvicorn no longer logged `Uvicorn
    running on ...`: nothing said where a server listened, nor which port `--port 0` got
    (sandboxd said `on http://127.0.0.1:0`)."""
    with _started(argv) as said:
        url = said[-1].rsplit(" serving on ", 1)[-1].strip() if said else ""
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0"), said
        assert httpx.get(url + "/readyz", timeout=10).status_code == 200


def test_the_embedded_sandbox_logs_as_the_gateways_json_lines() -> None:
    """Before: the embedded sandboxd's warnings came through logging's last resort as bare text
    among the gateway's JSON lines (a log shipper parsing JSON dropped them), its info lines not
    at all. Its logger now shares the gateway's JSON handler."""
    with _started(["serve"]) as said:
        pass
    warned = [line for line in said if "insecure_no_isolation: programs run" in line]
    assert len(warned) == 1, said
    entry = json.loads(warned[0])
    assert (entry["level"], entry["logger"]) == ("warning", "sandboxd"), entry
