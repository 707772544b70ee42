"""toolenv on a Ray cluster: the gateway as a Serve ingress, sandboxd and the emulators as
Serve deployments (`toolenv serve --ray [ADDRESS]`, or `serve run toolenv.ray:build`)."""

from .app import RayStack, build, build_application, deploy

__all__ = ["RayStack", "build", "build_application", "deploy"]
