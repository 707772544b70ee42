"""toolenv: tool environments for RL on tool use.

The root package holds only what every other package shares: the version, the deadline carried
across HTTP hops, the configuration loader, and the console script that gathers each package's
subcommands.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("toolenv")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
