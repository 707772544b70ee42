"""The `toolenv stress` app as the CLI tests call it: in process, 200 columns wide."""

from __future__ import annotations

from click.testing import Result
from typer.testing import CliRunner

from stress.cli import build_app

runner = CliRunner()
app = build_app()


def invoke(*args: str) -> Result:
    return runner.invoke(app, list(args), catch_exceptions=False, env={"COLUMNS": "200"})
