"""`pip install .` gives a working console script, and the CLI answers at every level."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version
from typer.testing import CliRunner

from toolenv.cli import build_app
from toolenv_core import __version__

app = build_app()

REPO = Path(__file__).resolve().parents[2]


def test_pip_install_into_fresh_venv_gives_working_toolenv(tmp_path: Path) -> None:
    # Copy the tree without the venv so the build sees only the project.
    src = tmp_path / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info", "build", "__pycache__"),
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # Dependencies come from the test venv (a .pth line), the project itself from the fresh build.
    # pip runs *as* the fresh venv (--python), so it leaves alone what lies outside that environment.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(src),
        ],
        check=True,
    )
    exe = venv / "bin" / "toolenv"
    assert exe.exists(), "the toolenv console script was not installed"
    out = subprocess.run(
        [str(venv / "bin" / "python"), str(exe), "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "serve" in out.stdout and "sandboxd" in out.stdout
    # The installed copy is the one that ran, not the source tree's (nor one on PYTHONPATH).
    clean_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import toolenv; print(toolenv.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_env,
    )
    assert str(venv) in where.stdout
    # The PolyTrace manifest ships inside the package (the traces themselves never do).
    listed = subprocess.run(
        [str(venv / "bin" / "python"), str(exe), "traces", "list", "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_env,
    )
    assert listed.returncode == 0, listed.stderr
    assert len(json.loads(listed.stdout)["files"]) == 45
    # the license the metadata names ships as its text (it was named, and shipped nowhere)
    [license_file] = site.glob("toolenv-*.dist-info/licenses/LICENSE")
    assert "Apache License" in license_file.read_text().splitlines()[0]
    # and so do the shipped latency profiles, named from any directory
    described = subprocess.run(
        [str(venv / "bin" / "python"), str(exe), "emulators", "describe", "search_default"],
        capture_output=True, text=True, cwd=tmp_path, env=clean_env,
    )  # fmt: skip
    assert described.returncode == 0, described.stderr


def test_build_requires_a_setuptools_that_reads_this_pyproject() -> None:
    """`license = "Apache-2.0"` (an SPDX string, PEP 639) is read from setuptools 77.0.1 on. With
    the declared `setuptools>=68`, a build from a wheelhouse holding setuptools 75 (`pip wheel
    --no-index --find-links DIR .`) took it and stopped at "invalid pyproject.toml config:
    `project.license`"; now pip says no setuptools>=77.0.1 is there. (The test above builds on
    the test venv's newer setuptools.)"""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    [setuptools] = [
        Requirement(r) for r in pyproject["build-system"]["requires"] if r.startswith("setuptools")
    ]
    floor = min(Version(s.version) for s in setuptools.specifier if s.operator == ">=")
    if isinstance(pyproject["project"]["license"], str):
        assert floor >= Version("77.0.1"), f"{setuptools}: an SPDX license string needs >=77.0.1"


def _command_paths(cmd, prefix=()):  # every command path in the click tree
    yield prefix
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _command_paths(sub, (*prefix, name))


def test_help_at_every_level_and_version() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output
    import typer.main

    paths = list(_command_paths(typer.main.get_command(app)))
    assert len(paths) > 3
    for path in paths:
        result = runner.invoke(app, [*path, "--help"])
        assert result.exit_code == 0, f"toolenv {' '.join(path)} --help failed: {result.output}"
        assert "Usage" in result.output


def test_config_show_layers_file_and_env(tmp_path: Path, monkeypatch) -> None:
    cfg = tmp_path / "toolenv.yaml"
    cfg.write_text("gateway:\n  port: 9191\n  log_level: debug\n")
    monkeypatch.setenv("TOOLENV_GATEWAY_LOG_LEVEL", "warning")
    result = CliRunner().invoke(app, ["config", "show", "--json", "--config", str(cfg)])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["gateway"]["port"] == 9191  # from the file
    assert shown["gateway"]["log_level"] == "warning"  # env beats file
    assert set(shown) >= {"gateway", "sandbox", "emulators", "rollout"}


def test_config_show_names_each_section_and_prints_values_as_given(tmp_path: Path) -> None:
    """rich read each title's `[gateway]` as a markup tag: the tables said only `env prefix
    TOOLENV_GATEWAY_`, no section; a value in brackets (`[bold]`) was swallowed the same way."""
    cfg = tmp_path / "toolenv.yaml"
    cfg.write_text("sandbox:\n  workdir_root: /tmp/[bold]runs\n")
    result = CliRunner().invoke(app, ["config", "show", "--config", str(cfg)])
    assert result.exit_code == 0, result.output
    for section in ("gateway", "sandbox", "emulators", "rollout", "traces", "ray"):
        assert f"[{section}]  env prefix TOOLENV_{section.upper()}_" in result.output
    assert "/tmp/[bold]runs" in result.output


def test_config_show_reports_a_bad_file_clearly(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["config", "show", "--config", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert "does not exist" in result.output
