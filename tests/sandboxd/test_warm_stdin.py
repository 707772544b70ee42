"""A warm sandbox's stdin: a pipe filled before its program runs, so within the pipe's buffer."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sbx_support import SandboxdServer

PROGRAMS = {
    "python": "import sys\nprint(len(sys.stdin.buffer.read()))",
    "bash": "wc -c",
}


@pytest.fixture(scope="module")
def warm(sandboxd_factory: Callable[..., SandboxdServer]) -> SandboxdServer:
    """Python and bash programs take warm sandboxes (the fork server off: python's too)."""
    return sandboxd_factory(
        "--max-concurrency", "2",
        env={
            "TOOLENV_SANDBOX_FORK_SERVER": "false",
            "TOOLENV_SANDBOX_WARM_LANGUAGES": '["python", "bash"]',
        },
    )  # fmt: skip


@pytest.mark.parametrize("language", sorted(PROGRAMS))
@pytest.mark.parametrize("stdin", ["é" * 40_000, "x" * 65_536, "x" * 65_537])
def test_stdin_of_any_width_reaches_a_warm_program(
    warm: SandboxdServer, language: str, stdin: str
) -> None:
    """The warm path was chosen by characters: 40,000 'é' (80,000 bytes) filled the 64 KiB
    pipe before the program ran, blocking the event loop: the whole service hung."""
    r = warm.client.post(
        "/run_code", json={"code": PROGRAMS[language], "language": language, "stdin": stdin},
        timeout=20,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["status"] == "Success", res
    assert res["run_result"]["stdout"].strip() == str(len(stdin.encode()))
    assert warm.client.get("/v1/ping", timeout=5).json() == "pong"
