"""What the `toolenv rollout` subcommands share: defaults shown in `--help`, one-line errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import typer
from pydantic import ValidationError

from toolenv_core.config import config_error
from toolenv_core.errors import first_problem
from toolenv_core.outputs import output_dir_problem

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


@contextlib.contextmanager
def out_dir_for_run(out_dir: Path) -> Iterator[None]:
    """The output directory, made before the run: one that cannot be made or written in is a bad
    option, found before minutes of work rather than after them (an existing read-only one failed
    only at the first report). A run that fails leaves no empty one behind."""
    if (problem := output_dir_problem(out_dir)) is not None:
        fail(f"--out {out_dir}: {problem}")
    try:
        fresh = not out_dir.exists()
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # checked a moment ago: only a race gets here, said in one line
        fail(f"--out {out_dir}: cannot make the directory: {exc.strerror or exc}")
    try:
        yield
    except BaseException:
        if fresh:
            with contextlib.suppress(OSError):
                out_dir.rmdir()  # only while empty
        raise


def tool_pairs(values: list[str], option: str) -> dict[str, str]:
    """`["search=a.yaml"]` -> `{"search": "a.yaml"}`, with a clear error for a malformed pair."""
    pairs: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise typer.BadParameter(f"{option} takes TOOL=FILE, got {value!r}")
        if name in pairs:  # the last one silently replaced the first
            raise typer.BadParameter(
                f"{option} names {name!r} twice ({pairs[name]} and {path}): one file per tool"
            )
        pairs[name] = path
    return pairs


# An option that shapes one policy part, and that part: without it the option does nothing.
_PART_OPTIONS = {
    "tool_timeout_s": ("--tool-timeout", "timeout"),
    "overlap_ratio": ("--overlap-ratio", "overlap"),
    "overlap_unfinished": ("--unfinished", "overlap"),
    "hedge_quantile": ("--hedge-quantile", "hedge"),
}


# An option that shapes some workloads (chosen by --trace, --synthetic or --live), and those.
_WORKLOAD_OPTIONS = {
    "sample": ("--sample", ("--trace",)),
    "length_scale": ("--length-scale", ("--trace", "--synthetic")),
    "max_prompt": ("--max-prompt", ("--trace", "--synthetic")),
    "max_output": ("--max-output", ("--trace", "--synthetic")),
    "max_append": ("--max-append", ("--trace", "--synthetic")),
    "live_max_turns": ("--max-turns", ("--live",)),
    "live_max_tokens": ("--max-tokens", ("--live",)),
}


def idle_option_notes(settings: RolloutSettings, given: set[str], workload: str) -> list[str]:
    """Notes on options given on the command line that this run ignores (`--tool-timeout 0.5`
    under the default `async` policy ran with no deadline, `--sample 0.1 --synthetic` drew every
    trajectory, both silently). `workload` is the option that chose it (`--trace`...)."""
    parts = {p.strip() for p in settings.policy.split("+")}
    notes = [
        f"note: {flag} has no effect: --policy {settings.policy} has no {part} part "
        f"(e.g. --policy {settings.policy}+{part})"
        for key, (flag, part) in _PART_OPTIONS.items()
        if key in given and part not in parts
    ]
    notes += [
        f"note: {flag} has no effect with {workload}: it shapes {' and '.join(shaped)}"
        for key, (flag, shaped) in _WORKLOAD_OPTIONS.items()
        if key in given and workload not in shaped
    ]
    if "time_scale" in given and (settings.engine != "sim" or settings.clock == "virtual"):
        where = "--clock virtual never sleeps" if settings.engine == "sim" else "a real engine"
        notes.append(
            f"note: --time-scale has no effect here ({where}): it compresses --engine sim on "
            "the wall clock"
        )
    return notes


def one_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return ": ".join(first_problem(exc))
    text = config_error(exc)  # a TOOLENV_ROLLOUT_* variable's bad JSON named, not wrapped
    return text.splitlines()[0] if text else type(exc).__name__
