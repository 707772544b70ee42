"""`--help` says what an option does when it is left out: the value, or where it comes from."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import typer

from toolenv.cli import build_app

ROOT = typer.main.get_command(build_app())


def _is_option(param: Any) -> bool:
    return param.param_type_name == "option"  # typer's options are not click.Option subclasses


def _option(path: list[str], name: str) -> Any:
    command = ROOT
    for part in path:
        command = command.commands[part]  # type: ignore[attr-defined]
    return next(p for p in command.params if _is_option(p) and name in p.opts)


@pytest.mark.parametrize(
    "path, name, said",
    [
        # each of these left its default unsaid: None in the signature, worked out at run time
        (["stress"], "--connections", "--max-in-flight open loop"),
        (["stress"], "--preconnect", "rate/250"),
        (["stress"], "--seed", "a fresh one"),
        (["emulators", "serve"], "--reward-profile", "the shipped one"),
        (["emulators", "serve"], "--seed", "default 0"),
        (["emulators", "serve"], "--corpus", "synthetic documents"),
        (["traces", "list"], "--dest", "~/.cache/toolenv/polytrace"),
    ],
)
def test_an_option_resolved_at_run_time_says_its_default(
    path: list[str], name: str, said: str
) -> None:
    option = _option(path, name)
    assert option.default is None  # so click has no value to show; the help must say it
    assert "default" in (option.help or "") and said in (option.help or ""), option.help


def test_every_stress_option_says_its_default() -> None:
    """Every value option of `toolenv stress` either shows a default or names it in its help,
    except the target and payload options, which have none by design."""
    no_default = {"--url", "--gateway", "--tool", "--body", "--body-file", "--arguments"}
    no_default |= {"--payload", "--out", "--plot", "--hdr"}
    stress = ROOT.commands["stress"]  # type: ignore[attr-defined]
    for p in stress.params:
        if not _is_option(p) or p.is_flag or p.multiple or p.opts[0] in no_default:
            continue
        assert p.default is not None or "default" in (p.help or ""), p.opts


def test_the_cli_starts_without_loading_scipy_stats() -> None:
    """scipy.stats takes about 0.9 s to import: every `toolenv` command paid it at start, `--help`
    too, though most never sample a distribution. It loads on first use instead."""
    code = (
        "import sys, toolenv.cli; print(sorted(m for m in sys.modules if m.startswith('scipy.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    loaded = done.stdout
    assert "scipy.stats" not in loaded and "scipy.optimize" not in loaded, loaded
