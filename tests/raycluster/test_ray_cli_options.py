"""What `toolenv serve --ray` takes from its own options against the config file, and what it
refuses before any cluster is dialled or started. The connection itself is replaced by a recorder
(`init_ray`): these tests must not start a Ray cluster, which binds every interface."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import toolenv.ray.app as ray_app
from toolenv.cli import build_app
from toolenv.ray.app import RayStack, build_application
from toolenv.ray.ingress import gateway_url, readyz_problem
from toolenv_core.ray_connect import RayUnreachable


@pytest.fixture
def dialled(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The addresses the command would connect to; each connection then fails at once. The
    command installs its own stop-signal handlers: pytest's are put back afterwards."""
    calls: list[str] = []

    def record(address: str, **_: Any) -> None:
        calls.append(address)
        raise RayUnreachable(f"recorded {address}")

    monkeypatch.setattr(ray_app, "init_ray", record)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield calls
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _serve(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(build_app(), ["serve", "--ray", *args])
    return result.exit_code, " ".join(result.output.split())


def test_ray_local_wins_over_the_config_files_address(tmp_path: Path, dialled: list[str]) -> None:
    """`--ray local` starts a new cluster even when the file names one (it dialled the file's)."""
    config = tmp_path / "c.yaml"
    config.write_text("ray:\n  address: 127.0.0.1:1\n")
    code, said = _serve("local", "-c", str(config))
    assert dialled == ["local"], said
    assert code == 1 and "recorded local" in said


def test_ray_local_wins_over_the_environments_address(
    monkeypatch: pytest.MonkeyPatch, dialled: list[str]
) -> None:
    monkeypatch.setenv("TOOLENV_RAY_ADDRESS", "127.0.0.1:1")
    _serve("local")
    assert dialled == ["local"]


@pytest.mark.parametrize(
    ("config", "args"),
    [("ray:\n  http_host: 0.0.0.0\n", []), ("", ["--host", "0.0.0.0"])],
    ids=["http_host", "--host"],
)
def test_an_open_non_loopback_bind_is_refused_before_any_cluster(
    tmp_path: Path, dialled: list[str], config: str, args: list[str]
) -> None:
    """As `toolenv serve --host 0.0.0.0` refuses: the gateway replicas run programs for anyone
    who reaches the node (it deployed them open on every node's address)."""
    path = tmp_path / "c.yaml"
    path.write_text(config)
    code, said = _serve("local", "-c", str(path), *args)
    assert code == 2, said
    assert "refusing to bind 0.0.0.0 without API keys" in said
    assert dialled == []


def test_allow_unauthenticated_or_keys_let_it_bind(
    tmp_path: Path, dialled: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("ray:\n  http_host: 0.0.0.0\n")
    _serve("local", "-c", str(path), "--allow-unauthenticated")
    monkeypatch.setenv("TOOLENV_GATEWAY_API_KEYS", "k1")
    _serve("local", "-c", str(path))
    assert dialled == ["local", "local"]


def test_the_serve_config_entry_point_refuses_an_open_bind_too(tmp_path: Path) -> None:
    """`serve run toolenv.ray:build` / KubeRay build the application from the file alone."""
    path = tmp_path / "c.yaml"
    path.write_text("ray:\n  http_host: 0.0.0.0\n")
    with pytest.raises(ValueError, match="refusing to bind 0.0.0.0 without API keys"):
        build_application(RayStack.load(str(path)))
    path.write_text("ray:\n  http_host: 0.0.0.0\ngateway:\n  api_keys: [k1]\n")
    build_application(RayStack.load(str(path)))


class _Ready(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/readyz" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def test_an_ipv6_http_host_is_waited_for_in_brackets() -> None:
    """`ray.http_host: "::1"`: the readiness check reaches the gateway on [::1] (it raised
    httpx's `InvalidURL` with a traceback once the application had deployed)."""
    server = _V6Server(("::1", 0), _Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        url = gateway_url("::1", port)
        assert url == f"http://[::1]:{port}"
        assert asyncio.run(readyz_problem(url)) is None
        assert gateway_url("127.0.0.1", port) == f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_gateway_that_could_scale_to_zero_is_a_config_error(
    tmp_path: Path, dialled: list[str]
) -> None:
    """No gateway replica means no HTTP entry point and nothing that could scale one up: it
    deployed, then waited out the ready timeout on "Connection refused"."""
    path = tmp_path / "c.yaml"
    path.write_text("ray:\n  gateway: {min_replicas: 0, max_replicas: 2}\n")
    code, said = _serve("local", "-c", str(path))
    assert code == 2, said
    assert "gateway.min_replicas must be at least 1" in said
    assert dialled == []


def test_an_empty_application_name_is_a_config_error(tmp_path: Path, dialled: list[str]) -> None:
    """Serve refuses it only once the cluster is up (a traceback after starting it)."""
    path = tmp_path / "c.yaml"
    path.write_text('ray:\n  app_name: ""\n')
    code, said = _serve("local", "-c", str(path))
    assert code == 2, said
    assert "app_name" in said and dialled == []
