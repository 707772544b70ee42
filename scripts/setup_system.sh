#!/usr/bin/env bash
# Idempotent system set-up for the test suite: Debian packages, a running dockerd, Compose v2,
# and the locally built Debian base image. Safe to run again: every step checks first.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

need_pkgs=()
command -v dockerd >/dev/null 2>&1 || need_pkgs+=(docker.io)
command -v bwrap >/dev/null 2>&1 || need_pkgs+=(bubblewrap)
command -v debootstrap >/dev/null 2>&1 || need_pkgs+=(debootstrap)
command -v wrk >/dev/null 2>&1 || need_pkgs+=(wrk)
command -v ip >/dev/null 2>&1 || need_pkgs+=(iproute2)  # the Ray tests' network namespaces
command -v pgrep >/dev/null 2>&1 || need_pkgs+=(procps)
if ((${#need_pkgs[@]})); then
  if [ "$(id -u)" != 0 ]; then
    echo "toolenv setup: missing system packages: ${need_pkgs[*]}" >&2
    echo "  install them as root: sudo apt-get install -y ${need_pkgs[*]}" >&2
    exit 1
  fi
  log "apt-get install ${need_pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

"$here/start_dockerd.sh"
"$here/install_compose.sh"
"$here/build_base_image.sh"
"$here/build_sandbox_image.sh"
log "system ready"
