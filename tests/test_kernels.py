"""The C kernels (shardformer.ops, csrc/kernels/) against torch references:
forward and backward through autograd for fp32 / bf16 / fp16, odd and empty
sizes, non-contiguous inputs, bad input; vocabulary-parallel cross-entropy
at TP=2 and 4; the GPT-2 / Llama / BERT policies with the fused switches."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from checks import layers, parity
from shardformer import ops

# The compat run (scripts/test_compat.sh) leaves out the kernels against torch references; the
# tests marked transformers_independent(False) put the kernels into HF models and stay.
pytestmark = pytest.mark.transformers_independent

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rtol, atol) of a 16-bit result against the fp32 reference on the same
# (rounded) inputs: a few ulps of the output type.
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
SHAPES = [(3, 5, 67), (1, 1), (4, 8), (2, 17), (7, 1), (1, 300)]


def close(a, b, dtype, what=""):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def leaf(t, dtype):
    return t.to(dtype).requires_grad_()


def ref_leaf(t):
    """The reference runs in float64 on the same (rounded) values."""
    return t.detach().double().requires_grad_()


def run_both(fn, ref, inputs, dtype, seed=0):
    """fn on `inputs` (in dtype) vs ref on fp32 copies; outputs and input grads."""
    torch.manual_seed(seed)
    xs = [leaf(t, dtype) for t in inputs]
    rs = [ref_leaf(x) for x in xs]
    y, yr = fn(*xs), ref(*rs)
    close(y, yr, dtype, "forward")
    g = torch.randn(yr.shape).to(dtype)
    y.backward(g)
    yr.backward(g.double())
    for i, (x, r) in enumerate(zip(xs, rs)):
        close(x.grad, r.grad, dtype, f"grad of input {i}")


# ---- norms ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm(dtype, shape):
    n = shape[-1]
    torch.manual_seed(1)
    ins = [torch.randn(shape) * 3 + 1, torch.randn(n), torch.randn(n)]
    if n == 1:
        # exactly: x - mean(x) = 0, so y = b and dx = 0 (torch's reference carries
        # a rounding residue of mean() times rstd = 1/sqrt(eps) here)
        x, w, b = (leaf(t, dtype) for t in ins)
        y = ops.layer_norm(x, (1,), w, b, 1e-5)
        assert torch.equal(y, b.detach().expand_as(y))
        y.sum().backward()
        assert torch.all(x.grad == 0) and torch.all(w.grad == 0)
        return
    run_both(lambda x, w, b: ops.layer_norm(x, (n,), w, b, 1e-5),
             lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5), ins, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(dtype, shape):
    n = shape[-1]
    ins = [torch.randn(shape), torch.randn(n)]
    run_both(lambda x, w: ops.rms_norm(x, (n,), w, 1e-6), lambda x, w: F.rms_norm(x, (n,), w, 1e-6), ins, dtype)


def test_norm_without_affine_and_empty():
    x = torch.randn(4, 9, requires_grad=True)
    torch.testing.assert_close(ops.layer_norm(x, 9), F.layer_norm(x, (9,)))
    torch.testing.assert_close(ops.rms_norm(x, 9, eps=1e-6), F.rms_norm(x, (9,), eps=1e-6))
    e = torch.randn(0, 9, requires_grad=True)
    w = torch.randn(9, requires_grad=True)
    y = ops.layer_norm(e, (9,), w)
    assert y.shape == (0, 9)
    y.sum().backward()
    assert e.grad.shape == (0, 9) and torch.equal(w.grad, torch.zeros(9))


def test_norm_non_contiguous():
    base = torch.randn(6, 40)
    x = base[:, ::2]                       # strided
    assert not x.is_contiguous()
    w = torch.randn(20)
    torch.testing.assert_close(ops.layer_norm(x, (20,), w, None), F.layer_norm(x, (20,), w), rtol=1e-5, atol=1e-6)
    xt = torch.randn(20, 6).t()            # transposed
    torch.testing.assert_close(ops.rms_norm(xt, (20,), w, 1e-6), F.rms_norm(xt, (20,), w, 1e-6), rtol=1e-5,
                               atol=1e-6)


def test_norm_bad_input():
    with pytest.raises(ValueError, match="normalized_shape"):
        ops.layer_norm(torch.randn(3, 4), (5,))
    with pytest.raises(ValueError, match="last dimension only"):
        ops.layer_norm(torch.randn(3, 4), (3, 4))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        ops.layer_norm(torch.ones(3, 4, dtype=torch.int64), (4,))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        ops.rms_norm(torch.randn(3, 4, dtype=torch.float64), (4,))
    with pytest.raises(ValueError, match="weight of shape"):
        ops.layer_norm(torch.randn(3, 4), (4,), torch.randn(5))
    # the C entry points check too, before touching memory
    from shardformer import _C
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="rstd"):
        _C.norm_forward(False, x, None, None, 1e-5, torch.empty(3, 4), torch.empty(3), torch.empty(2))
    with pytest.raises(TypeError, match="float32"):
        _C.norm_forward(False, x, None, None, 1e-5, torch.empty(3, 4), None, torch.empty(3, dtype=torch.float16))
    with pytest.raises(TypeError, match="dtype"):
        _C.norm_forward(True, x, None, None, 1e-5, torch.empty(3, 4, dtype=torch.bfloat16), None, torch.empty(3))
    with pytest.raises(ValueError, match="contiguous"):
        _C.norm_forward(True, torch.randn(4, 3).t(), None, None, 1e-5, torch.empty(3, 4), None, torch.empty(3))


# ---- elementwise ------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_gelu(dtype, approximate, shape):
    n = shape[-1]
    ins = [torch.randn(shape) * 3, torch.randn(n)]
    run_both(lambda x, b: ops.bias_gelu(x, b, approximate), lambda x, b: F.gelu(x + b, approximate=approximate),
             ins, dtype)


def test_gelu_extremes():
    x = torch.tensor([-1e4, -30.0, -9.0, -1e-3, 0.0, 1e-3, 9.0, 30.0, 1e4], requires_grad=True)
    for approximate in ("none", "tanh"):
        x.grad = None
        y = ops.bias_gelu(x, None, approximate)
        xr = x.detach().clone().requires_grad_()
        yr = F.gelu(xr, approximate=approximate)
        torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-6)
        y.sum().backward()
        yr.sum().backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(3, 5000)])
def test_swiglu(dtype, shape):
    ins = [torch.randn(shape) * 4, torch.randn(shape)]
    run_both(ops.swiglu, lambda g, u: F.silu(g) * u, ins, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_dropout_add_no_dropout(dtype):
    ins = [torch.randn(5, 33), torch.randn(33), torch.randn(5, 33)]
    run_both(lambda x, b, r: ops.bias_dropout_add(x, b, r, 0.3, training=False),
             lambda x, b, r: r + (x + b), ins, dtype)


def test_bias_dropout_add_dropout():
    torch.manual_seed(0)
    x, b, r = torch.randn(64, 257, requires_grad=True), torch.randn(257, requires_grad=True), torch.randn(64, 257,
                                                                                                          requires_grad=True)
    p = 0.25
    y = ops.bias_dropout_add(x, b, r, p, seed=1234)
    kept = (y - r).detach() != 0
    frac = kept.float().mean().item()
    assert abs(frac - (1 - p)) < 0.01, frac
    # kept entries are scaled by 1/(1-p), dropped ones are exactly the residual
    torch.testing.assert_close((y - r)[kept], ((x + b) / (1 - p)).detach()[kept], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.detach()[~kept], r.detach()[~kept])
    # same seed, same mask; another seed, another mask
    y2 = ops.bias_dropout_add(x, b, r, p, seed=1234)
    assert torch.equal(y, y2)
    y3 = ops.bias_dropout_add(x, b, r, p, seed=99)
    assert not torch.equal((y3 - r) != 0, kept)
    g = torch.randn(64, 257)
    y.backward(g)
    mask = kept.float() / (1 - p)
    torch.testing.assert_close(x.grad, g * mask)
    torch.testing.assert_close(b.grad, (g * mask).sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.grad, g)
    z = ops.bias_dropout_add(x, None, r, 1.0, seed=5)
    assert torch.equal(z, r.detach())


def test_elementwise_bad_input():
    with pytest.raises(ValueError, match="shapes/dtypes differ"):
        ops.swiglu(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(ValueError, match="shapes/dtypes differ"):
        ops.swiglu(torch.randn(3, 4), torch.randn(3, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected 4"):
        ops.bias_gelu(torch.randn(3, 4), torch.randn(5))
    with pytest.raises(ValueError, match="approximate"):
        ops.bias_gelu(torch.randn(3, 4), None, "sigmoid")
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
        ops.bias_dropout_add(torch.randn(3, 4), None, torch.randn(3, 4), 1.5)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        ops.swiglu(torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32))


def test_non_contiguous_elementwise():
    g, u = torch.randn(8, 10)[:, ::2], torch.randn(5, 8).t()
    torch.testing.assert_close(ops.swiglu(g, u), F.silu(g) * u)
    torch.testing.assert_close(ops.bias_gelu(g, None), F.gelu(g))


# ---- embedding --------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_vocab_embedding(dtype):
    torch.manual_seed(0)
    w = torch.randn(10, 7).to(dtype).requires_grad_()
    ids = torch.tensor([[3, 12, 5, 5], [13, 4, 9, 2]])   # rows [3, 3 + 8) are ours (2 padding rows)
    out = ops.vocab_embedding(ids, w, vocab_start=3, vocab_real=8, padding_idx=2)
    mine = (ids >= 3) & (ids < 11)
    ref = torch.where(mine.unsqueeze(-1), w.detach()[(ids - 3).clamp(0, 9)], torch.zeros(()).to(dtype))
    assert torch.equal(out, ref)
    g = torch.randn(2, 4, 7).to(dtype)
    out.backward(g)
    expect = torch.zeros(10, 7)
    for i, t in zip(ids.flatten().tolist(), g.reshape(-1, 7).float()):
        if 3 <= i < 11 and i - 3 != 2:          # local row 2 is padding_idx: no gradient
            expect[i - 3] += t
    close(w.grad, expect, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_grad_recycled_and_bit_equal(dtype, monkeypatch):
    """The weight gradient is written into a recycled buffer (shardformer.recycled: no fresh
    zeroed [V/p, h] tensor per step) and is bit-equal to summing into float32 zeros and
    rounding once; a gradient the caller still holds (or a view of it) is never reused, and the
    second step's gradient takes the first's memory once the caller let go of it."""
    from shardformer import _C, recycled

    monkeypatch.setattr(recycled, "MIN_BYTES", 0)       # this small table goes through the pool too
    torch.manual_seed(0)
    w = torch.randn(40, 33).to(dtype).requires_grad_()  # rows [5, 5 + 37) ours, 3 padding rows
    ids = torch.randint(0, 50, (6, 9))
    ids[0, :4] = 7                                       # one row hit four times: the sum's order
    g = torch.randn(6, 9, 33).to(dtype)
    ref = torch.zeros(40, 33)
    _C.embedding_backward(g.reshape(-1, 33), ids.flatten(), 5, 37, 4, ref)
    ref = ref.to(dtype)
    grads, before = [], dict(recycled.STATS)
    for step in range(3):
        w.grad = None
        ops.vocab_embedding(ids, w, 5, 37, padding_idx=4).backward(g)
        assert torch.equal(w.grad, ref) and w.grad.dtype == dtype, f"step {step}"
        grads.append(w.grad if step == 0 else w.grad.data_ptr())
        if step == 0:
            held = w.grad[1:]                           # the caller keeps a view: its memory stays its own
            w.grad.fill_(float("nan"))                 # a dirty buffer for whoever reuses it later
    assert grads[1] != grads[0].data_ptr()             # step 0's memory still held: not reused
    assert torch.isnan(held).all()
    del held, grads[0]
    w.grad = None
    ops.vocab_embedding(ids, w, 5, 37, padding_idx=4).backward(g)
    assert torch.equal(w.grad, ref)
    assert recycled.STATS["reused"] > before["reused"]


def test_vocab_embedding_empty_and_bad():
    w = torch.randn(4, 3, requires_grad=True)
    out = ops.vocab_embedding(torch.zeros(0, dtype=torch.int64), w)
    assert out.shape == (0, 3)
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros(4, 3))
    with pytest.raises(TypeError, match="integer ids"):
        ops.vocab_embedding(torch.zeros(2), w)
    with pytest.raises(ValueError, match="vocab_real=5"):
        ops.vocab_embedding(torch.zeros(2, dtype=torch.int64), w, 0, 5)
    with pytest.raises(ValueError, match="2-D"):
        ops.vocab_embedding(torch.zeros(2, dtype=torch.int64), torch.randn(4))


# ---- cross-entropy ----------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("vocab", [1, 37, 2100])
def test_cross_entropy_tp1(dtype, reduction, smoothing, vocab):
    from shardformer.layer import cross_entropy_1d

    torch.manual_seed(0)
    z = (torch.randn(3, 5, vocab) * 4).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (3, 5))
    y[0, :2] = -100
    zr = z.detach().float().requires_grad_()
    loss = cross_entropy_1d(z, y, vocab_size=vocab, label_smoothing=smoothing, reduction=reduction)
    ref = F.cross_entropy(zr.reshape(-1, vocab), y.reshape(-1), label_smoothing=smoothing, reduction=reduction)
    ref = ref.reshape(loss.shape)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    g = torch.rand(ref.shape)
    loss.backward(g)
    ref.backward(g)
    close(z.grad, zr.grad, dtype, "dlogits")
    assert z.grad.dtype == dtype
    assert torch.all(z.grad[0, :2] == 0)


def test_cross_entropy_padding_columns_and_all_ignored():
    from shardformer.layer import cross_entropy_1d

    z = torch.randn(4, 12, requires_grad=True)      # 10 real columns + 2 padding columns
    y = torch.tensor([0, 9, 3, -100])
    loss = cross_entropy_1d(z, y, vocab_size=10, label_smoothing=0.2)
    zr = z.detach()[:, :10].clone().requires_grad_()
    ref = F.cross_entropy(zr, y, label_smoothing=0.2)
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(z.grad[:, :10], zr.grad)
    assert torch.all(z.grad[:, 10:] == 0)
    z.grad = None
    none = cross_entropy_1d(z, torch.full((4,), -100), vocab_size=10)
    assert none.item() == 0.0
    none.backward()
    assert torch.all(z.grad == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_propagates(dtype):
    """A NaN logit or attention score gives NaN, as torch does, wherever it
    sits (the vector exp's clamp and the vector max once turned it into a
    number: a NaN in the first 16 columns of a row was dropped from the
    loss, its gradient and the attention's softmax, silently)."""
    from shardformer.layer import cross_entropy_1d

    torch.manual_seed(0)
    z = torch.randn(4, 40).to(dtype)
    z[1, 5] = float("nan")                       # inside the vector body
    z[2, 37] = float("nan")                      # in the scalar tail
    z[3, :] = float("nan")                       # a whole row
    y = torch.tensor([0, 9, 3, 7])
    zs, zr = z.clone().requires_grad_(), z.clone().requires_grad_()
    loss = cross_entropy_1d(zs, y, vocab_size=40, reduction="none")
    ref = F.cross_entropy(zr.float(), y, reduction="none")
    assert torch.equal(loss.isnan(), ref.isnan()), (loss, ref)
    loss.sum().backward()
    ref.sum().backward()
    assert torch.equal(zs.grad.isnan(), zr.grad.isnan()), (zs.grad.isnan().sum(1), zr.grad.isnan().sum(1))
    q, k, v = (torch.randn(1, 2, 3, 8).to(dtype), torch.randn(1, 2, 40, 8).to(dtype),
               torch.randn(1, 2, 40, 8).to(dtype))
    k[0, 0, 3, 1] = float("nan")                 # every score of head 0 with key 3
    out = ops.attention(q, k, v)
    exp = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert torch.equal(out.isnan(), exp.isnan()), out.isnan().sum((0, 2, 3))


def test_cross_entropy_non_contiguous_and_bad():
    from shardformer.layer import cross_entropy_1d

    z = torch.randn(20, 6).t().requires_grad_()      # [6, 20], transposed
    y = torch.randint(0, 20, (6,))
    loss = cross_entropy_1d(z, y, vocab_size=20)
    torch.testing.assert_close(loss, F.cross_entropy(z, y))
    with pytest.raises(ValueError, match="expected labels of shape"):
        cross_entropy_1d(z, y[:5], vocab_size=20)
    with pytest.raises(TypeError, match="integer ids"):
        cross_entropy_1d(z, y.float(), vocab_size=20)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        cross_entropy_1d(z.detach().double(), y, vocab_size=20)
    from shardformer import _C
    zz = torch.randn(6, 20)
    with pytest.raises(ValueError, match="vocab_real=21"):
        _C.xent_forward(zz, y, 0, 21, -100, *(torch.empty(6) for _ in range(3)), None)
    with pytest.raises(ValueError, match="labels has 5 elements"):
        _C.xent_forward(zz, y[:5], 0, 20, -100, *(torch.empty(6) for _ in range(3)), None)
    with pytest.raises(TypeError, match="int64"):
        _C.xent_forward(zz, y.int(), 0, 20, -100, *(torch.empty(6) for _ in range(3)), None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_inplace_backward(dtype):
    from shardformer.layer import cross_entropy_1d

    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    lin = torch.nn.Linear(8, 50).to(dtype)
    y = torch.randint(0, 50, (6,))
    y[2] = -100
    grads = []
    for inplace in (False, True):
        x.grad = None
        logits = lin(x.to(dtype))
        ptr = logits.data_ptr()
        seen = {}
        logits.register_hook(lambda g: seen.update(ptr=g.data_ptr()))
        cross_entropy_1d(logits, y, vocab_size=50, label_smoothing=0.1, inplace_backward=inplace).backward()
        assert (seen["ptr"] == ptr) == inplace
        grads.append(x.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("smoothing,reduction", [(0.0, "mean"), (0.1, "mean"), (0.1, "sum"), (0.0, "none")])
def test_vocab_parallel_cross_entropy(pool, tp, smoothing, reduction):
    # vocab 37 padded to a multiple of 4 * tp: the last rank holds padding columns
    pool.run(layers.cross_entropy_matches, tp, 37, smoothing, reduction)


def bf16_cross_entropy(ctx):
    """bf16 shards of a [6, 50] logit matrix against F.cross_entropy in fp32."""
    from shardformer.layer import cross_entropy_1d

    torch.manual_seed(0)
    full = (torch.randn(6, 50) * 3).to(torch.bfloat16)
    y = torch.randint(0, 50, (6,))
    per = -(-50 // ctx.tp_size)
    local = torch.zeros(6, per, dtype=torch.bfloat16)
    real = full[:, ctx.rank * per:(ctx.rank + 1) * per]
    local[:, :real.shape[1]] = real
    local.requires_grad_()
    loss = cross_entropy_1d(local, y, vocab_size=50, label_smoothing=0.1, process_group=ctx.group)
    zr = full.float().requires_grad_()
    ref = F.cross_entropy(zr, y, label_smoothing=0.1)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    loss.backward()
    ref.backward()
    mine = zr.grad[:, ctx.rank * per:(ctx.rank + 1) * per]
    torch.testing.assert_close(local.grad[:, :mine.shape[1]].float(), mine, rtol=2e-2, atol=1e-3)
    assert torch.all(local.grad[:, mine.shape[1]:] == 0)
    return np.float32(loss.item())


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy_bf16(pool, tp):
    losses = pool.run(bf16_cross_entropy, tp)
    assert len(set(float(x) for x in losses)) == 1


# ---- end to end -------------------------------------------------------------

@pytest.mark.transformers_independent(False)
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM"])
def test_models_with_fused_kernels(pool, name):
    pool.run(parity.check_model, 2, name, config={"enable_all_optimization": True})


@pytest.mark.transformers_independent(False)
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM"])
def test_jit_fused_replaces_the_mlp(name):
    import zoo
    from shardformer import ShardConfig, ShardFormer

    model = zoo.build(name, torch.float32)
    sharded, _ = ShardFormer(shard_config=ShardConfig(enable_jit_fused=True)).optimize(model)
    replaced = [m for m in sharded.modules() if "forward" in vars(m)]
    assert replaced, f"{name}: enable_jit_fused replaced no forward"
    assert all(vars(m)["forward"].__func__.__module__ == "shardformer.optimizations" for m in replaced)


def test_threads_match_single_thread():
    from shardformer.layer import cross_entropy_1d

    z = torch.randn(64, 4099, requires_grad=True)
    y = torch.randint(0, 4099, (64,))
    x = torch.randn(512, 300)
    w = torch.randn(300)
    outs = []
    try:
        for n in (1, 2, 3):
            ops.set_num_threads(n)
            z.grad = None
            loss = cross_entropy_1d(z, y, vocab_size=4099)
            loss.backward()
            outs.append((loss.detach(), z.grad.clone(), ops.layer_norm(x, (300,), w), ops.swiglu(x, x)))
    finally:
        ops.set_num_threads(None)
    for o in outs[1:]:
        for a, b in zip(outs[0], o):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="outside"):
        ops.set_num_threads(0)
    torch_threads = torch.get_num_threads()
    try:   # unpinned, the kernels follow torch's thread count at the next call
        torch.set_num_threads(2)
        ops.layer_norm(x, (300,), w)
        assert ops.get_num_threads() == 2
    finally:
        torch.set_num_threads(torch_threads)


def test_empty_inputs():
    from shardformer.layer import cross_entropy_1d

    z = torch.randn(0, 7, requires_grad=True)
    loss = cross_entropy_1d(z, torch.zeros(0, dtype=torch.int64), vocab_size=7, reduction="sum")
    assert loss.item() == 0.0
    loss.backward()
    assert z.grad.shape == (0, 7)
    for fn in (lambda t: ops.swiglu(t, t), lambda t: ops.bias_gelu(t, torch.randn(5)),
               lambda t: ops.bias_dropout_add(t, None, t, 0.5, seed=1)):
        t = torch.randn(0, 5, requires_grad=True)
        out = fn(t)
        assert out.shape == (0, 5)
        out.sum().backward()
        assert t.grad.shape == (0, 5)


# ---- the worker pool of the row-parallel driver (csrc/kernels/common.c) -----

def _pool_inputs():
    x = torch.randn(2048, 256)   # 2048 rows x 256: above the driver's threshold for threads
    w = torch.randn(256)
    return x, w, F.layer_norm(x, (256,), w)


def test_pool_threads_are_reused():
    from shardformer import _C

    x, w, ref = _pool_inputs()
    try:
        ops.set_num_threads(2)
        ops.layer_norm(x, (256,), w)      # makes the pool (if no earlier test did)
        before = _C.kernel_pool_stats()
        assert before["workers"] == 1
        for _ in range(200):
            y = ops.layer_norm(x, (256,), w)
        ops.bias_gelu(x, w).sum()
        after = _C.kernel_pool_stats()
    finally:
        ops.set_num_threads(None)
    close(y, ref, torch.float32)
    assert after["threads_created"] == before["threads_created"], (before, after)
    assert after["pool_calls"] - before["pool_calls"] >= 200, (before, after)


def test_pool_survives_fork():
    import os

    from shardformer import _C

    x, w, ref = _pool_inputs()
    try:
        ops.set_num_threads(2)
        ops.layer_norm(x, (256,), w)
        assert _C.kernel_pool_stats()["workers"] == 1
        pid = os.fork()
        if pid == 0:    # the child has none of the parent's workers: it makes its own
            code = 1
            try:
                # (torch's own OpenMP pool is not fork-safe: no parallel torch op
                # here, the check is numpy's)
                torch.set_num_threads(1)
                ys = [ops.layer_norm(x, (256,), w) for _ in range(20)]
                st = _C.kernel_pool_stats()
                code = 0 if all(np.allclose(y.numpy(), ref.numpy(), rtol=1e-5, atol=1e-5) for y in ys) \
                    and st["workers"] == 1 else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        close(ops.layer_norm(x, (256,), w), ref, torch.float32)    # the parent's pool still works
    finally:
        ops.set_num_threads(None)


def test_pool_concurrent_python_threads():
    import threading

    from shardformer import _C

    x, w, ref = _pool_inputs()
    bad = []

    def run():
        for _ in range(50):
            if not torch.allclose(ops.layer_norm(x, (256,), w), ref, rtol=1e-5, atol=1e-5):
                bad.append(1)
    try:
        ops.set_num_threads(2)
        ts = [threading.Thread(target=run) for _ in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        ops.set_num_threads(3)    # a new size: the next parallel call remakes the pool
        close(ops.layer_norm(x, (256,), w), ref, torch.float32)
        assert _C.kernel_pool_stats()["workers"] == 2
        _C.kernel_pool_shutdown()
        assert _C.kernel_pool_stats()["workers"] == 0
        close(ops.layer_norm(x, (256,), w), ref, torch.float32)
    finally:
        ops.set_num_threads(None)
    assert not bad


def test_gelu_erf_accuracy():
    """The erf form against float64 (written as erfc: no cancellation) over
    [-14, 14] and beyond: within a few fp32 ulps of the result in the normal
    range, left tail included (where 1 + erf(x / sqrt 2) loses everything, and
    where exp(-x^2 / 2) is already subnormal at x < -13.2 but Phi(x) and the
    gradient are still normal down to x = -13.34).  Fixed draws: the points
    are the same on every run."""
    import math

    draws = torch.randn(20000, generator=torch.Generator().manual_seed(0)) * 3
    x = torch.cat([torch.linspace(-14, 14, 560_001), draws, torch.linspace(-13.4, -13.1, 100_001),
                   torch.tensor([-1e4, -30.0, -14.0, 14.0, 30.0, 1e4, -1e-30, 1e-30, 0.0])])
    x = x.float().requires_grad_()
    y = ops.bias_gelu(x, None)
    xd = x.detach().double().requires_grad_()
    yd = 0.5 * xd * torch.special.erfc(-xd / math.sqrt(2))
    y.sum().backward()
    yd.sum().backward()
    u = xd.detach()
    # the gradient Phi(u) + u phi(u) crosses 0 near u = -0.75: ulps of its terms' size
    terms = 0.5 * torch.special.erfc(-u / math.sqrt(2)) + (u * torch.exp(-u * u / 2)).abs() / math.sqrt(2 * math.pi)
    for ours, ref, scale, what, limit in ((y.detach(), yd.detach(), yd.detach().abs(), "forward", 16),
                                          (x.grad, xd.grad, terms, "gradient", 16)):
        normal = ref.abs() > 1.2e-38
        ulp = torch.pow(2.0, torch.floor(torch.log2(scale[normal])) - 23)
        err = ((ours.double()[normal] - ref[normal]).abs() / ulp).max().item()
        assert err <= limit, f"{what}: {err:.1f} ulps"
        assert (ours.double() - ref).abs().max().item() < 1e-6, what
