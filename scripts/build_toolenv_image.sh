#!/usr/bin/env bash
# Build the toolenv service image used by compose: dependency wheels built on the host (cached by
# pyproject hash), the project's own wheel fresh each time, installed in the image with no index.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
image="${TOOLENV_IMAGE:-toolenv/toolenv:dev}"
base="${TOOLENV_BASE_IMAGE:-toolenv/debian-base:bookworm}"
hash="$(sha256sum "$root/pyproject.toml" | cut -c1-16)"
cache="${TOOLENV_WHEEL_CACHE:-$HOME/.cache/toolenv/wheels}/$hash"

if [ ! -f "$cache/.complete" ]; then
  echo "[setup] building dependency wheels for the toolenv image (cached in $cache)"
  rm -rf "$cache"; mkdir -p "$cache"
  # The same versions the test venv runs, so the image behaves like the tests.
  "$python" -m pip freeze --exclude-editable | grep -v '^-e' > "$cache/constraints.txt"
  "$python" -m pip wheel -q -c "$cache/constraints.txt" -w "$cache" "$root" pip
  rm -f "$cache"/toolenv-*.whl
  touch "$cache/.complete"
fi

ctx="$(mktemp -d)"
# setuptools leaves build/ in the tree, and stale files there would ride along in the next wheel.
trap 'rm -rf "$ctx" "$root/build"' EXIT
rm -rf "$root/build"
mkdir -p "$ctx/deps" "$ctx/app"
cp -l "$cache"/*.whl "$ctx/deps/" 2>/dev/null || cp "$cache"/*.whl "$ctx/deps/"
"$python" -m pip wheel -q --no-deps --no-build-isolation -w "$ctx/app" "$root"
cp "$root/compose/Dockerfile" "$ctx/Dockerfile"
echo "[setup] building $image from $base"
docker build -q --build-arg "BASE_IMAGE=$base" -t "$image" "$ctx" >/dev/null
echo "[setup] built $image"
