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
