"""The CUDA extension on a machine without a GPU (CI): it is built whenever
nvcc is (setup.py compiles csrc/cuda/*.cu with --Werror all-warnings and
-Werror, so a build that exists compiled warning-free), its glue refuses
what it cannot take with an exception and never crashes, and
shardformer.ops sends a CUDA tensor to it, or refuses it with the "built
without CUDA" message when it is missing.  The kernels themselves run in
tests/test_cuda_kernels.py (marked gpu).  See docs/cuda.md.
"""
import os
import re
import shutil
import sys

import pytest
import torch

from shardformer import ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_FUNCTIONS = ["norm_forward", "norm_backward", "xent_forward", "xent_backward", "embedding_forward",
                  "embedding_backward", "bias_gelu_forward", "bias_gelu_backward", "swiglu_forward",
                  "swiglu_backward", "bias_dropout_add_forward", "bias_dropout_add_backward"]


def _nvcc():
    return shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)


def test_cuda_extension_built_warning_free_where_nvcc_is():
    if os.environ.get("SHARDFORMER_CUDA") == "0":
        pytest.skip("SHARDFORMER_CUDA=0: the CUDA extension was switched off for this build")
    if _nvcc() is None:
        pytest.skip("nvcc not found: the CUDA extension is not built on this machine")
    with open(os.path.join(ROOT, "setup.py")) as f:
        setup_py = f.read()
    # the flags every .cu file is compiled with: warnings are errors on both sides
    for flag in ('"--Werror", "all-warnings"', '"-Wall,-Wextra,-Werror"', '"arch=compute_90,code=sm_90"',
                 '"arch=compute_90,code=compute_90"', '"cudart_static"'):
        assert flag in setup_py, flag
    assert ops.cuda_built(), "nvcc is here but shardformer._cuda was not built (see setup.py)"
    from shardformer import _cuda

    assert set(CUDA_FUNCTIONS) <= set(dir(_cuda))
    assert _cuda.device_count() == torch.cuda.device_count()


def test_cuda_glue_refuses_cpu_tensors_and_bad_arguments():
    if not ops.cuda_built():
        pytest.skip("shardformer._cuda is not built here (no nvcc at build time)")
    from shardformer import _cuda

    x, y, r = torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match=r"norm_forward \(CUDA\): x: expected a CUDA tensor, got a CPU tensor"):
        _cuda.norm_forward(False, x, None, None, 1e-5, y, None, r, 0)
    with pytest.raises(ValueError, match=r"swiglu_forward \(CUDA\): gate: expected a CUDA tensor"):
        _cuda.swiglu_forward(x, x, y, 0)
    with pytest.raises(TypeError):
        _cuda.norm_forward(False, x)                           # too few arguments
    with pytest.raises(TypeError, match="__dlpack__"):
        _cuda.bias_gelu_forward([1.0, 2.0], None, False, y, 0)


def test_cuda_tensor_refused_when_built_without_cuda(monkeypatch):
    import shardformer

    # the state of a build without the extension: nothing loaded, the import fails
    monkeypatch.setattr(ops, "_cuda_ext", None)
    monkeypatch.setattr(ops, "_cuda_import_error", None)
    monkeypatch.delattr(shardformer, "_cuda", raising=False)
    monkeypatch.setitem(sys.modules, "shardformer._cuda", None)
    with pytest.raises(RuntimeError, match=re.escape(
            "shardformer was built without CUDA (nvcc not found at build time); rebuild with SHARDFORMER_CUDA=1")):
        ops.kernels_for(torch.device("cuda"))      # every op with a CUDA kernel goes through here
    assert not ops.cuda_built()
    assert ops.kernels_for(torch.device("cpu")) is ops._C
    with pytest.raises(ValueError, match="the kernels run on CPU or CUDA tensors, got device meta"):
        ops.kernels_for(torch.device("meta"))


def test_other_devices_refused_before_any_work():
    m = torch.empty(4, 8, device="meta")
    assert not ops.fused_input(m) and not ops.kernel_input(m)
    with pytest.raises(ValueError, match="layer_norm input: the kernels run on CPU or CUDA tensors, got device meta"):
        ops.layer_norm(m, (8,))
    with pytest.raises(ValueError, match="swiglu gate: the kernels run on CPU or CUDA tensors, got device meta"):
        ops.swiglu(m, m)
    with pytest.raises(ValueError, match=r"attention q: the kernels run on CPU tensors \(this op has no CUDA kernel\)"):
        ops.attention(m[None, None], m[None, None], m[None, None])
