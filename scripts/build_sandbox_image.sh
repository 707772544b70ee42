#!/usr/bin/env bash
# Build the Docker backend's sandbox image (sandboxd/image/Dockerfile) when it is absent or stale.
# Idempotent: skipped when the image exists and its toolenv.sandbox.source-hash label matches the
# sha256 of Dockerfile + agent.py + agent_reset.py (the same hash sandboxd/docker_backend/image.py computes).
# The base image is a build argument: TOOLENV_BASE_IMAGE (this machine kind's local Debian base).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="$here/../sandboxd/image"
image="${TOOLENV_SANDBOX_DOCKER_IMAGE:-toolenv/sandbox:0.1.0}"
base="${TOOLENV_BASE_IMAGE:-toolenv/debian-base:bookworm}"
hash="$(cat "$src/Dockerfile" "$src/agent.py" "$src/agent_reset.py" | sha256sum | cut -d' ' -f1)"
have="$(docker image inspect -f '{{ index .Config.Labels "toolenv.sandbox.source-hash" }}' "$image" 2>/dev/null || true)"
if [ "$have" = "$hash" ]; then exit 0; fi
echo "[setup] building sandbox image $image from $base"
docker build -q --build-arg "BASE_IMAGE=$base" --label "toolenv.sandbox.source-hash=$hash" \
  -t "$image" "$src" >/dev/null
echo "[setup] built $image"
