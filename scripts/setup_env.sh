#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned dependencies and shardformer
# installed editable (this builds the C extension).  Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -r requirements-dev.txt
# --no-build-isolation: build against the pinned numpy/setuptools just installed.
SHARDFORMER_WERROR=1 .venv/bin/python -m pip install -q --no-build-isolation --no-deps -e .
.venv/bin/python -c "import shardformer._C, shardformer; print('shardformer', shardformer.__version__, 'ready in .venv')"
