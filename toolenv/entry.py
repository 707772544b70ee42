"""The `toolenv` console script (and `python -m toolenv`). Ctrl-C while the command loads (its
imports and the app's build, about 1.5 s) ends it with exit 130 and no traceback: Python's own
handling printed 15 to 25 lines of importlib and pydantic frames. Once a command runs, its own
Ctrl-C handling applies."""

from __future__ import annotations

import sys

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command Ctrl-C ended

try:
    from toolenv.cli import build_app
except KeyboardInterrupt:
    sys.exit(INTERRUPTED)


def main() -> None:
    try:
        app = build_app()
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED)
    app()
