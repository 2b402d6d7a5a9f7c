#!/usr/bin/env bash
# The main job: load the pretrained SmolLM2-135M-Instruct sharded over 2 local
# CPU processes (each rank reads only its slices of the checkpoint; the GGUF
# file is converted once to safetensors in ~/.cache/shardformer) and show that
# it works: logits check, a chat answer, fine-tuning, save_pretrained and a
# plain-transformers reload of what it saved.
# Extra arguments go to examples/tp_demo.py: --model DIR, --random-init,
# --tp 4, --steps, --new-tokens, --threads, --all-optimization, --save DIR,
# --sp split_gather|all_to_all|ring_attn (sequence parallelism), --pp 2 (pipeline
# stages: --tp x --pp processes)
# (--help lists all).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python examples/tp_demo.py "$@"
