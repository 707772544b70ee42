"""The README and docs as a new user reads them: repository paths they name exist, and the
documented `emulators describe` command runs as printed (shell continuation lines joined)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from toolenv.cli import build_app

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `dir/file.ext` in backticks whose first part is a top-level directory of the repository.
PATH = re.compile(r"`([A-Za-z_][\w-]*/[\w./-]+\.(?:py|ya?ml|sh|toml|json|md))`")
TOP = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}


def test_repository_paths_named_in_the_docs_exist() -> None:
    named = {(doc.name, m) for doc in DOCS for m in PATH.findall(doc.read_text())}
    in_repo = {(doc, p) for doc, p in named if p.split("/", 1)[0] in TOP}
    assert len(in_repo) > 20  # the pattern still finds the docs' paths
    missing = sorted(f"{doc}: {p}" for doc, p in in_repo if not (ROOT / p).exists())
    assert not missing, missing


def _console_command(doc: Path, prefix: str) -> list[str]:
    """The first `$ <prefix> ...` line of a console block, with its `\\` continuations."""
    lines = doc.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"$ {prefix}"))
    text = lines[start][2:]
    while text.endswith("\\"):
        start += 1
        text = text[:-1] + " " + lines[start].strip()
    return shlex.split(text)


def test_the_documented_describe_command_runs(
    polytrace_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = _console_command(ROOT / "docs" / "cli.md", "toolenv emulators describe")
    assert argv[:3] == ["toolenv", "emulators", "describe"]
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("TOOLENV_TRACES_CACHE_DIR", str(polytrace_dir))
    args = [str(tmp_path / a) if a.endswith(".png") else a for a in argv[1:]]
    result = CliRunner().invoke(build_app(), [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert '"ks_model_vs_data"' in result.stdout
