"""What the `toolenv rollout` subcommands share: defaults shown in `--help`, one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer

from ..settings import RolloutSettings


def setting_default(field: str) -> str:
    """A setting's default as `--help` shows it (options default to None so that config files
    and TOOLENV_ROLLOUT_* variables can fill them in)."""
    value = RolloutSettings.model_fields[field].get_default(call_default_factory=True)
    return (
        "none"
        if value is None or value == []
        else str(value).lower()
        if isinstance(value, bool)
        else str(value)
    )


POLICY_HELP = (
    "sync|async, combinable with +timeout, +hedge (virtual clock) and +overlap "
    "(e.g. async+timeout+overlap)."
)


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def make_out_dir(out_dir: Path) -> None:
    """The output directory, made before the run: one that cannot be made is a bad option, found
    before minutes of work rather than after them."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"cannot make the output directory {out_dir} (--out): {exc.strerror or exc}")


def tool_pairs(values: list[str], option: str) -> dict[str, str]:
    """`["search=a.yaml"]` -> `{"search": "a.yaml"}`, with a clear error for a malformed pair."""
    pairs: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise typer.BadParameter(f"{option} takes TOOL=FILE, got {value!r}")
        pairs[name] = path
    return pairs


def one_line(exc: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
