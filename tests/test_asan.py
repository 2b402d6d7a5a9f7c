"""Memory safety of shardformer._C: AddressSanitizer, reference leaks, warnings.

test_asan_driver
    Builds the extension with AddressSanitizer (setup.py honours
    SHARDFORMER_ASAN=1) into a temporary directory -- the in-place .so is not
    touched -- and runs tests/asan_driver.py in a subprocess with gcc's libasan preloaded
    (python itself is not instrumented).  The driver loads the ASan build
    under the name "shardformer._C" with ExtensionFileLoader *before*
    importing shardformer, so every `from . import _C` in the package gets
    the instrumented module (the driver checks this).  It then runs every C
    entry point, success and error paths, ITERATIONS times (60: a memory error
    shows on the first run; the repeats are for the kernel pool's threads, which
    resize between 2 and 3 workers on alternate runs).  PYTHONMALLOC=malloc
    sends every Python object allocation to ASan's malloc, so a use-after-free
    or overflow of a Python object (not only of our own buffers) is caught.
    The test asserts exit status 0, "DRIVER OK" on stdout and no
    "ERROR: AddressSanitizer" on stderr.

    test_unit_tests_under_asan runs all of test_c_core.py the same way.

    Leak checking is *off* under ASan (ASAN_OPTIONS=detect_leaks=0): CPython
    and torch leave plenty of memory allocated at exit, so LeakSanitizer
    reports would be noise.  Leaks of our own are checked by the next test.

test_no_reference_leaks
    Runs the same driver against the normal (in-place, -O3) build in "leaks"
    mode.  Each of ~80 cases is a single _C call -- every entry point, success
    and each kind of error path -- on inputs built once.  After a warm-up a
    case runs ITERATIONS times in each of two windows, and in each window we
    measure the growth of live pymalloc blocks (sys.getallocatedblocks(), a
    refcount-leak detector: a leaked tuple, int, capsule or array header is a
    block) and of the memory traced by tracemalloc (which also sees larger
    PyMem buffers, e.g. the range list of a call with many ranges).  One
    leaked object per call grows *both* windows by >= ITERATIONS blocks; the
    test fails when the smaller window grows by more than ITERATIONS / 10
    blocks or 16 bytes per call.  Each checkpoint clears CPython's type
    attribute cache (sys._clear_type_cache(): it holds a reference to up to
    4096 looked-up attribute names, hundreds of blocks of bounded noise) and
    collects garbage; what remains is a handful of blocks.  (Checked by hand:
    dropping the PyMem_Free of the range buffer or the view release of
    tensor_info makes both windows grow by ~ITERATIONS and the test fail.)
    gc.freeze() after the imports keeps the gc.collect() of each checkpoint
    cheap.  The "asan" scenarios also check that the refcount of a NumPy array
    handed to _C is unchanged: NumPy's DLPack capsule holds a reference to
    its array, so a capsule that is never released shows there.

test_sources_compile_warning_free
    gcc -std=c11 -Wall -Wextra -Werror on every .c file under csrc/, at any
    depth (csrc/kernels/, csrc/comm/ included), with -fsyntax-only (as the
    extension's contract says) and with -O2 (which enables the flow-based
    warnings such as -Wmaybe-uninitialized).  test_warning_check_covers_csrc
    checks that the list holds every source setup.py builds.

test_valgrind_driver (optional)
    The driver under valgrind memcheck, only when SHARDFORMER_VALGRIND=1
    (it takes minutes): no invalid reads/writes in frames of our module.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
CSRC = sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.c"), recursive=True))

# The driver: argv = MODE SO ITERATIONS TESTS (see its docstring).
DRIVER = os.path.join(TESTS, "asan_driver.py")


def _run_driver(tmp_path, mode, so, iterations, env_extra=None, prefix=(), timeout=300):
    env = dict(os.environ)
    env.update(env_extra or {})
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = list(prefix) + [sys.executable, DRIVER, mode, so, str(iterations), TESTS]
    return subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=timeout)


def _libasan():
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed")
    out = subprocess.run([gcc, "-print-file-name=libasan.so"], capture_output=True,
                         text=True).stdout.strip()
    # gcc prints the bare name back when it has no such library.
    if not os.path.isabs(out) or not os.path.exists(out):
        pytest.skip(f"gcc has no libasan.so (got {out!r})")
    return os.path.realpath(out)


@pytest.fixture(scope="module")
def asan_build(tmp_path_factory):
    libasan = _libasan()
    base = tmp_path_factory.mktemp("asan_build")
    env = dict(os.environ, SHARDFORMER_ASAN="1", SHARDFORMER_CUDA="0")   # _C alone (docs/cuda.md)
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(base / "lib"),
         "--build-temp", str(base / "tmp")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = glob.glob(str(base / "lib" / "shardformer" / "_C*.so"))
    assert len(found) == 1, found
    so = found[0]
    # Make sure it really is instrumented.
    if shutil.which("nm"):
        syms = subprocess.run(["nm", "-D", so], capture_output=True, text=True).stdout
        assert "__asan_" in syms, "the ASan build has no ASan symbols"
    return so, libasan


ASAN_OPTIONS = ":".join([
    "detect_leaks=0",  # see the module docstring
    "halt_on_error=1",
    "abort_on_error=0",
    "exitcode=86",
    "detect_stack_use_after_return=1",
    "strict_string_checks=1",
    "check_initialization_order=1",
    "allocator_may_return_null=1",
])


def test_asan_driver(asan_build, tmp_path):
    so, libasan = asan_build
    env = {"LD_PRELOAD": libasan, "ASAN_OPTIONS": ASAN_OPTIONS, "PYTHONMALLOC": "malloc"}
    proc = _run_driver(tmp_path, "asan", so, 60, env, timeout=240)
    report = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}"
    assert "ERROR: AddressSanitizer" not in proc.stderr, report
    assert proc.returncode == 0, report
    assert "DRIVER OK" in proc.stdout, report


PRELOAD_AND_PYTEST = r"""
import importlib.machinery, importlib.util, sys
so = sys.argv[1]
loader = importlib.machinery.ExtensionFileLoader("shardformer._C", so)
spec = importlib.util.spec_from_file_location("shardformer._C", so, loader=loader)
mod = importlib.util.module_from_spec(spec)
sys.modules["shardformer._C"] = mod
loader.exec_module(mod)
import pytest
import shardformer.layout
assert shardformer.layout._C is mod
sys.exit(pytest.main(sys.argv[2:]))
"""


def test_unit_tests_under_asan(asan_build, tmp_path):
    """test_c_core.py, all of it, against the ASan build."""
    so, libasan = asan_build
    env = dict(os.environ, LD_PRELOAD=libasan, PYTHONMALLOC="malloc",
               ASAN_OPTIONS=ASAN_OPTIONS)
    proc = subprocess.run(
        [sys.executable, "-c", PRELOAD_AND_PYTEST, so, "-q", "-p", "no:cacheprovider",
         os.path.join(TESTS, "test_c_core.py")],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=240)
    report = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}"
    assert "ERROR: AddressSanitizer" not in proc.stderr, report
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and "failed" not in proc.stdout, report


def test_shm_faults_under_asan(asan_build):
    """tests/test_shm_faults.py's scenarios (mismatched collectives, send/recv
    mismatches, timeouts and aborts, close during a call, overlapping calls,
    overflowing sizes, forged segment headers, Ctrl-C) against the ASan
    build: the same outcomes, and no ASan report (the scenario's child exits
    with ASan's exit code on one)."""
    import test_shm_faults

    so, libasan = asan_build
    env = dict(os.environ, LD_PRELOAD=libasan, PYTHONMALLOC="malloc", ASAN_OPTIONS=ASAN_OPTIONS)
    test_shm_faults.run_all(sys.executable, so, env)


def test_no_reference_leaks(tmp_path):
    """See the module docstring: allocations must not grow per call."""
    proc = _run_driver(tmp_path, "leaks", "-", 500, timeout=240)
    report = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    assert "DRIVER OK" in proc.stdout, report


def _compile_flags():
    import numpy

    # -fopenmp-simd as setup.py builds: the kernels' `#pragma omp simd` are
    # meaningful (not unknown pragmas) only with it.
    return ["-std=c11", "-fopenmp-simd", "-Wall", "-Wextra", "-Werror",
            "-I" + sysconfig.get_paths()["include"], "-I" + numpy.get_include(),
            "-I" + os.path.join(ROOT, "csrc")]


def test_warning_check_covers_csrc():
    """The warnings check sees every source the extension is built from,
    csrc/kernels/ and csrc/comm/ included."""
    rel = [os.path.relpath(p, ROOT) for p in CSRC]
    for must in ("csrc/module.c", "csrc/status.c", "csrc/glue.c", "csrc/cpu_features.c",
                 "csrc/kernels/attention.c", "csrc/kernels/common.c", "csrc/comm/nccl.c",
                 "csrc/comm/shm_segment.c", "csrc/comm/shm_wait.c",
                 "csrc/comm/shm_barrier.c", "csrc/comm/shm_collectives.c", "csrc/comm/shm_p2p.c",
                 "csrc/comm/reduce.c"):
        assert must in rel, (must, rel)
    assert any(r.startswith("csrc/kernels/") for r in rel)
    assert any(r.startswith("csrc/comm/") for r in rel)
    # Everything setup.py compiles (its own recursive glob), nothing less.
    built = sorted(glob.glob(os.path.join("csrc", "**", "*.c"), recursive=True, root_dir=ROOT))
    assert sorted(rel) == built


@pytest.mark.parametrize("source", CSRC, ids=lambda p: os.path.relpath(p, ROOT))
def test_sources_compile_warning_free(source, tmp_path):
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed")
    flags = _compile_flags()
    proc = subprocess.run([gcc, *flags, "-fsyntax-only", source], capture_output=True,
                          text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    # -O2 turns on the flow-based warnings (-Wmaybe-uninitialized & co).
    obj = tmp_path / "out.o"
    proc = subprocess.run([gcc, *flags, "-O2", "-fPIC", "-c", source, "-o", str(obj)],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


@pytest.mark.skipif(os.environ.get("SHARDFORMER_VALGRIND") != "1",
                    reason="slow; set SHARDFORMER_VALGRIND=1 to run the driver under valgrind")
def test_valgrind_driver(tmp_path):
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        pytest.skip("valgrind is not installed")
    log = tmp_path / "valgrind.log"
    proc = _run_driver(
        tmp_path, "asan", "-", 2, {"PYTHONMALLOC": "malloc"},
        prefix=[valgrind, "--tool=memcheck", "--error-limit=no", "--num-callers=30",
                f"--log-file={log}"],
        timeout=1800)
    text = log.read_text()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "DRIVER OK" in proc.stdout
    assert "ERROR SUMMARY" in text, text[-2000:]
    # The loader, Python and torch have valgrind noise of their own; only
    # errors whose stack passes through our module count.  Error reports are
    # separated by an empty "==PID== " line.
    blocks = re.split(r"(?m)^==\d+== ?$", text)
    kinds = ("Invalid read", "Invalid write", "Invalid free", "uninitialised",
             "Conditional jump", "overlap", "Mismatched free")
    ours = [b for b in blocks if "_C.cpython" in b and any(k in b for k in kinds)]
    assert not ours, "\n\n".join(ours[:5])
