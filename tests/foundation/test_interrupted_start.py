"""Ctrl-C while `toolenv` loads (`toolenv.entry`): exit 130, no traceback."""

from __future__ import annotations

import signal
import subprocess
import sys


def test_ctrl_c_while_the_command_loads_is_exit_130_without_a_traceback() -> None:
    """It was Python's KeyboardInterrupt traceback, 15 to 25 lines of importlib frames. The press
    lands inside the import of the command's modules: `-X importtime` says when typer
    has loaded, among the first of `toolenv.cli`'s imports, with over half a second to go (had
    the command loaded, it would have served, and stopped with exit 0)."""
    command = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "toolenv", "serve", "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert command.stderr is not None
        said = []
        for line in command.stderr:
            said.append(line)
            if line.rsplit("|", 1)[-1].strip() == "typer":
                command.send_signal(signal.SIGINT)
                break
        rest = command.stderr.read()
        assert command.wait(timeout=60) == 130, rest
    finally:
        command.kill()
    assert said and said[-1].rsplit("|", 1)[-1].strip() == "typer", said[-3:]
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
