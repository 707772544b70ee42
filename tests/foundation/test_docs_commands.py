"""The README and docs as a new user reads them: repository paths they name exist, the
documented `emulators describe` command runs as printed (shell continuation lines joined), and
every benchmark command they give is accepted as written."""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import shlex
import sys
from pathlib import Path
from typing import Any

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


# `python -m benchmarks.NAME ARGS` (or `stress.NAME`, its test servers) in backticks (a span may
# wrap) or on a code block's line (up to a `# comment`); `[--opt]` is optional, `FILE` a placeholder.
SPAN = re.compile(r"`(?:[^`]*\s)?python -m ((?:benchmarks|stress)\.\w+)([^`]*)`")
LINE = re.compile(r"^(?:.*\s)?python -m ((?:benchmarks|stress)\.\w+)([^#]*)")


class _Parsed(Exception):
    """Raised once a benchmark's arguments parsed, so that nothing of it runs."""


def _documented_bench_commands() -> list[tuple[str, list[str]]]:
    commands = set()
    for doc in DOCS:
        prose, code, fenced = [], [], False
        for line in doc.read_text().splitlines():
            if line.startswith("```"):
                fenced = not fenced
            else:
                (code if fenced else prose).append(line)
        found = SPAN.findall("\n".join(prose))
        found += [m for line in code for m in LINE.findall(line)]
        for module, args in found:
            argv = [a for a in re.sub(r"\[[^\]]*\]", " ", args).split()]
            for i, arg in enumerate(argv):  # `--route gateway|generic`: one of them
                argv[i] = arg.split("|", 1)[0]
            commands.add((module, tuple(argv)))
    return sorted((m, list(a)) for m, a in commands)


def test_every_documented_benchmark_command_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's "the command beside each row runs one" holds: each benchmark command the
    docs give is accepted as written (`emulators_bench --rates 1000` was refused for a missing
    `--out`, and docs/cli.md's stalling server `stress.testing --kind stall` for a missing
    `--port`)."""
    commands = _documented_bench_commands()
    assert len(commands) > 10  # the pattern still finds them
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        parse(self, *a, **k)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    refused = []
    for module, argv in commands:
        monkeypatch.setattr(sys, "argv", [module, *argv])
        main = importlib.import_module(module).main
        try:
            main(argv) if inspect.signature(main).parameters else main()
        except _Parsed:
            continue
        except SystemExit:
            refused.append(f"python -m {module} {' '.join(argv)}")
    assert not refused, refused
