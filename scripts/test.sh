#!/usr/bin/env bash
# The test suite: set up .venv, then run pytest (distributed tests use a pool
# of 4 CPU ranks over gloo).  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q "$@"
