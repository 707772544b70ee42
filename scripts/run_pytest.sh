#!/usr/bin/env bash
# Run the whole suite with the test model and offline Hugging Face settings in place.
set -euo pipefail
py="$1"; shift
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export TOOLENV_TEST_MODEL="${TOOLENV_TEST_MODEL:-$HOME/.cache/toolenv/models/tiny-llama}"
# the slowest tests are listed at the end: the whole suite must stay well under 30 min on 2 cores
exec "$py" -m pytest --durations=15 "$@"
