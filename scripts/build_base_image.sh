#!/usr/bin/env bash
# Build the local Debian base image (debootstrap + docker import) when it is absent.
# Real users keep a public base image; this machine kind has no registry to pull from.
set -euo pipefail
image="${TOOLENV_BASE_IMAGE:-toolenv/debian-base:bookworm}"
if docker image inspect "$image" >/dev/null 2>&1; then exit 0; fi
if docker pull -q debian:bookworm-slim >/dev/null 2>&1; then
  docker tag debian:bookworm-slim "$image"; exit 0
fi
echo "[setup] building base image $image with debootstrap (about 40 s)"
rootfs="$(mktemp -d /var/tmp/toolenv-rootfs.XXXXXX)"; trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase --include=python3,gcc,g++,libc6-dev bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | docker import - "$image" >/dev/null
echo "[setup] built $image"
