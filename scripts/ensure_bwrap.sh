#!/usr/bin/env bash
# The embedded default isolates sandboxes with bubblewrap: install it when missing. A user who
# chose to run code unisolated (TOOLENV_SANDBOX_INSECURE_NO_ISOLATION, as the hint below says)
# needs no bwrap: the service starts without it.
set -euo pipefail
command -v bwrap >/dev/null 2>&1 && exit 0
case "$(printf '%s' "${TOOLENV_SANDBOX_INSECURE_NO_ISOLATION:-}" | tr '[:upper:]' '[:lower:]')" in
  1 | true | t | yes | y | on)
    echo "[setup] no bubblewrap: sandboxed code runs unisolated (TOOLENV_SANDBOX_INSECURE_NO_ISOLATION)" >&2
    exit 0
    ;;
esac
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing bubblewrap"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null
else
  echo "toolenv: the sandbox needs bubblewrap (bwrap). Install it: sudo apt-get install bubblewrap" >&2
  echo "  (or start with TOOLENV_SANDBOX_INSECURE_NO_ISOLATION=true to run code unisolated)" >&2
  exit 1
fi
