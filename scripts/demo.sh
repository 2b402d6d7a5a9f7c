#!/usr/bin/env bash
# The main job: shard the pretrained SmolLM2-135M-Instruct over 2 local CPU
# processes and show that it works (logits check, a chat answer, fine-tuning).
# Extra arguments go to examples/tp_demo.py: --model DIR, --random-init,
# --tp 4, --steps, --new-tokens, --threads, --all-optimization (--help lists all).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python examples/tp_demo.py "$@"
