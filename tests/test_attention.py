"""The C attention kernel (ops.attention, csrc/kernels/attention.c) against an
eager float64 softmax attention, forward and backward through autograd, for
fp32 / bf16 / fp16 with odd sizes, causal (Sq != Sk aligned bottom-right),
padding and 4-D masks, sliding window, ALiBi, additive bias, GQA, scale,
logit soft-capping and dropout; bad input; and ShardConfig(enable_flash_attention=True) on HF models
at TP=2 and 4 against the unsharded eager model."""
import contextlib
import math
import warnings

import pytest
import torch

import zoo
from checks import parity
from shardformer import ops
from shardformer import attention as sf_attention

# The compat run (scripts/test_compat.sh) leaves out the kernel against the eager reference; the
# tests marked transformers_independent(False) go through HF's attention interface and stay.
pytestmark = pytest.mark.transformers_independent

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# max|ours - ref| <= rtol * max|ref| + atol (ref in float64 on the same rounded inputs)
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 1e-3), torch.float16: (4e-3, 1e-4)}


def reference(q, k, v, causal=False, scale=None, mask=None, bias=None, window=0, alibi=None, keep=None, p=0.0,
              softcap=None):
    """Eager attention with every option spelled out (float64 in, float64 out);
    softcap: the scaled logits x become softcap * tanh(x / softcap) before the
    bias and the masks."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    scale = 1 / math.sqrt(D) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Sq)[:, None] + Sk - Sq
    j = torch.arange(Sk)[None]
    if bias is not None:
        s = s + bias
    if alibi is not None:
        s = s - alibi.double().view(1, H, 1, 1) * (i - j).abs()
    vis = torch.ones(Sq, Sk, dtype=torch.bool)
    if causal:
        vis &= j <= i
    if window:
        vis &= (i - j) < window
        if not causal:
            vis &= (j - i) < window
    vis = vis.expand(B, H, Sq, Sk)
    if mask is not None:
        vis = vis & (mask if mask.dim() == 4 else mask[:, None, None, :])
    s = s.masked_fill(~vis, float("-inf"))
    prob = torch.softmax(s, -1).nan_to_num(0.0)
    if keep is not None:
        prob = prob * keep / (1 - p)
    return prob @ v


def close(what, a, b, dtype):
    rtol, atol = TOL[dtype]
    diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    assert diff <= rtol * scale + atol, f"{what} ({dtype}): max error {diff:.3g} vs max|ref| {scale:.3g}"


def run_case(dtype, B, Hq, Hkv, Sq, Sk, D, seed=0, bias_shape=None, **opts):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=g).to(dtype) for s in ((B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D)))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    bias = bref = None
    if bias_shape is not None:
        b0 = torch.randn(*bias_shape, generator=g)
        bias, bref = b0.clone().requires_grad_(), b0.double().requires_grad_()
    out = ops.attention(*leaves, bias=bias, **opts)
    ref_opts = dict(opts)
    ref_opts["window"] = ref_opts.get("window") or 0
    ref_opts["alibi"] = ref_opts.pop("alibi_slopes", None)
    exp = reference(*refs, bias=bref, **ref_opts)
    assert out.dtype == dtype and out.shape == (B, Hq, Sq, D)
    close("output", out, exp, dtype)
    grad = torch.randn(exp.shape, generator=g).to(dtype)
    out.backward(grad)
    exp.backward(grad.double())
    for name, a, b in zip("qkv", leaves, refs):
        close(f"d{name}", a.grad, b.grad, dtype)
    if bias is not None:
        close("dbias", bias.grad, bref.grad, dtype)
    return out


# (B, Hq, Hkv, Sq, Sk, D), options
CASES = {
    "causal_gqa_odd": ((2, 4, 2, 37, 53, 13), dict(causal=True)),
    "causal_square_d64": ((1, 2, 1, 70, 70, 64), dict(causal=True)),
    "window_bidirectional": ((2, 2, 2, 5, 130, 8), dict(window=7)),
    "causal_window_mqa": ((1, 3, 1, 100, 100, 16), dict(causal=True, window=20)),
    "decode_one_query": ((1, 1, 1, 1, 9, 3), dict(causal=True)),
    "length_one": ((2, 2, 1, 1, 1, 5), dict(causal=True)),
    "more_queries_than_keys": ((1, 2, 2, 65, 33, 24), dict(causal=True)),
    "scale_no_mask": ((2, 2, 2, 19, 23, 7), dict(scale=0.3)),
    "alibi_causal": ((2, 4, 4, 41, 41, 9), dict(causal=True, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]))),
    "bias_per_head": ((2, 3, 3, 17, 29, 11), dict(bias_shape=(3, 17, 29))),
    "bias_full_causal": ((2, 2, 1, 33, 40, 6), dict(causal=True, bias_shape=(2, 2, 33, 40))),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_reference(case, dtype):
    dims, opts = CASES[case]
    run_case(dtype, *dims, **opts)


@contextlib.contextmanager
def counting_c_attention(monkeypatch):
    """Count the C entry points attention_forward / _backward, and the softcap each got."""
    from shardformer import _C

    calls = {"forward": 0, "backward": 0, "softcaps": []}
    for name, key, nargs in (("attention_forward", "forward", 13), ("attention_backward", "backward", 18)):
        real = getattr(_C, name)

        def counted(*args, _real=real, _key=key, _n=nargs):
            calls[_key] += 1
            calls["softcaps"].append(args[_n] if len(args) > _n else None)
            return _real(*args)
        monkeypatch.setattr(_C, name, counted)
    yield calls


# (B, Hq, Hkv, Sq, Sk, D): several tiles (Sk > 128 keys, Sq > 64 queries), GQA, Sq != Sk, one query
SOFTCAP_SHAPES = [(2, 4, 2, 37, 53, 13), (1, 2, 1, 70, 150, 32), (1, 3, 3, 130, 130, 8), (2, 2, 1, 1, 9, 5)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("softcap", [None, 0.5, 2.0, 30.0])
def test_softcap_matches_reference(softcap, causal, dtype, monkeypatch):
    """Forward and the q, k, v gradients against the float64 reference, with
    and without soft-capping (0.5: most logits deep in tanh's saturation,
    30: Gemma 2's cap, nearly linear); the C kernel ran once each way per
    shape, with the cap."""
    with counting_c_attention(monkeypatch) as calls:
        for n, dims in enumerate(SOFTCAP_SHAPES):
            run_case(dtype, *dims, seed=n, causal=causal, softcap=softcap, scale=1.3)
    assert calls["forward"] == calls["backward"] == len(SOFTCAP_SHAPES)
    assert set(calls["softcaps"]) == {float(softcap or 0.0)}


def test_softcap_changes_the_result_and_composes():
    """A cap below the logits' range changes the output (the cap is in force);
    with a bias, a window, ALiBi, a padding mask and dropout it still equals
    the reference (dbias included: the bias is added after the cap)."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g) * 3 for _ in range(3))
    assert not torch.allclose(ops.attention(q, k, v, causal=True, softcap=1.0), ops.attention(q, k, v, causal=True))
    pad = torch.ones(2, 45, dtype=torch.bool)
    pad[0, :6] = False
    run_case(torch.float32, 2, 4, 2, 45, 45, 12, causal=True, softcap=1.5, mask=pad, window=11,
             bias_shape=(2, 4, 45, 45), alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]))
    B, H, S, D, p = 2, 3, 50, 8, 0.3
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    keep = ops.attention_dropout_mask((B, H, S, S), p, 4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    out = ops.attention(*leaves, causal=True, dropout_p=p, seed=4, softcap=0.8)
    exp = reference(*refs, causal=True, keep=keep.double(), p=p, softcap=0.8)
    close("softcap + dropout output", out, exp, torch.float32)
    grad = torch.randn(exp.shape, generator=g)
    out.backward(grad)
    exp.backward(grad.double())
    for name, x, r in zip("qkv", leaves, refs):
        close(f"softcap + dropout d{name}", x.grad, r.grad, torch.float32)


def test_softcap_split_backward_threads():
    """Two threads split one pair's key tiles in backward: the same as one thread, bit for bit."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=g).requires_grad_() for _ in range(3))
    results = []
    try:
        for n in (1, 2):
            ops.set_num_threads(n)
            for t in (q, k, v):
                t.grad = None
            out = ops.attention(q, k, v, causal=True, softcap=2.5)
            out.sum().backward()
            results.append([out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()])
    finally:
        ops.set_num_threads(1)
    for a, b in zip(*results):
        assert torch.equal(a, b)
    run_case(torch.float32, 1, 2, 1, 300, 333, 16, causal=True, softcap=2.5)


def test_softcap_refused():
    from shardformer import _C

    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 6, 8)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap"):
            ops.attention(q, k, k, softcap=bad)
    with pytest.raises(TypeError, match="softcap"):
        ops.attention(q, k, k, softcap="30")
    out, lse = torch.empty_like(q), torch.empty(1, 2, 5)
    # the C entry point checks on its own, as a float32 (1e300 and 1e-300 round to inf and 0)
    for bad in (-2.0, float("inf"), float("nan"), 1e300, 1e-300):
        with pytest.raises(ValueError, match="softcap"):
            _C.attention_forward(q, k, k, out, lse, 1.0, False, 0, None, None, None, 0.0, 0, bad)
        with pytest.raises(ValueError, match="softcap"):
            _C.attention_backward(q, k, k, out, q, lse, torch.empty_like(q), torch.empty_like(k),
                                  torch.empty_like(k), None, 1.0, False, 0, None, None, None, 0.0, 0, bad)
    with pytest.raises(TypeError, match="softcap"):
        _C.attention_forward(q, k, k, out, lse, 1.0, False, 0, None, None, None, 0.0, 0, "x")
    # None and 0 are no cap: the same as without the argument
    _C.attention_forward(q, k, k, out, lse, 1.0, False, 0, None, None, None, 0.0, 0, None)
    ref = out.clone()
    _C.attention_forward(q, k, k, out, lse, 1.0, False, 0, None, None, None, 0.0, 0, 0.0)
    assert torch.equal(out, ref)
    _C.attention_forward(q, k, k, out, lse, 1.0, False, 0, None, None, None, 0.0, 0)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padding_and_4d_masks(dtype):
    g = torch.Generator().manual_seed(3)
    pad = torch.ones(3, 45, dtype=torch.bool)
    pad[0, :10] = False                      # left padding
    pad[1, 30:] = False                      # right padding
    pad[2, :] = False                        # every key masked: output 0, gradients 0
    out = run_case(dtype, 3, 2, 1, 45, 45, 12, causal=True, mask=pad)
    assert torch.all(out[2] == 0)
    m4 = torch.rand(3, 1, 20, 45, generator=g) > 0.3
    run_case(dtype, 3, 4, 2, 20, 45, 12, mask=m4)
    run_case(dtype, 3, 4, 2, 20, 45, 12, causal=True, window=9, mask=m4[:, :, :1])   # [B, 1, 1, Sk]


def test_additive_float_mask_is_a_bias():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 9, 5, generator=g) for _ in range(3))
    m = torch.zeros(2, 1, 9, 9).masked_fill(torch.rand(2, 1, 9, 9, generator=g) > 0.7, -1e9)
    torch.testing.assert_close(ops.attention(q, k, v, mask=m), ops.attention(q, k, v, bias=m))
    exp = reference(q.double(), k.double(), v.double(), bias=m.double())
    close("additive mask", ops.attention(q, k, v, mask=m), exp, torch.float32)


def test_dropout():
    g = torch.Generator().manual_seed(5)
    B, H, S, D, p = 2, 3, 50, 8, 0.3
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    a = ops.attention(q, k, v, causal=True, dropout_p=p, seed=11)
    assert torch.equal(a, ops.attention(q, k, v, causal=True, dropout_p=p, seed=11))
    assert not torch.equal(a, ops.attention(q, k, v, causal=True, dropout_p=p, seed=12))
    assert torch.equal(ops.attention(q, k, v, causal=True, dropout_p=p, seed=11, training=False),
                       ops.attention(q, k, v, causal=True))
    assert torch.equal(ops.attention(q, k, v, dropout_p=0.0, seed=11), ops.attention(q, k, v))
    keep = ops.attention_dropout_mask((B, H, S, S), p, 11)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.01
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0], keep[1])
    # forward and gradients equal the eager reference under the same draws
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    out = ops.attention(*leaves, causal=True, dropout_p=p, seed=11)
    exp = reference(*refs, causal=True, keep=keep.double(), p=p)
    close("dropout output", out, exp, torch.float32)
    grad = torch.randn(exp.shape, generator=g)
    out.backward(grad)
    exp.backward(grad.double())
    for name, x, r in zip("qkv", leaves, refs):
        close(f"dropout d{name}", x.grad, r.grad, torch.float32)
    assert torch.all(ops.attention(q, k, v, dropout_p=1.0, seed=3) == 0)


def test_threads_match_single_thread():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 4, 150, 32, generator=g).requires_grad_() for _ in range(3))
    results = []
    try:
        for n in (1, 2):
            ops.set_num_threads(n)
            for t in (q, k, v):
                t.grad = None
            out = ops.attention(q, k, v, causal=True, dropout_p=0.1, seed=1)
            out.sum().backward()
            results.append([out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()])
    finally:
        ops.set_num_threads(1)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_split_over_key_tiles(dtype):
    """One (batch, key-value head) pair and two threads: the backward splits the
    pair's key tiles between the threads and sums their dq."""
    try:
        ops.set_num_threads(2)
        run_case(dtype, 1, 3, 1, 300, 333, 16, causal=True)
        run_case(dtype, 1, 2, 1, 200, 200, 8, window=50, bias_shape=(2, 200, 200))
    finally:
        ops.set_num_threads(1)


def test_non_contiguous_and_empty():
    g = torch.Generator().manual_seed(7)
    base = torch.randn(2, 11, 3, 6, generator=g)              # [B, S, H, D] as HF lays it out
    q = base.transpose(1, 2)
    assert not q.is_contiguous()
    torch.testing.assert_close(ops.attention(q, q, q, causal=True),
                               ops.attention(q.contiguous(), q.contiguous(), q.contiguous(), causal=True))
    k0 = torch.randn(2, 3, 0, 6, requires_grad=True)
    q0 = torch.randn(2, 3, 4, 6, requires_grad=True)
    out = ops.attention(q0, k0, k0)                             # no keys: every row masked
    assert torch.all(out == 0)
    out.sum().backward()
    assert torch.all(q0.grad == 0) and k0.grad.shape == k0.shape
    assert ops.attention(torch.randn(0, 2, 3, 4), torch.randn(0, 2, 5, 4), torch.randn(0, 2, 5, 4)).shape == (0, 2, 3, 4)


def test_bad_input():
    from shardformer import _C

    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 6, 8)
    with pytest.raises(TypeError, match="dtype"):
        ops.attention(q.long(), k, k)
    with pytest.raises(TypeError, match="dtypes differ"):
        ops.attention(q, k.half(), k)
    with pytest.raises(ValueError, match="device"):
        ops.attention(q.to("meta"), k, k)
    with pytest.raises(ValueError, match="4-D"):
        ops.attention(q[0], k, k)
    with pytest.raises(ValueError, match="multiple"):
        ops.attention(q, torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8))
    with pytest.raises(ValueError, match="head size"):
        ops.attention(q, torch.randn(1, 2, 6, 7), torch.randn(1, 2, 6, 7))
    with pytest.raises(ValueError, match="shapes differ"):
        ops.attention(q, k, torch.randn(1, 2, 7, 8))
    with pytest.raises(ValueError, match="broadcast"):
        ops.attention(q, k, k, mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="broadcast"):
        ops.attention(q, k, k, bias=torch.zeros(1, 3, 5, 6))
    with pytest.raises(TypeError, match="bool"):
        ops.attention(q, k, k, mask=torch.ones(1, 6, dtype=torch.int32))
    with pytest.raises(ValueError, match="alibi"):
        ops.attention(q, k, k, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="window"):
        ops.attention(q, k, k, window=-1)
    with pytest.raises(ValueError, match="dropout"):
        ops.attention(q, k, k, dropout_p=1.5)
    # the C entry point checks on its own: contiguity, dtypes, sizes
    out, lse = torch.empty_like(q), torch.empty(1, 4, 5)
    with pytest.raises(ValueError, match="contiguous"):
        _C.attention_forward(q.transpose(2, 3), k, k, out, lse, 1.0, False, 0, None, None, None, 0.0, 0)
    with pytest.raises(TypeError, match="float32"):
        _C.attention_forward(q, k, k, out, lse.double(), 1.0, False, 0, None, None, None, 0.0, 0)
    with pytest.raises(ValueError, match="lse"):
        _C.attention_forward(q, k, k, out, torch.empty(3), 1.0, False, 0, None, None, None, 0.0, 0)
    with pytest.raises(TypeError, match="mask"):
        _C.attention_forward(q, k, k, out, lse, 1.0, False, 0, None, None, torch.ones(1, 1, 1, 6), 0.0, 0)
    with pytest.raises(ValueError, match="multiple"):
        _C.attention_forward(q, torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8), out, lse, 1.0, False, 0,
                             None, None, None, 0.0, 0)


# ---- HuggingFace integration -----------------------------------------------

# Gemma 2's cap of 0.05 (the zoo's 50 never binds on a tiny model's logits): the kernel's soft-capping in force
OVERRIDES = {"MistralForCausalLM": {"sliding_window": 4}, "Gemma2ForCausalLM": {"attn_logit_softcapping": 0.05}}


def check_flash(ctx, name: str) -> dict:
    """check_sharded with enable_flash_attention on `name` (right-padded batch),
    plus how many attention calls the kernel served on this rank."""
    inputs = zoo.make_inputs(name)
    mask = torch.ones_like(inputs["input_ids"])
    mask[0, -3:] = 0
    inputs["attention_mask"] = mask
    before = sf_attention.CALLS["kernel"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = parity.check_sharded(ctx, lambda: zoo.build(name, torch.float32, **OVERRIDES.get(name, {})),
                                      inputs, name=name, config={"enable_flash_attention": True})
    report["kernel_calls"] = sf_attention.CALLS["kernel"] - before
    return report


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM", "MistralForCausalLM",
                                  "Phi3ForCausalLM", "T5ForConditionalGeneration", "Gemma2ForCausalLM",
                                  "BloomForCausalLM", "FalconForCausalLM", "GPTNeoForCausalLM", "GPTJForCausalLM"])
@pytest.mark.transformers_independent(False)
def test_flash_attention(pool, name, tp):
    """Mistral: sliding window 4 < the 8 tokens; Phi-3: its policy gives each
    layer a config copy of its own; T5: its relative position bias (sharded by
    head, learned) is the kernel's additive bias; Gemma 2: logit soft-capping
    (a cap of 0.05, which changes the logits) in the kernel.  BLOOM, Falcon,
    GPT-Neo, GPT-J: outside the registry, the kernel at the family's seam
    (BLOOM's ALiBi as the kernel's bias, GPT-Neo's local window)."""
    reports = pool.run(check_flash, tp, name)
    for r in reports:
        assert r["tp"] == tp
        if name.startswith("T5"):             # encoder 2 + decoder 2 self + 2 cross, twice
            assert r["kernel_calls"] == 12, r
        else:                                 # 2 layers x (the forward + the one after the step)
            assert r["kernel_calls"] == 4, r


@pytest.mark.transformers_independent(False)
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM"])
def test_flash_attention_routes_through_kernel(name, monkeypatch):
    from shardformer import ShardConfig, ShardFormer

    model = zoo.build(name, torch.float32)
    seen = []
    real = ops.attention
    monkeypatch.setattr(ops, "attention", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    sharded, _ = ShardFormer(shard_config=ShardConfig(enable_flash_attention=True)).optimize(model)
    assert sharded.config._attn_implementation == "shardformer"
    sharded(**zoo.make_inputs(name))
    assert len(seen) == 2                      # one per layer
    assert all(kw["causal"] == (name != "BertForMaskedLM") for kw in seen)


@pytest.mark.transformers_independent(False)
def test_gemma2_softcap_in_force():
    """The cap of OVERRIDES changes Gemma 2's logits (so test_flash_attention
    compares a soft-capped kernel), and the kernel got it on every call."""
    from shardformer import ShardConfig, ShardFormer

    name = "Gemma2ForCausalLM"
    ids = zoo.make_inputs(name)["input_ids"]
    with torch.no_grad():
        capped = zoo.build(name, torch.float32, **OVERRIDES[name]).eval()(input_ids=ids).logits
        plain = zoo.build(name, torch.float32, attn_logit_softcapping=None).eval()(input_ids=ids).logits
    assert not torch.allclose(capped, plain, rtol=1e-4, atol=1e-5)
    model = zoo.build(name, torch.float32, **OVERRIDES[name]).eval()
    sharded, _ = ShardFormer(shard_config=ShardConfig(enable_flash_attention=True)).optimize(model)
    seen = []
    real = ops.attention
    try:
        ops.attention = lambda *a, **kw: seen.append(kw.get("softcap")) or real(*a, **kw)
        with torch.no_grad():
            got = sharded(input_ids=ids).logits
    finally:
        ops.attention = real
    assert seen == [0.05] * model.config.num_hidden_layers
    close("Gemma 2 logits", got, capped, torch.float32)


@pytest.mark.transformers_independent(False)
def test_unservable_calls_keep_hf_attention():
    from shardformer import ShardConfig, ShardFormer

    name = "LlamaForCausalLM"
    model = zoo.build(name, torch.float32)
    ref = zoo.build(name, torch.float32)
    sharded, _ = ShardFormer(shard_config=ShardConfig(enable_flash_attention=True)).optimize(model)
    ids = zoo.make_inputs(name)["input_ids"]
    before = dict(sf_attention.CALLS)
    with pytest.warns(UserWarning, match="output_attentions"):
        out = sharded(input_ids=ids, output_attentions=True)
    assert sf_attention.CALLS["fallback"] - before["fallback"] == 2
    exp = ref(input_ids=ids, output_attentions=True)
    torch.testing.assert_close(out.logits, exp.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.attentions[0], exp.attentions[0], rtol=1e-5, atol=1e-6)


@pytest.mark.transformers_independent(False)
def test_mask_function():
    from transformers import masking_utils as mu

    sf_attention.register()
    pad = torch.tensor([[True] * 6, [False, False] + [True] * 4])
    # plain causal, no padding: nothing to build; padding: [B, Sk] only
    assert sf_attention.shardformer_mask(2, 6, 6, mask_function=mu.causal_mask_function) is None
    got = sf_attention.shardformer_mask(2, 6, 6, mask_function=mu.causal_mask_function, attention_mask=pad)
    assert got.shape == (2, 6) and torch.equal(got, pad)
    # sliding window: [B, Sk] tagged with the window
    got = sf_attention.shardformer_mask(2, 6, 6, mask_function=mu.sliding_window_causal_mask_function(3))
    assert got.shape == (2, 6) and got._shardformer_window == 3
    # anything else (here packed sequences, a static cache whose queries are not
    # the last keys, a sliding cache whose keys do not start at 0) is HF's
    # materialized mask
    packed = mu.and_masks(mu.causal_mask_function,
                          mu.packed_sequence_mask_function(torch.tensor([[0, 0, 0, 1, 1, 1]] * 2)))
    for q_len, kw in ((6, dict(mask_function=packed)),
                      (2, dict(mask_function=mu.causal_mask_function, q_offset=0, kv_offset=0)),
                      (1, dict(mask_function=mu.sliding_window_causal_mask_function(3), q_offset=7, kv_offset=2,
                               attention_mask=torch.ones(2, 8, dtype=torch.bool)))):
        got = sf_attention.shardformer_mask(2, q_len, 6, **kw)
        exp = mu.sdpa_mask(batch_size=2, q_length=q_len, kv_length=6, allow_is_causal_skip=False, **kw)
        assert got.dim() == 4 and torch.equal(got, exp)


@pytest.mark.transformers_independent(False)
@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "MistralForCausalLM"])
def test_generate_with_kv_cache_and_left_padding(name, cache):
    """Decoding (one query against the cache: bottom-right causal), a
    left-padded prompt, and a static cache (masks built ahead by generate(),
    then again by the model; a sliding cache's keys not starting at 0) give HF
    eager's tokens."""
    from shardformer import ShardConfig, ShardFormer

    model = zoo.build(name, torch.float32, **OVERRIDES.get(name, {})).eval()
    ref = zoo.build(name, torch.float32, **OVERRIDES.get(name, {})).eval()
    sharded, _ = ShardFormer(shard_config=ShardConfig(enable_flash_attention=True)).optimize(model)
    ids = zoo.make_inputs(name)["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    before = sf_attention.CALLS["kernel"]
    with torch.no_grad():
        kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation=cache)
        got = sharded.generate(input_ids=ids, **kw)
        exp = ref.generate(input_ids=ids, **kw)
    assert torch.equal(got, exp)
    assert sf_attention.CALLS["kernel"] - before == 2 * 6
