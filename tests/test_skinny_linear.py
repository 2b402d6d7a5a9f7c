"""The skinny-linear kernel (shardformer.ops.skinny_linear, csrc/kernels/linear.c)
and ShardConfig.enable_skinny_linear: y = x W^T + b on few rows, against
torch's F.linear in every dtype and at ragged sizes (rows of W not a multiple
of the kernel's block of 4, in_features not a multiple of 8, 16 or 32), on
every path the kernel has (portable, AVX2, AVX512-BF16) forced in turn, with
contiguous and row-strided weights (a column slice read in place), its
argument checks, and sharded decoding through it at TP=2 and 4 with the
kernel's calls counted (bf16, and a memory-mapped checkpoint whose column
shards are strided views)."""
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


def _features() -> dict:
    from shardformer import _C

    return _C.cpu_features()


def _path_missing(path: str) -> str | None:
    """Why `path` cannot run here (None: it can)."""
    f = _features()
    if path == "avx2" and not f["simd"]:
        return "this CPU (or SHARDFORMER_SIMD) has no AVX2+FMA+F16C: the portable path is the only one"
    if path == "avx512_bf16" and not f["avx512_bf16"]:
        return "this CPU (or SHARDFORMER_SIMD) has no AVX-512F/BW + AVX512-BF16 (vdpbf16ps)"
    return None


# (m, n, k): n not a multiple of 4, k below / at / past 32 with tails of every kind
PATH_SIZES = [(1, 7, 33), (2, 5, 31), (3, 37, 45), (4, 130, 200), (5, 9, 32), (9, 6, 1000)]


@pytest.mark.parametrize("path", ["portable", "avx2", "avx512_bf16"])
def test_every_path_matches_linear(path):
    """Each path, forced, against float64 at odd sizes in every dtype it
    takes, with the weight contiguous and as a strided column slice of a
    wider tensor (read in place: counted, never copied); avx512_bf16 takes
    bfloat16 only and refuses the others by name."""
    why = _path_missing(path)
    if why:
        pytest.skip(why)
    tols = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
    for dtype, tol in tols.items():
        if path == "avx512_bf16" and dtype != torch.bfloat16:
            with torch.no_grad(), pytest.raises(ValueError, match="avx512_bf16 takes bfloat16 only"):
                ops.skinny_linear(torch.randn(1, 8).to(dtype), torch.randn(4, 8).to(dtype), path=path)
            continue
        for m, n, k in PATH_SIZES:
            g = torch.Generator().manual_seed(m * 7 + n * 1000 + k)
            x = torch.randn(m, k, generator=g).to(dtype)
            wide = torch.randn(n, k + 11, generator=g).to(dtype)
            b = torch.randn(n, generator=g)
            scale = (x.double().abs() @ wide[:, 3:3 + k].double().abs().T).max().item() + 1.0
            for w in (wide[:, 3:3 + k].contiguous(), wide[:, 3:3 + k]):
                strided_before = ops.CALLS["skinny_linear_strided"]
                with torch.no_grad():
                    got = ops.skinny_linear(x, w, b, path=path)
                assert ops.CALLS["skinny_linear_strided"] - strided_before == (not w.is_contiguous())
                err = (got.double() - _ref(x, w, b)).abs().max().item()
                assert got.dtype == dtype and err <= tol * scale, (path, dtype, m, n, k, w.stride(), err, scale)


def test_paths_chosen_by_probe():
    """The default path per dtype follows the CPU probe: bfloat16 runs
    vdpbf16ps where the CPU has AVX512-BF16; a path the CPU lacks or an
    unknown one is refused before anything runs."""
    f = _features()
    wide = "avx2" if f["simd"] else "portable"
    assert ops.skinny_linear_path(torch.float32) == ops.skinny_linear_path(torch.float16) == wide
    assert ops.skinny_linear_path(torch.bfloat16) == ("avx512_bf16" if f["avx512_bf16"] else wide)
    with torch.no_grad():
        with pytest.raises(ValueError, match="path='sse'"):
            ops.skinny_linear(torch.randn(1, 8), torch.randn(4, 8), path="sse")
        if not f["avx512_bf16"]:
            with pytest.raises(ValueError, match="avx512_bf16 is not available"):
                ops.skinny_linear(torch.randn(1, 8).bfloat16(), torch.randn(4, 8).bfloat16(), path="avx512_bf16")


def test_strided_weight_layouts():
    """The C entry point reads a weight whose rows are strided (unit stride
    within a row) in place and refuses the layouts it cannot read, naming
    the strides; ops.skinny_linear copies those (transposed, overlapping
    rows) and computes them right."""
    from shardformer import _C

    wide = torch.randn(6, 40)
    x = torch.randn(2, 16)
    with torch.no_grad():
        y = torch.empty(2, 6)
        _C.skinny_linear(x, wide[:, 5:21], None, y)
        assert torch.allclose(y, F.linear(x, wide[:, 5:21]), atol=1e-5)
        for bad in (wide[:, :32:2], torch.randn(16, 6).T, wide.flatten().as_strided((6, 16), (8, 1))):
            with pytest.raises(ValueError, match=r"strides \(\d+, \d+\).*unit stride at least 16"):
                _C.skinny_linear(x, bad, None, torch.empty(2, 6))
            assert torch.allclose(ops.skinny_linear(x, bad), F.linear(x, bad.contiguous()), atol=1e-5)
        # one row or one column: no stride to read
        assert torch.allclose(ops.skinny_linear(x, wide[:1, 5:21]), F.linear(x, wide[:1, 5:21]), atol=1e-5)
        assert torch.allclose(ops.skinny_linear(x[:, :1], wide[:, 7:8]), F.linear(x[:, :1], wide[:, 7:8]), atol=1e-5)


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
        # a column slice (strided rows) is read in place; a transposed weight is not
        assert _skinny_applies(torch.randn(2, 16), torch.randn(8, 40)[:, 3:19], None, 4)
        assert not _skinny_applies(torch.randn(2, 16), torch.randn(16, 8).T, None, 4)
        # bfloat16 from one row where its path is AVX512-BF16, else never; float16 never
        bf16 = [_skinny_applies(torch.randn(m, 16).bfloat16(), w.bfloat16(), None, 4) for m in (1, 2, 4, 5)]
        assert bf16 == ([True, True, True, False] if _features()["avx512_bf16"] else [False] * 4)
        assert not any(_skinny_applies(torch.randn(m, 16).half(), w.half(), None, 4) for m in (1, 2, 4))
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
    """float32 decode steps of 2 sequences run the kernel, bfloat16 ones too
    where its path is AVX512-BF16 (else they stay with torch, measured faster
    there), checked on logits."""
    res = pool.run(skinny.decode_logits_match, tp, "LlamaForCausalLM", dtype)
    assert all((r["calls"] > 0) == (dtype == "float32" or _features()["avx512_bf16"]) for r in res)


@pytest.mark.transformers_independent(False)
@pytest.mark.parametrize("default_group", [True, False])
def test_bf16_batch1_decode_tp2(world_pool, pool, default_group):
    """TP=2 greedy decoding of one sequence in bfloat16 through the kernel's
    AVX512-BF16 path equals the unsharded model (plain ShardConfig() on a
    2-rank world, and an explicit group of the 4-rank pool)."""
    ranks = world_pool(2) if default_group else pool
    res = ranks.run(skinny.bf16_batch1_decode, 2, "LlamaForCausalLM", default_group)
    assert all(r["tokens"] == res[0]["tokens"] for r in res)


@pytest.mark.transformers_independent(False)
def test_mapped_strided_shards_through_kernel(pool2, tmp_path):
    """from_pretrained(mmap=True) keeps row-parallel weights as strided views
    of the mapped checkpoint; decoding reads them in place through the kernel."""
    res = pool2.run(skinny.mapped_column_shards_decode, 2, str(tmp_path / "ckpt"))
    assert all(r["strided"] > 0 for r in res), res


@pytest.mark.transformers_independent(False)
def test_training_does_not_use_kernel(pool):
    res = pool.run(skinny.training_untouched, 2, "LlamaForCausalLM")
    assert all(r["calls"] == 0 for r in res)
