"""The console every command prints its human-readable report to.

Piped or redirected (`| tee`, CI logs), rich assumes 80 columns and cuts table cells short
("3252…" for a latency, "multiturn_…" for a file); a report console then gets REPORT_WIDTH
instead, unless COLUMNS says otherwise. Progress bars and errors keep rich's own console.
"""

from __future__ import annotations

import os

from rich.console import Console

REPORT_WIDTH = 120


def report_console(*, stderr: bool = False) -> Console:
    """A console for a report: the terminal's width, or REPORT_WIDTH when not a terminal."""
    console = Console(stderr=stderr)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console.width = max(console.width, REPORT_WIDTH)
    return console


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`1 step`, `2 steps`, `3 trajectories`: a count and its noun in agreement ("1 steps" read
    wrong in reports). A regular plural adds -s (-ies after a consonant and y); pass `plural`
    for any other."""
    if n == 1:
        return f"{n} {noun}"
    if plural is None:
        consonant_y = noun.endswith("y") and noun[-2:-1] not in tuple("aeiou")
        plural = noun[:-1] + "ies" if consonant_y else noun + "s"
    return f"{n} {plural}"
