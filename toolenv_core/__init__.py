"""toolenv's shared core: the contracts every service uses, and nothing that runs a service.

Here live the deadline and its policy, the `X-Toolenv-*` header names, the configuration loader,
PolyTrace records and readers, latency profiles and their samplers, the one lean HTTP/1.1 client
and the one admission queue. This package imports none of the services (`sandboxd`, `emulators`,
`gateway`, `rollout_client`, `stress`); `import-linter` checks it in `make lint`.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("toolenv")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
