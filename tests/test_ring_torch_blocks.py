"""Ring attention's torch-ops blocks (shardformer.layer.ring_blocks, the path
of tensors on CUDA), tested on CPU with ring_attention.BLOCKS = "torch":
one block equals the C kernel's block (output, log-sum-exp and the final-lse
backward's dq, dk, dv, dbias) under causal masking, key padding, an odd
length with Sq != Sk, GQA, windows, soft-capping, bias and dropout; the ring
at 2 and 4 ranks equals full attention and the sequence-parallel (ring_attn)
Llama, windowed Mistral and ALiBi BLOOM equal the unsharded HF models."""
import pytest
import torch

from checks import ring_torch_blocks as checks
from shardformer import _C
from shardformer.layer import ring_attention as ra
from shardformer.layer import ring_blocks

CASES = [  # causal, window, key padding, softcap, bias, dropout
    dict(causal=True),
    dict(causal=True, padding=True),
    dict(causal=False, padding=True, bias=True),
    dict(causal=True, window=3, softcap=5.0),
    dict(causal=False, window=2, padding=True),
    dict(causal=True, padding=True, dropout=0.3, bias=True, softcap=4.0),
]


def _c_block(q, k, v, scale, causal, window, bias, mask, drop, softcap, pos):
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32)
    _C.attention_forward(q, k, v, o, lse, scale, causal, window, None, bias, mask, *(drop or (0.0, 0)),
                         softcap, *pos)
    return o, lse


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_torch_block_equals_c_block(case):
    gen = torch.Generator().manual_seed(3)
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 7, 9, 8          # odd lengths, Sq != Sk (off = 2), GQA
    q, k, v = (torch.randn(B, h, s, D, generator=gen) for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
    mask = None
    if case.get("padding"):
        kp = torch.ones(B, Sk, dtype=torch.uint8)
        kp[1, :4] = 0
        mask = kp.view(B, 1, 1, Sk)
    bias = torch.randn(1, Hq, Sq, Sk, generator=gen) if case.get("bias") else None
    drop = (case["dropout"], 11) if case.get("dropout") else None
    pos = (torch.arange(3, 3 + Sq), torch.arange(1, 1 + Sk), 12) if drop else (None, None, 0)
    args = (0.37, case["causal"], case.get("window", 0), bias, mask, drop, case.get("softcap", 0.0), pos)
    o_c, lse_c = _c_block(q, k, v, *args)
    o_t, lse_t = ring_blocks.block_forward(q, k, v, *args)
    assert torch.isinf(lse_c).sum() == torch.isinf(lse_t).sum()
    torch.testing.assert_close(o_t, o_c, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_t, lse_c, rtol=1e-5, atol=1e-5)
    dout = torch.randn(o_c.shape, generator=gen)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ds = torch.empty(B, Hq, Sq, Sk) if bias is not None else None
    _C.attention_backward(q, k, v, o_c, dout, lse_c, dq, dk, dv, ds, args[0], args[1], args[2], None, bias, mask,
                          *(drop or (0.0, 0)), args[6], *pos)
    got = ring_blocks.block_backward(q, k, v, o_c, dout, lse_c, *args, want_ds=bias is not None)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, (dq, dk, dv, ds)):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_blocks_switch_refuses_unknown_values():
    old = ra.BLOCKS
    ra.BLOCKS = "cuda"
    try:
        with pytest.raises(ValueError, match="BLOCKS must be 'auto' or 'torch', got 'cuda'"):
            ra.ring_attention(*(torch.zeros(1, 1, 2, 4) for _ in range(3)))
    finally:
        ra.BLOCKS = old


@pytest.mark.parametrize("tp", [2, 4])
def test_ring_torch_blocks_equal_full(pool, tp):
    cases = [((16 * tp - 3, True), dict(left_pad=3)),                    # uneven length, padded row
             ((16 * tp, False), dict(window=5, softcap=20.0, bias_batch=1)),
             ((8 * tp, True), dict(dropout=0.2, dtype="bfloat16"))]
    pool.run(checks.ring_equals_full, tp, cases)


@pytest.mark.parametrize("sp", [2, 4])
def test_ring_attn_torch_blocks_equal_unsharded(pool, sp):
    cases = [("equals_unsharded", ("LlamaForCausalLM", "ring_attn", 7)),
             ("sliding_window_equals_unsharded", ("MistralForCausalLM", "ring_attn", 3, 7, True)),
             ("equals_unsharded", ("BloomForCausalLM", "ring_attn", 7))]
    pool.run(checks.models_equal_unsharded, sp, cases)


def test_ring_attn_torch_blocks_default_group(pool):
    """The plain ShardConfig() (default group = the 4-rank world)."""
    pool.run(checks.llama_default_group, 4)
