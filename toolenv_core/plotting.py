"""Matplotlib for the reports' PNGs, loaded on first use.

`matplotlib.pyplot` takes about 0.6 s to import, so the services and the CLI load it only when a
command writes a plot; it draws to files with the Agg backend, never to a screen.
"""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType:
    """`matplotlib.pyplot`, on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
