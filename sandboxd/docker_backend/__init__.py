"""The `docker` sandbox backend: a warm pool of containers from the project's sandbox image.

Imported lazily by the service (`settings.backend == "docker"`), so the process backend never
needs the docker SDK or an engine.
"""

from .backend import DockerBackend

__all__ = ["DockerBackend"]
