"""`toolenv stress` options: parsed (durations, headers), then checked against each other before a
run: an option the run would drop without a word (one of the other loop's, a ramp's without
`--ramp`) or an output it could not write is bad input (exit 2), found before the load rather
than after it."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import typer

from toolenv_core.outputs import output_file_problem, same_file

from .slo import SLO
from .spec import LoadSpec

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|min|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, None: 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """`10`, `10s`, `500ms`, `2m`, `1h` -> seconds."""
    m = _DURATION.match(text)
    if not m:
        raise typer.BadParameter(f"{text!r} is not a duration like 10s, 500ms, 2m or 1h")
    scale = _UNIT_S[m.group(2)]
    return float(m.group(1)) * scale


def duration_option(help_text: str) -> Any:
    """A duration option (`10s`, `500ms`, ...): click parses it, so a bad one names its option.
    Its default is written as a string too (`= "10s"`): click parses defaults alike."""
    return typer.Option(parser=parse_duration, metavar="DURATION", help=help_text)


def parse_headers(values: list[str]) -> dict[str, str]:
    """`-H 'Name: value'` options as a mapping."""
    out = {}
    for item in values:
        if ":" not in item:
            raise typer.BadParameter(f"header {item!r} must look like 'Name: value'")
        name, value = item.split(":", 1)
        out[name.strip()] = value.strip()
    return out


def check_open_loop(spec: LoadSpec, slos: list[SLO], *, ramp: bool) -> None:
    """What only an open loop has (a target rate) asked of a closed loop: refused before the run
    (`--ramp` was a traceback after it; `--slo rate=` always BROKEN, exit 1)."""
    if spec.arrival != "closed":
        return
    if ramp:
        raise ValueError("--ramp steps an open-loop rate: use --arrival constant or poisson")
    for s in slos:
        if s.metric == "rate":
            raise ValueError(
                f"--slo {s.text}: a closed loop has no target rate to reach; "
                "use --arrival constant or poisson, or drop this SLO"
            )


def given(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave option `name` (by name: typer carries its own copy of click's enum)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"


def check_ramp_options(ctx: typer.Context, *, ramp: bool) -> None:
    """A ramp's option without `--ramp` ran one plain run, and `--duration` with it was dropped
    (each step is `--step-duration` long), each without a word: refused."""
    if ramp and given(ctx, "duration"):
        raise ValueError("--duration is one run's length: a ramp's steps are --step-duration long")
    if not ramp:
        for name in ("ramp_max", "ramp_factor", "ramp_step", "step_duration"):
            if given(ctx, name):
                option = "--" + name.replace("_", "-")
                raise ValueError(f"{option} shapes a ramp: add --ramp, or drop {option}")


def check_loop_options(ctx: typer.Context, spec: LoadSpec) -> None:
    """An option of the other loop, given: refused (`--concurrency 32` ran an open loop at the
    default 100 rps, and `--rate` in a closed loop was dropped, each without a word)."""

    if spec.arrival != "closed" and given(ctx, "concurrency"):
        raise ValueError(
            f"--concurrency sets a closed loop's callers, and --arrival {spec.arrival} is an "
            "open loop at --rate: add --arrival closed, or drop --concurrency"
        )
    if spec.arrival == "closed" and given(ctx, "rate"):
        raise ValueError(
            "--rate sets an open loop's rate, and a closed loop's callers send back to back: "
            "drop --rate, or use --arrival constant or poisson"
        )
    if spec.arrival == "closed" and given(ctx, "max_in_flight"):
        raise ValueError(
            "--max-in-flight bounds an open loop's outstanding requests; a closed loop has "
            "--concurrency of them: drop --max-in-flight"
        )


def check_outputs(**paths: Path | None) -> None:
    """Each output is a file in a folder that exists: found before the run, not after it."""
    for option, path in paths.items():
        if path is not None and (problem := output_file_problem(path)):
            raise ValueError(f"--{option} {path}: {problem}")
    given = [(option, path) for option, path in paths.items() if path is not None]
    for (first, a), (second, b) in itertools.combinations(given, 2):
        if same_file(a, b):  # `--out r --hdr r`: the HDR log was written over the report, exit 0
            raise ValueError(f"--{second} {b}: is --{first} too; name another file")
