#!/usr/bin/env bash
# The main job: shard a HuggingFace Llama over 2 local CPU processes and show
# that it works.  Extra arguments go to examples/llama_tp.py (e.g. --model DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python examples/llama_tp.py "$@"
