"""The skinny-linear kernel (shardformer.ops.skinny_linear, csrc/kernels/linear.c)
and ShardConfig.enable_skinny_linear: y = x W^T + b on few rows, against
torch's F.linear in every dtype and at ragged sizes (rows of W not a multiple
of the kernel's block of 4, in_features not a multiple of 8 or 16), its
argument checks, and sharded decoding through it at TP=2 and 4 with the
kernel's calls counted."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from checks import skinny
from shardformer import ShardConfig, ops

# The compat run (scripts/test_compat.sh) leaves out the kernel against torch's linear; the
# tests marked transformers_independent(False) run HF models' generate and stay.
pytestmark = pytest.mark.transformers_independent


def _ref(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("n,k", [(1, 1), (5, 16), (7, 33), (37, 45), (64, 128), (130, 200)])
def test_matches_linear(dtype, tol, m, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g)
    for bias in (None, b):
        with torch.no_grad():
            got = ops.skinny_linear(x, w, bias)
        assert got.dtype == dtype and got.shape == (m, n)
        exp = _ref(x, w, bias)
        # the kernel sums in fp32 and rounds once to the dtype
        scale = (x.double().abs() @ w.double().abs().T).max().item() + 1.0
        err = (got.double() - exp).abs().max().item()
        assert err <= tol * scale, (dtype, m, n, k, err, scale)


def test_leading_dims_and_empty():
    x = torch.randn(2, 1, 24)
    w = torch.randn(10, 24)
    with torch.no_grad():
        assert torch.allclose(ops.skinny_linear(x, w), F.linear(x, w), atol=1e-5)
        assert ops.skinny_linear(torch.randn(0, 24), w).shape == (0, 10)
        assert ops.skinny_linear(x, torch.randn(0, 24)).shape == (2, 1, 0)
        b = torch.randn(3)
        assert torch.equal(ops.skinny_linear(torch.randn(2, 0), torch.randn(3, 0), b), b.expand(2, 3))


def test_counts_calls():
    before = ops.CALLS["skinny_linear"]
    with torch.no_grad():
        ops.skinny_linear(torch.randn(1, 8), torch.randn(4, 8))
    assert ops.CALLS["skinny_linear"] == before + 1


def test_refusals():
    w = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="gradient is required"):
        ops.skinny_linear(torch.randn(1, 8), w)
    with torch.no_grad():
        with pytest.raises(TypeError, match="float32 / float16 / bfloat16"):
            ops.skinny_linear(torch.randn(1, 8), torch.randn(4, 8, dtype=torch.float64))
        with pytest.raises(TypeError):
            ops.skinny_linear(torch.randn(1, 8), torch.randn(4, 8).bfloat16())
        with pytest.raises(ValueError, match="takes 8"):
            ops.skinny_linear(torch.randn(1, 7), torch.randn(4, 8))
        with pytest.raises(ValueError, match="2-D"):
            ops.skinny_linear(torch.randn(1, 8), torch.randn(2, 4, 8))
        with pytest.raises(ValueError, match="bias"):
            ops.skinny_linear(torch.randn(1, 8), torch.randn(4, 8), torch.randn(5))
        with pytest.raises(ValueError, match="scalar"):
            ops.skinny_linear(torch.tensor(1.0), torch.randn(4, 1))


def test_layer_takes_only_measured_shapes():
    """The layers send the kernel float32 calls of 2 to 4 rows without
    gradients, and nothing else (shardformer.layer.linear.SKINNY_MIN_ROWS)."""
    from shardformer.layer.linear import _skinny_applies

    w = torch.randn(8, 16)
    with torch.no_grad():
        assert [_skinny_applies(torch.randn(m, 16), w, None, 4) for m in (1, 2, 3, 4, 5)] == \
            [False, True, True, True, False]
        assert _skinny_applies(torch.randn(2, 1, 16), w, None, 4)
        assert not _skinny_applies(torch.randn(2, 16).bfloat16(), w.bfloat16(), None, 4)
    assert not _skinny_applies(torch.randn(2, 16), w.requires_grad_(), None, 4)


@pytest.mark.transformers_independent(False)
def test_config_switch():
    assert ShardConfig().enable_skinny_linear is False
    assert ShardConfig(enable_all_optimization=True).enable_skinny_linear is True
    with pytest.raises(TypeError, match="enable_skinny_linear"):
        ShardConfig(enable_skinny_linear=1)


# ---- sharded decoding --------------------------------------------------------

GENERATE = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM",
            "BloomForCausalLM", "OPTForCausalLM", "Gemma2ForCausalLM"]


@pytest.mark.transformers_independent(False)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", GENERATE)
def test_generate_through_kernel(pool, name, tp):
    res = pool.run(skinny.generate_with_kernel, tp, name)
    assert all(r["tokens"] == res[0]["tokens"] for r in res)
    assert all(r["calls"] > 0 for r in res)


@pytest.mark.transformers_independent(False)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tp", [2, 4])
def test_decode_step_logits(pool, tp, dtype):
    """float32 decode steps of 2 sequences run the kernel; bfloat16 ones stay
    with torch (measured faster there), checked on logits."""
    res = pool.run(skinny.decode_logits_match, tp, "LlamaForCausalLM", dtype)
    assert all((r["calls"] > 0) == (dtype == "float32") for r in res)


@pytest.mark.transformers_independent(False)
def test_training_does_not_use_kernel(pool):
    res = pool.run(skinny.training_untouched, 2, "LlamaForCausalLM")
    assert all(r["calls"] == 0 for r in res)
