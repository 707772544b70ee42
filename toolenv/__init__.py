"""toolenv: the `toolenv` command, the one place that wires the services together.

Nothing imports this package: the services import only `toolenv_core`, and this package builds
their settings and applications explicitly and hands them to one another.
"""

from toolenv_core import __version__

__all__ = ["__version__"]
