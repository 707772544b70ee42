#!/usr/bin/env bash
# Build the toolenv service image the offline way (machines whose containers reach no package
# index): dependency wheels built on the host into compose/wheelhouse/, this machine kind's local
# Debian base image, then `docker compose build` (compose/Dockerfile).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/build_wheelhouse.sh"
export TOOLENV_BASE_IMAGE="${TOOLENV_BASE_IMAGE:-toolenv/debian-base:bookworm}"
cd "$root"
docker compose build --quiet
echo "[setup] built ${TOOLENV_IMAGE:-toolenv/toolenv:dev} from $TOOLENV_BASE_IMAGE"
