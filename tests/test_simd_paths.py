"""The kernels' narrower SIMD paths, on a CPU that has wider ones.

The kernels pick AVX-512, AVX2+FMA+F16C or portable C at run time
(csrc/cpu_features.c), so the machine running the suite exercises only its
widest path.  SHARDFORMER_SIMD caps the choice ("avx512": no AVX512-BF16;
"avx2": no AVX-512; "none": the portable C); here the single-process kernel tests run again in a
subprocess under each cap: the same accuracy bounds against torch and float64
hold on every path."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL_TESTS = [
    "test_kernels.py::test_gelu_erf_accuracy", "test_kernels.py::test_bias_gelu", "test_kernels.py::test_gelu_extremes",
    "test_kernels.py::test_layer_norm", "test_kernels.py::test_rms_norm", "test_kernels.py::test_swiglu",
    "test_kernels.py::test_bias_dropout_add_no_dropout", "test_kernels.py::test_cross_entropy_tp1",
    "test_kernels.py::test_threads_match_single_thread", "test_kernels.py::test_empty_inputs",
    "test_skinny_linear.py::test_matches_linear", "test_skinny_linear.py::test_leading_dims_and_empty",
]


@pytest.fixture(scope="module")
def features() -> dict:
    """{cap: _C.cpu_features() under SHARDFORMER_SIMD=cap} for "" (no cap), "avx512", "avx2" and "none".
    A capped answer comes from a fresh process (the cap is read when the library loads) that loads
    the extension module alone; they run at once, and the uncapped one is this process's own where
    nothing caps it here.  (CI time: four processes one after another before, then each importing
    torch.)"""
    # the extension alone, without importing shardformer (and torch): a fraction of a second each
    code = ("import glob, importlib.machinery, importlib.util, os; "
            "d = importlib.util.find_spec('shardformer').submodule_search_locations[0]; "
            "so = glob.glob(os.path.join(d, '_C.*.so'))[0]; "
            "loader = importlib.machinery.ExtensionFileLoader('shardformer._C', so); "
            "m = loader.create_module(importlib.util.spec_from_loader('shardformer._C', loader)); "
            "loader.exec_module(m); print(m.cpu_features())")
    procs = {cap: subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, SHARDFORMER_SIMD=cap),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cap in ("avx512", "avx2", "none") + (("",) if os.environ.get("SHARDFORMER_SIMD") else ())}
    out = {}
    if not os.environ.get("SHARDFORMER_SIMD"):
        from shardformer import _C

        out[""] = _C.cpu_features()
    for cap, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-4000:]
        out[cap] = eval(stdout.strip())
    return out


def test_cap_is_applied(features):
    assert features["none"]["simd"] is False
    avx2 = features["avx2"]
    assert avx2["avx512"] is False and avx2["avx512f"] is False and avx2["avx512_bf16"] is False
    # "avx512": AVX-512 kept, AVX512-BF16 left out (the skinny kernel's bf16 falls back to AVX2)
    avx512 = features["avx512"]
    assert avx512["avx512_bf16"] is False and avx512["avx512bf16"] is False
    assert avx512["avx512"] == features[""]["avx512"]


@pytest.mark.parametrize("cap", ["avx2", "none"])
def test_kernels_on_narrower_path(cap, features):
    full = features[""]
    if cap == "avx2" and not full["avx512"]:
        pytest.skip("this CPU has no AVX-512: the AVX2 path is the one the rest of the suite runs")
    if cap == "none" and not full["simd"]:
        pytest.skip("this CPU has no AVX2: the portable path is the one the rest of the suite runs")
    env = dict(os.environ, SHARDFORMER_SIMD=cap)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
