"""The CUDA kernels (csrc/cuda/, shardformer._cuda) against torch's own ops on
CUDA, through the same shardformer.ops functions the CPU kernels serve.

Every test is marked `gpu` and skips without a CUDA device (there is none in
CI; a lent H100 / H200 runs them: docs/cuda.md).  Inputs are drawn in the
tested dtype; the reference is torch on CUDA in float32 from those same
values, so the only differences are the kernels' fp32 summation order and the
one rounding of a 16-bit result.  Tolerances (rtol = atol) per dtype:
    float32 2e-5 (outputs), 1e-4 (gradients summed over rows: dw, db)
    float16 2e-3 (about two ulps at 1: 2^-10 = 9.8e-4)
    bfloat16 1.6e-2 (about two ulps at 1: 2^-7 = 7.8e-3)
Sizes are odd on purpose: rows that are no multiple of a block, vocabulary
shards with padding columns and a start that is not 0.
"""
import pytest
import torch
import torch.nn.functional as F

from shardformer import ops

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SUM_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DEV = "cuda"


@pytest.fixture(autouse=True)
def _built():
    # a GPU with no _cuda is a build problem, not a reason to skip
    assert ops.cuda_built(), ops.CUDA_MISSING


def close(got, want, tol, what):
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def draw(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("rows,n", [(37, 1000), (5, 33), (300, 4099)])
def test_norms_forward_backward(dtype, rms, rows, n):
    x = draw(rows, n, dtype=dtype, scale=2.0, seed=1).add_(0.5).requires_grad_()
    w = draw(n, dtype=torch.float32, seed=2).add_(1.0).requires_grad_()
    b = None if rms else draw(n, dtype=torch.float32, seed=3).requires_grad_()
    dy = draw(rows, n, dtype=dtype, seed=4)
    side = torch.cuda.Stream()                    # the kernels enqueue on torch's current stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = ops.rms_norm(x, (n,), w, 1e-6) if rms else ops.layer_norm(x, (n,), w, b, 1e-5)
        y.backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    xr = x.detach().float().requires_grad_()
    wr = w.detach().clone().requires_grad_()
    br = None if rms else b.detach().clone().requires_grad_()
    yr = F.rms_norm(xr, (n,), wr, 1e-6) if rms else F.layer_norm(xr, (n,), wr, br, 1e-5)
    yr.backward(dy.float())
    assert y.dtype == dtype and x.grad.dtype == dtype
    close(y, yr, TOL[dtype], "y")
    close(x.grad, xr.grad, TOL[dtype] * 5, "dx")
    close(w.grad, wr.grad, SUM_TOL[dtype] * rows ** 0.5, "dweight")
    if not rms:
        close(b.grad, br.grad, SUM_TOL[dtype] * rows ** 0.5, "dbias")


def _xent_case(dtype, rows=19, local=1001, real=997, start=1000, vocab=1997):
    z = draw(rows, local, dtype=dtype, scale=3.0, seed=5)
    g = torch.Generator(device=DEV).manual_seed(6)
    y = torch.randint(0, vocab, (rows,), generator=g, device=DEV)
    y[0], y[1], y[2] = -100, start, start + real - 1      # ignored, first and last real column
    y[3] = start - 1                                      # another shard's
    return z, y, real, start, vocab


@pytest.mark.parametrize("dtype", DTYPES)
def test_xent_stats_and_grad_match_torch(dtype):
    from shardformer.layer.loss import torch_xent_grad, torch_xent_stats

    z, y, real, start, vocab = _xent_case(dtype)
    got = ops.xent_stats(z, y, start, real, -100, True, vocab_size=vocab)
    want = torch_xent_stats(z, y, start, real, -100, True, vocab_size=vocab)
    for name, a, b in zip(("max", "sumexp", "target", "sumz"), got, want):
        close(a, b, 2e-5 if name != "sumz" else 1e-4, name)       # fp32 statistics of the same values
    lse = got[0] + got[1].log()
    scale = torch.rand(z.shape[0], device=DEV)
    scale[0] = 0.0                                                # the ignored row
    g = ops.xent_grad(z, y, start, real, -100, lse, scale, 0.1, vocab)
    gr = torch_xent_grad(z, y, start, real, -100, lse, scale, 0.1, vocab)
    assert g.dtype == dtype
    close(g, gr, TOL[dtype], "grad")
    assert torch.all(g[:, real:] == 0) and torch.all(g[0] == 0)
    zz = z.clone()                                                 # in place: grad = logits
    ops.xent_grad(zz, y, start, real, -100, lse, scale, 0.1, vocab, out=zz)
    close(zz, g, 0.0, "in-place grad")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_1d_on_cuda(dtype):
    from shardformer.layer import cross_entropy_1d

    rows, vocab = 23, 1003
    z = draw(rows, vocab, dtype=dtype, scale=2.0, seed=7).requires_grad_()
    y = torch.randint(0, vocab, (rows,), device=DEV)
    y[5] = -100
    loss = cross_entropy_1d(z, y, vocab_size=vocab, label_smoothing=0.1)
    loss.backward()
    zr = z.detach().float().requires_grad_()
    ref = F.cross_entropy(zr, y, label_smoothing=0.1)
    ref.backward()
    close(loss, ref, TOL[dtype], "loss")
    close(z.grad, zr.grad, TOL[dtype], "dlogits")
    with pytest.raises(IndexError, match=r"label 1003 \(row 2\) is out of range for the vocabulary of 1003"):
        ops.xent_stats(z.detach()[:4].contiguous(), torch.tensor([0, 1, vocab, 7], device=DEV), 0, vocab,
                       -100, False, vocab_size=vocab)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vocab_embedding_forward_backward(dtype):
    real, start, vocab, d = 37, 40, 101, 67               # shard [40, 77) of 101 ids, 3 padding rows
    w = draw(real + 3, d, dtype=dtype, seed=8).requires_grad_()
    ids = torch.randint(0, vocab, (5, 31), device=DEV)
    ids[0, :5] = torch.tensor([start, start + real - 1, start + 8, start + 8, start + 7])   # 8 repeated
    pad = 7                                                # local padding row: no gradient
    out = ops.vocab_embedding(ids, w, start, real, pad, vocab)
    dout = draw(5, 31, d, dtype=dtype, seed=9)
    out.backward(dout)
    local = ids - start
    mine = (local >= 0) & (local < real)
    want = torch.where(mine[..., None], w.detach()[local.clamp(0, real - 1)], torch.zeros((), dtype=dtype, device=DEV))
    assert out.dtype == dtype
    close(out, want, 0.0, "rows")                           # a copy: exact
    dw = torch.zeros(real + 3, d, device=DEV)
    dw.index_add_(0, local[mine], dout[mine].float())
    dw[pad] = 0
    close(w.grad, dw.to(dtype), TOL[dtype], "dweight")
    with pytest.raises(IndexError, match="index 101 is out of range for the vocabulary of 101"):
        ops.vocab_embedding(torch.tensor([3, 101, 5], device=DEV), w, start, real, None, vocab)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu(dtype, approximate):
    rows, n = 41, 777
    x = draw(rows, n, dtype=dtype, scale=3.0, seed=10).requires_grad_()
    b = draw(n, dtype=torch.float32, seed=11).requires_grad_()
    dy = draw(rows, n, dtype=dtype, seed=12)
    y = ops.bias_gelu(x, b, approximate)
    y.backward(dy)
    xr, br = x.detach().float().requires_grad_(), b.detach().clone().requires_grad_()
    yr = F.gelu(xr + br, approximate=approximate)
    yr.backward(dy.float())
    close(y, yr, TOL[dtype], "y")
    close(x.grad, xr.grad, TOL[dtype], "dx")
    close(b.grad, br.grad, SUM_TOL[dtype] * rows ** 0.5, "dbias")


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    g = draw(3, 17, 129, dtype=dtype, scale=3.0, seed=13).requires_grad_()
    u = draw(3, 17, 129, dtype=dtype, seed=14).requires_grad_()
    dy = draw(3, 17, 129, dtype=dtype, seed=15)
    y = ops.swiglu(g, u)
    y.backward(dy)
    gr, ur = g.detach().float().requires_grad_(), u.detach().float().requires_grad_()
    yr = F.silu(gr) * ur
    yr.backward(dy.float())
    close(y, yr, TOL[dtype], "y")
    close(g.grad, gr.grad, TOL[dtype], "dgate")
    close(u.grad, ur.grad, TOL[dtype], "dup")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_bias_dropout_add_same_mask_as_cpu(dtype, p):
    rows, n, seed = 29, 515, 1234567
    # the CPU kernel's mask for this seed: y = keep / (1 - p) for x = 1, residual = 0
    cpu = ops.bias_dropout_add(torch.ones(rows, n), None, torch.zeros(rows, n), p, True, seed)
    keep = (cpu != 0).to(DEV)
    x = draw(rows, n, dtype=dtype, seed=16).requires_grad_()
    b = draw(n, dtype=torch.float32, seed=17).requires_grad_()
    r = draw(rows, n, dtype=dtype, seed=18).requires_grad_()
    dy = draw(rows, n, dtype=dtype, seed=19)
    y = ops.bias_dropout_add(x, b, r, p, True, seed)
    y.backward(dy)
    s = 1.0 / (1.0 - p)
    close(y, r.detach().float() + keep * (x.detach().float() + b.detach()) * s, TOL[dtype], "y")
    close(x.grad, keep * dy.float() * s, TOL[dtype], "dx")
    close(b.grad, (keep * dy.float() * s).sum(0), SUM_TOL[dtype] * rows ** 0.5, "dbias")
    close(r.grad, dy, 0.0, "dresidual")
    again = ops.bias_dropout_add(x.detach(), b.detach(), r.detach(), p, True, seed)
    close(again, y.detach(), 0.0, "same seed, same output")
    if p > 0:
        kept = keep.float().mean().item()          # 14935 draws: 1 - p within 5 standard deviations
        assert abs(kept - (1 - p)) < 5 * (p * (1 - p) / keep.numel()) ** 0.5


def test_fused_modules_run_the_cuda_kernels(monkeypatch):
    from shardformer.layer.normalization import FusedLayerNorm

    real, calls = ops._cuda_module(), []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(ops, "_cuda_ext", Spy())
    ln = torch.nn.LayerNorm(257, device=DEV)
    fused = FusedLayerNorm.from_native_module(ln)
    x = draw(13, 257, dtype=torch.float32, seed=20).requires_grad_()
    fused(x).sum().backward()
    xr = x.detach().clone().requires_grad_()
    ln(xr).sum().backward()
    assert "norm_forward" in calls and "norm_backward" in calls
    close(x.grad, xr.grad, 1e-4, "dx")


def test_cuda_kernels_refuse_bad_input():
    x = draw(4, 8, dtype=torch.float32, seed=21)
    with pytest.raises(ValueError, match="weight.*expected a CUDA tensor, got a CPU tensor"):
        ops.layer_norm(x, (8,), torch.ones(8), None)
    with pytest.raises(ValueError, match="p=1.5 outside|p must be in"):
        ops.bias_dropout_add(x, None, x, 1.5)
    with pytest.raises(ValueError, match="attention.*CPU tensors"):
        ops.attention(x[None, None], x[None, None], x[None, None])
