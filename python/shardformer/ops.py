"""Autograd functions over the C kernels in csrc/kernels/ (shardformer._C).

Every op takes CPU tensors of float32, float16 or bfloat16 of any leading
shape, computes in float32 and returns the input's dtype.  Non-contiguous
inputs are copied to contiguous ones first; anything else (another device,
an integer dtype, mismatched shapes) raises before any work.

Device dispatch: the norms, bias_gelu, swiglu, bias_dropout_add,
vocab_embedding and xent_stats / xent_grad also take CUDA tensors, which run
the CUDA kernels of csrc/cuda/ (shardformer._cuda, imported on the first
CUDA tensor; enqueued on torch's current stream of the tensor's device): the
same functions, the same math.  A build without CUDA refuses them with a
RuntimeError saying how to rebuild (kernels_for); fused_input(x) tells the
fused modules whether to call the kernels or fall back to torch.  attention
and skinny_linear are CPU only.  See docs/cuda.md.  Parameters
(norm weights, biases) are handed to C as float32 and their gradients are
cast back to the parameter's dtype.

    layer_norm(x, w, b, eps)      y = (x - mean) / sqrt(var + eps) * w + b   (last dim)
    rms_norm(x, w, eps)           y = x / sqrt(mean(x^2) + eps) * w
    bias_gelu(x, b, approximate)  y = gelu(x + b), erf ("none") or "tanh" form
    swiglu(gate, up)              y = silu(gate) * up
    bias_dropout_add(x, b, r, p)  y = r + dropout_p(x + b); the mask is redrawn
                                  in backward from a seed, never stored
    vocab_embedding(ids, W, ...)  rows of W for ids in [start, start + real), 0 elsewhere;
                                  with vocab_size, an id outside [0, vocab_size) is an IndexError
    xent_stats / xent_grad        the local halves of vocabulary-parallel cross-entropy
                                  (shardformer.layer.loss combines them across ranks)
    attention(q, k, v, ...)       softmax(scale q k^T + bias + masks) v, flash style
                                  (never an [Sq, Sk] matrix); see attention()
    skinny_linear(x, W, b)        y = x W^T + b on few rows (decoding), without autograd:
                                  W streamed once at the memory's read rate, read in
                                  place when its rows are strided (a column slice)
"""
from __future__ import annotations

import math

import torch

from . import _C, recycled

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: The error for a CUDA tensor when shardformer._cuda was not built.
CUDA_MISSING = ("shardformer was built without CUDA (nvcc not found at build time); rebuild with "
                "SHARDFORMER_CUDA=1 (see docs/cuda.md)")

_cuda_ext = None
_cuda_import_error: ImportError | None = None   # the import failed once: not tried again


def _cuda_module():
    """shardformer._cuda, imported on first use; RuntimeError(CUDA_MISSING) when
    the build had no CUDA toolkit."""
    global _cuda_ext, _cuda_import_error
    if _cuda_ext is None:
        if _cuda_import_error is None:
            try:
                from . import _cuda
            except ImportError as e:
                _cuda_import_error = e
            else:
                _cuda_ext = _cuda
                return _cuda_ext
        raise RuntimeError(CUDA_MISSING) from _cuda_import_error
    return _cuda_ext


def cuda_built() -> bool:
    """Whether shardformer._cuda was built (and loads); says nothing of a GPU."""
    try:
        _cuda_module()
    except RuntimeError:
        return False
    return True


class _OnStream:
    """_cuda's functions with `stream` appended to every call: the call of the
    _C function of the same name."""

    def __init__(self, module, stream: int):
        self._module, self._stream = module, int(stream)

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        return lambda *args: fn(*args, self._stream)


def kernels_for(device: torch.device):
    """The kernels for tensors on `device`: _C for CPU; for CUDA, _cuda's (the
    extension imported now, RuntimeError(CUDA_MISSING) without it) bound to
    torch's current stream on that device; ValueError for any other device."""
    if device.type == "cpu":
        return _C
    if device.type == "cuda":
        module = _cuda_module()
        return _OnStream(module, torch.cuda.current_stream(device).cuda_stream)
    raise ValueError(f"the kernels run on CPU or CUDA tensors, got device {device}")

#: Calls that ran a kernel, by op, for ops that callers choose per call (tests
#: read these to prove the kernel ran, not a fallback).
CALLS = {"skinny_linear": 0, "skinny_linear_strided": 0}


# Threads the kernels use: torch's intra-op count unless set_num_threads pinned one.
#
# Policy (issue 16): the kernels run on their own persistent pool of
# n - 1 worker threads (csrc/kernels/common.c; made at the first parallel
# call, remade when n changes, joined at exit, made afresh in a forked child),
# and n follows torch's intra-op thread count.  The two pools never run at
# the same time (a kernel starts after the torch op before it returned), but
# with OMP_WAIT_POLICY unset torch's OpenMP workers keep spinning for a while
# after each torch op, and on a machine with no spare core the kernels'
# workers then wait for a CPU.  benchmarks/kernel_pool.py (2 threads, a
# [2048 x 256] layer_norm right after a torch.mm, torch = the same pair with
# F.layer_norm) on the shared 2-core machine, load 3-5 from other processes:
# 0.2-0.6x with the default policy, 0.8-1.0x with OMP_WAIT_POLICY=PASSIVE
# (noisy; one thread and the kernel alone do not depend on it).  We do not set OMP_WAIT_POLICY ourselves: it
# must be in the environment before torch is imported, and it changes the
# speed of every torch op, which is the user's trade.  Where the kernels carry
# the run on a small machine, export OMP_WAIT_POLICY=PASSIVE (or pin
# set_num_threads(1) and leave the cores to torch).  The kernels' own workers
# spin only briefly (some 10-40 us) before they block, so they do not do to
# torch what its workers do to them.
_pinned_threads: int | None = None


def set_num_threads(n: int | None) -> None:
    """Threads the kernels split rows over (for inputs large enough to pay);
    None = follow torch.get_num_threads(), the default.  The kernels keep a
    pool of n - 1 worker threads (made at the first parallel call after n
    changes, shared by every kernel, reused over calls: see
    shardformer._C.kernel_pool_stats()); a kernel called while another
    Python thread's kernel holds the pool runs on its calling thread alone.
    See the comment above about torch's OpenMP workers and OMP_WAIT_POLICY."""
    global _pinned_threads
    _C.kernel_set_num_threads(min(torch.get_num_threads(), 64) if n is None else int(n))  # checks n
    _pinned_threads = None if n is None else int(n)


def get_num_threads() -> int:
    return _C.kernel_get_num_threads()


def _follow_torch_threads() -> None:
    if _pinned_threads is None:
        n = min(torch.get_num_threads(), 64)
        if n != _C.kernel_get_num_threads():
            _C.kernel_set_num_threads(n)


def follow_torch_threads() -> None:
    """The kernels' thread count catches up with torch's (unless pinned by
    set_num_threads): what every op does first, for callers that reach the
    kernels without an op (the decode step's C loop)."""
    _follow_torch_threads()


def _data(t: torch.Tensor, what: str, cuda: bool = True) -> torch.Tensor:
    """`t` ready for the kernels: detached, contiguous, CPU (or CUDA, for the
    ops with CUDA kernels: cuda=True), a float dtype.  Every op passes its
    inputs through here first, so this is also where the kernels' thread
    count catches up with torch's (see set_num_threads)."""
    _follow_torch_threads()
    check_input(t, what, cuda)
    return t.detach().contiguous()


def check_input(t: torch.Tensor, what: str, cuda: bool = True) -> None:
    """_data's checks alone (no C call: torch.compile traces it)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(t).__name__}")
    _check_device(t, what, cuda)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{what}: dtype must be float32, float16 or bfloat16, got {t.dtype}")


def _check_device(t: torch.Tensor, what: str, cuda: bool) -> None:
    if t.device.type == "cpu" or (cuda and t.device.type == "cuda"):
        return
    where = "CPU or CUDA tensors" if cuda else "CPU tensors (this op has no CUDA kernel)"
    raise ValueError(f"{what}: the kernels run on {where}, got device {t.device}")


def _param(p: torch.Tensor | None, n: int, what: str) -> torch.Tensor | None:
    """A weight / bias of n elements as contiguous float32 (None stays None)."""
    if p is None:
        return None
    p = _data(p, what)
    if p.numel() != n:
        raise ValueError(f"{what}: has {p.numel()} elements (shape {tuple(p.shape)}), "
                         f"expected {n} (the last dimension of the input)")
    return p.float().contiguous()


def _ids(t: torch.Tensor, what: str) -> torch.Tensor:
    _check_device(t, what, True)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{what}: expected integer ids, got {t.dtype}")
    return t.detach().to(torch.int64).contiguous()


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"{what}: shapes/dtypes differ: {tuple(a.shape)} {a.dtype} vs "
                         f"{tuple(b.shape)} {b.dtype}")


def _apply(name: str, *args):
    """The autograd.Function of op `name` (below, EAGER) applied to args; while
    torch.compile traces, the custom op that runs the same kernel
    (TRACEABLE, filled by compile_ops), which dynamo traces without a graph
    break."""
    if torch.compiler.is_compiling():
        return TRACEABLE[name](*args)
    return EAGER[name].apply(*args)


def _seed(seed, p: float):
    """The dropout seed: `seed`, else one draw from torch's generator when p > 0
    (0 otherwise).  While torch.compile traces, a 1-element int64 tensor
    (drawn in the graph: no .item()), which the custom ops read."""
    if torch.compiler.is_compiling():
        if seed is not None:
            return torch.tensor([int(seed)], dtype=torch.int64)
        return torch.randint(0, 2**62, (1,)) if p > 0 else torch.zeros(1, dtype=torch.int64)
    if seed is None:
        return int(torch.randint(0, 2**62, (1,)).item()) if p > 0 else 0
    return int(seed)


# ---- normalization ----------------------------------------------------------

# The kernel calls, shared by the autograd.Functions below (eager) and the
# torch.library custom ops of compile_ops.py (torch.compile): each *_fwd /
# *_bwd takes the op's tensors as given and returns new ones.

def norm_fwd(x, weight, bias, eps, rms):
    """(x, w) as the kernel read them, y, mean (None for rms) and rstd (float32, per row)."""
    xd = _data(x, "rms_norm input" if rms else "layer_norm input")
    n = xd.shape[-1] if xd.dim() else 1
    w, b = _param(weight, n, "norm weight"), None if rms else _param(bias, n, "norm bias")
    rows = math.prod(xd.shape[:-1])
    y = torch.empty_like(xd)
    mean = None if rms else torch.empty(rows, dtype=torch.float32, device=xd.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=xd.device)
    kernels_for(xd.device).norm_forward(rms, xd, w, b, float(eps), y, mean, rstd)
    return xd, w, y, mean, rstd


def norm_bwd(dy, xd, w, mean, rstd, rms, want_dw, want_db):
    """dx (x's dtype), and dw / db in float32 (None unless wanted)."""
    dy = _data(dy, "norm grad").to(xd.dtype).contiguous()
    dx = torch.empty_like(xd)
    n = xd.shape[-1] if xd.dim() else 1
    dw = torch.empty(n, dtype=torch.float32, device=xd.device) if w is not None and want_dw else None
    db = torch.empty(n, dtype=torch.float32, device=xd.device) if want_db else None
    kernels_for(xd.device).norm_backward(rms, dy, xd, w, mean, rstd, dx, dw, db)
    return dx, dw, db


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        xd, w, y, mean, rstd = norm_fwd(x, weight, bias, eps, rms)
        ctx.save_for_backward(xd, w, mean, rstd)
        ctx.rms = rms
        ctx.wdtype = None if weight is None else weight.dtype
        ctx.bdtype = None if bias is None or rms else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        xd, w, mean, rstd = ctx.saved_tensors
        dx, dw, db = norm_bwd(dy, xd, w, mean, rstd, ctx.rms, ctx.needs_input_grad[1],
                              ctx.bdtype is not None and ctx.needs_input_grad[2])
        return (dx, None if dw is None else dw.to(ctx.wdtype), None if db is None else db.to(ctx.bdtype),
                None, None)


def _check_shape(x, normalized_shape, weight):
    shape = tuple(normalized_shape) if isinstance(normalized_shape, (tuple, list, torch.Size)) \
        else (int(normalized_shape),)
    if len(shape) != 1:
        raise ValueError(f"the C norms normalize over the last dimension only, got normalized_shape={shape}")
    if x.dim() == 0 or x.shape[-1] != shape[0]:
        raise ValueError(f"input of shape {tuple(x.shape)} does not end in normalized_shape={shape}")
    if weight is not None and tuple(weight.shape) != shape:
        raise ValueError(f"weight of shape {tuple(weight.shape)}, expected {shape}")


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5):
    """F.layer_norm over the last dimension, by the C kernel."""
    _check_shape(x, normalized_shape, weight)
    return _apply("norm", x, weight, bias, eps, False)


def rms_norm(x, normalized_shape, weight=None, eps: float = 1e-6):
    """F.rms_norm over the last dimension (weight applied in float32), by the C kernel."""
    _check_shape(x, normalized_shape, weight)
    return _apply("norm", x, weight, None, eps, True)


# ---- elementwise ------------------------------------------------------------

def bias_gelu_fwd(x, bias, tanh):
    """(x, b) as the kernel read them, and y."""
    xd = _data(x, "bias_gelu input")
    n = xd.shape[-1] if xd.dim() else 1
    b = _param(bias, n, "bias_gelu bias")
    y = torch.empty_like(xd)
    kernels_for(xd.device).bias_gelu_forward(xd, b, tanh, y)
    return xd, b, y


def bias_gelu_bwd(dy, xd, b, tanh, want_db):
    """dx, and db in float32 (None unless wanted)."""
    dy = _data(dy, "bias_gelu grad").to(xd.dtype).contiguous()
    dx = torch.empty_like(xd)
    db = torch.empty(b.numel(), dtype=torch.float32, device=xd.device) if b is not None and want_db else None
    kernels_for(xd.device).bias_gelu_backward(dy, xd, b, tanh, dx, db)
    return dx, db


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, tanh):
        xd, b, y = bias_gelu_fwd(x, bias, tanh)
        ctx.save_for_backward(xd, b)
        ctx.tanh, ctx.bdtype = tanh, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        xd, b = ctx.saved_tensors
        dx, db = bias_gelu_bwd(dy, xd, b, ctx.tanh, ctx.needs_input_grad[1])
        return dx, None if db is None else db.to(ctx.bdtype), None


def bias_gelu(x, bias=None, approximate: str = "none"):
    """gelu(x + bias) (bias over the last dimension, optional); approximate as in F.gelu."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"bias_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return _apply("bias_gelu", x, bias, approximate == "tanh")


def swiglu_fwd(gate, up):
    """(gate, up) as the kernel read them, and y."""
    g, u = _data(gate, "swiglu gate"), _data(up, "swiglu up")
    _same(g, u, "swiglu(gate, up)")
    y = torch.empty_like(g)
    kernels_for(g.device).swiglu_forward(g, u, y)
    return g, u, y


def swiglu_bwd(dy, g, u):
    dy = _data(dy, "swiglu grad").to(g.dtype).contiguous()
    dg, du = torch.empty_like(g), torch.empty_like(u)
    kernels_for(g.device).swiglu_backward(dy, g, u, dg, du)
    return dg, du


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        g, u, y = swiglu_fwd(gate, up)
        ctx.save_for_backward(g, u)
        return y

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        return swiglu_bwd(dy, g, u)


def swiglu(gate, up):
    """silu(gate) * up."""
    return _apply("swiglu", gate, up)


def bias_dropout_add_fwd(x, bias, residual, p, seed):
    """y, and n (x's last dimension)."""
    xd, r = _data(x, "bias_dropout_add input"), _data(residual, "bias_dropout_add residual")
    _same(xd, r, "bias_dropout_add(x, residual)")
    n = xd.shape[-1] if xd.dim() else 1
    b = _param(bias, n, "bias_dropout_add bias")
    y = torch.empty_like(xd)
    kernels_for(xd.device).bias_dropout_add_forward(xd, b, r, p, seed, y)
    return y, n


def bias_dropout_add_bwd(dy, dtype, n, p, seed, want_db):
    """dx (in `dtype`), db in float32 (None unless wanted), and d residual (dy itself)."""
    dy = _data(dy, "bias_dropout_add grad").to(dtype).contiguous()
    dx = torch.empty_like(dy)
    db = torch.empty(n, dtype=torch.float32, device=dy.device) if want_db else None
    kernels_for(dy.device).bias_dropout_add_backward(dy, p, seed, dx, db)
    return dx, db, dy


class _BiasDropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, p, seed):
        y, n = bias_dropout_add_fwd(x, bias, residual, p, seed)
        ctx.p, ctx.seed, ctx.n = p, seed, n
        ctx.bdtype = None if bias is None else bias.dtype
        ctx.xdtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        dx, db, dy = bias_dropout_add_bwd(dy, ctx.xdtype, ctx.n, ctx.p, ctx.seed,
                                          ctx.bdtype is not None and ctx.needs_input_grad[1])
        return dx, None if db is None else db.to(ctx.bdtype), dy, None, None


def bias_dropout_add(x, bias, residual, p: float = 0.0, training: bool = True, seed: int | None = None):
    """residual + dropout(x + bias, p); the keep mask comes from `seed` (drawn from
    torch's generator when None), so the same seed gives the same mask."""
    p = float(p) if training else 0.0
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"bias_dropout_add: p must be in [0, 1], got {p}")
    return _apply("bias_dropout_add", x, bias, residual, p, _seed(seed, p))


# ---- embedding --------------------------------------------------------------

def check_embedding(weight, vocab_real):
    if weight.dim() != 2:
        raise ValueError(f"embedding weight must be 2-D, got shape {tuple(weight.shape)}")
    if not 0 <= vocab_real <= weight.shape[0]:
        raise ValueError(f"vocab_real={vocab_real} outside [0, {weight.shape[0]}] (rows of the weight)")


def embedding_fwd(ids, weight, vocab_start, vocab_real, vocab_size):
    """(ids as int64, out); vocab_size None or -1: ids unchecked."""
    w = _data(weight, "embedding weight")
    check_embedding(w, vocab_real)
    i = _ids(ids, "embedding ids")
    out = torch.empty(*i.shape, w.shape[1], dtype=w.dtype, device=w.device)
    # the id range is checked in the kernel's first pass (one min / max over the ids)
    kernels_for(w.device).embedding_forward(w, i, vocab_start, vocab_real, out, -1 if vocab_size is None else vocab_size)
    return i, out


def embedding_bwd(dout, i, vocab_start, vocab_real, padding_local, shape, dtype):
    """dW [shape] of the weight's dtype: each row the float32 sum (in token
    order) of the dout rows of the ids that hit it, rounded once; 0 for the
    rest (padding_local None or -1: no padding row).  On the CPU the kernel
    writes every row of a recycled buffer (shardformer.recycled: no fresh
    zeroed [V/p, h] tensor per step); CUDA sums into float32 zeros."""
    dout = _data(dout, "embedding grad").to(dtype).contiguous()
    pad = -1 if padding_local is None else padding_local
    if dout.device.type == "cpu":
        dw = recycled.empty(shape, dtype)
        _C.embedding_grad(dout, i, vocab_start, vocab_real, pad, dw)
        return dw
    dw = torch.zeros(shape, dtype=torch.float32, device=dout.device)
    kernels_for(dout.device).embedding_backward(dout, i, vocab_start, vocab_real, pad, dw)
    return dw.to(dtype)


class _VocabEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, vocab_start, vocab_real, padding_local, vocab_size):
        i, out = embedding_fwd(ids, weight, vocab_start, vocab_real, vocab_size)
        ctx.save_for_backward(i)
        ctx.args = (vocab_start, vocab_real, padding_local, tuple(weight.shape), weight.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        (i,) = ctx.saved_tensors
        return None, embedding_bwd(dout, i, *ctx.args), None, None, None, None


def vocab_embedding(ids, weight, vocab_start: int = 0, vocab_real: int | None = None,
                    padding_idx: int | None = None, vocab_size: int | None = None):
    """out[..., :] = weight[id - vocab_start] for ids in [vocab_start, vocab_start +
    vocab_real), zeros otherwise; padding_idx (a local row) gets no gradient.

    vocab_size: the whole (unpadded) vocabulary the ids index, of which this
    table holds a shard; an id outside [0, vocab_size) raises IndexError, as
    nn.Embedding does for the unsharded table (None: ids are not checked)."""
    real = weight.shape[0] if vocab_real is None else int(vocab_real)
    vocab = None if vocab_size is None else int(vocab_size)
    return _apply("vocab_embedding", ids, weight, int(vocab_start), real, padding_idx, vocab)


# ---- cross-entropy halves ---------------------------------------------------

def xent_stats(logits2d: torch.Tensor, labels1d: torch.Tensor, vocab_start: int, vocab_real: int,
               ignore_index: int, need_sumz: bool, vocab_size: int | None = None):
    """Per-row (max, sum exp(z - max), z_target or 0, sum z or None) over the real
    columns of a [rows, V_local] shard, read in one pass.  With vocab_size (the
    whole unpadded vocabulary), a label outside [0, vocab_size) other than
    ignore_index raises IndexError (checked by the kernel before any work)."""
    rows, dev = logits2d.shape[0], logits2d.device
    mx, se, tg = (torch.empty(rows, dtype=torch.float32, device=dev) for _ in range(3))
    sz = torch.empty(rows, dtype=torch.float32, device=dev) if need_sumz else None
    kernels_for(dev).xent_forward(logits2d, labels1d, vocab_start, vocab_real, ignore_index, mx, se, tg, sz,
                    -1 if vocab_size is None else int(vocab_size))
    return mx, se, tg, sz


def xent_grad(logits2d, labels1d, vocab_start, vocab_real, ignore_index, lse, scale, eps, vocab,
              out=None):
    """scale[r] * (softmax - (1 - eps) onehot - eps / vocab) over the real columns,
    0 on padding columns; written into `out` (may be logits2d itself)."""
    out = recycled.empty(logits2d.shape, logits2d.dtype, logits2d.device) if out is None else out
    kernels_for(logits2d.device).xent_backward(logits2d, labels1d, vocab_start, vocab_real, ignore_index,
                     lse.contiguous(), scale.contiguous(), float(eps), vocab, out)
    return out


# ---- attention --------------------------------------------------------------

def attention_fwd(q, k, v, bias, scale, causal, window, alibi, mask, p, seed, softcap):
    """(q, k, v, bias) as the kernel read them (bias as float32), out and lse
    (float32 [B, H, Sq]); q's head size must be > 0."""
    qd, kd, vd = (_data(q, "attention q", False), _data(k, "attention k", False),
                  _data(v, "attention v", False))
    out = torch.empty_like(qd)
    lse = torch.empty(qd.shape[:3], dtype=torch.float32)
    bd = None if bias is None else bias.detach().float().contiguous()
    _C.attention_forward(qd, kd, vd, out, lse, scale, causal, window, alibi, bd, mask, p, seed, softcap)
    return qd, kd, vd, bd, out, lse


def attention_bwd(dout, qd, kd, vd, out, lse, bd, alibi, mask, args, want_db):
    """dq, dk, dv, and ds (float32 [B, H, Sq, Sk], the logits' gradient: None
    unless want_db); args = (scale, causal, window, p, seed, softcap)."""
    scale, causal, window, p, seed, softcap = args
    dout = _data(dout, "attention grad", False).to(qd.dtype).contiguous()
    dq, dk, dv = torch.empty_like(qd), torch.empty_like(kd), torch.empty_like(vd)
    ds = torch.empty(*qd.shape[:3], kd.shape[2], dtype=torch.float32) if want_db else None
    _C.attention_backward(qd, kd, vd, out, dout, lse, dq, dk, dv, ds, scale, causal, window, alibi,
                          bd, mask, p, seed, softcap)
    return dq, dk, dv, ds


def bias_grad(ds, bias_shape, dtype):
    """The logits' gradient summed over the dimensions the bias broadcasts."""
    dims = [d for d in range(4) if bias_shape[d] == 1 and ds.shape[d] != 1]
    return (ds.sum(dim=dims, keepdim=True) if dims else ds).to(dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, scale, causal, window, alibi, mask, p, seed, softcap):
        ctx.empty = q.shape[-1] == 0
        if ctx.empty:
            # head size 0: the result is empty, as torch's scaled_dot_product_attention
            # gives it; the kernel would walk all of Sq x Sk for nothing
            ctx.shapes = (q.shape, k.shape, None if bias is None else bias.shape)
            ctx.dtypes = (q.dtype, None if bias is None else bias.dtype)
            return torch.empty_like(q, memory_format=torch.contiguous_format)
        qd, kd, vd, bd, out, lse = attention_fwd(q, k, v, bias, scale, causal, window, alibi, mask, p, seed,
                                                 softcap)
        ctx.save_for_backward(qd, kd, vd, out, lse, bd, alibi, mask)
        ctx.args = (scale, causal, window, p, seed, softcap)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        if ctx.empty:   # empty q, k, v gradients; no logit depends on the bias's value but linearly: 0
            (qs, ks, bs), (dt, bdt) = ctx.shapes, ctx.dtypes
            dbias = torch.zeros(bs, dtype=bdt) if bs is not None and ctx.needs_input_grad[3] else None
            return (torch.zeros(qs, dtype=dt), torch.zeros(ks, dtype=dt), torch.zeros(ks, dtype=dt), dbias,
                    None, None, None, None, None, None, None, None)
        qd, kd, vd, out, lse, bd, alibi, mask = ctx.saved_tensors
        want_db = bd is not None and ctx.needs_input_grad[3]
        dq, dk, dv, ds = attention_bwd(dout, qd, kd, vd, out.detach(), lse, bd, alibi, mask, ctx.args, want_db)
        dbias = bias_grad(ds, bd.shape, ctx.bias_dtype) if want_db else None
        return dq, dk, dv, dbias, None, None, None, None, None, None, None, None


def _as_4d(t: torch.Tensor, what: str, B, H, Sq, Sk) -> torch.Tensor:
    """t as a 4-D tensor broadcastable to [B, H, Sq, Sk]: 2-D [B, Sk] is a per-key
    mask, 3-D [H, Sq, Sk] a per-head one; anything else must be 4-D."""
    if t.dim() == 2:
        t = t[:, None, None, :]
    elif t.dim() == 3:
        t = t[None]
    if t.dim() != 4 or any(s not in (1, f) for s, f in zip(t.shape, (B, H, Sq, Sk))):
        raise ValueError(f"{what}: shape {tuple(t.shape)} does not broadcast to [B, H, Sq, Sk] = "
                         f"{[B, H, Sq, Sk]} (2-D [B, Sk], 3-D [H, Sq, Sk] or 4-D with dimensions 1 or full)")
    _check_device(t, what, False)
    return t


def visible_pairs(Sq: int, Sk: int, causal: bool, window: int, device=None) -> torch.Tensor:
    """bool [Sq, Sk]: the (query i, key j) pairs the attention kernel's causal
    flag and window leave visible, with off = Sk - Sq (bottom-right aligned):
    causal: j <= i + off; window W > 0: i + off - j < W, and without causal
    masking also j - (i + off) < W."""
    i = torch.arange(Sq, device=device)[:, None] + (Sk - Sq)
    j = torch.arange(Sk, device=device)[None, :]
    vis = torch.ones(Sq, Sk, dtype=torch.bool, device=device)
    if causal:
        vis &= j <= i
    if window:
        vis &= (i - j) < window
        if not causal:
            vis &= (j - i) < window
    return vis


def check_qkv(q, k, v, who: str, cuda: bool = False) -> None:
    """The checks every attention entry makes before any work: q [B, Hq, Sq, D]
    and k / v [B, Hkv, Sk, D] (k and v the same shape), CPU tensors (or CUDA:
    cuda=True, for ring attention's torch-ops blocks) of one float dtype the
    kernels take, on one device, Hq a multiple of Hkv."""
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        check_input(t, f"{who} {what}", cuda=cuda)  # device / dtype checks
        if t.device != q.device:
            raise ValueError(f"{who}: q is on {q.device} but {what} on {t.device}")
        if t.dim() != 4:
            raise ValueError(f"{who} {what}: expected 4-D [B, H, S, D], got shape {tuple(t.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"{who}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"{who}: k {tuple(k.shape)} and v {tuple(v.shape)} shapes differ")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"{who}: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head size")
    hq, hkv = q.shape[1], k.shape[1]
    if hq and (hkv == 0 or hq % hkv):
        raise ValueError(f"{who}: {hq} query heads are not a multiple of {hkv} key-value heads")


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, mask=None, bias=None,
              window: int | None = None, alibi_slopes=None, dropout_p: float = 0.0, training: bool = True,
              seed: int | None = None, softcap: float | None = None):
    """Attention by the C flash-style kernel (csrc/kernels/attention.h).

    q [B, Hq, Sq, D], k / v [B, Hkv, Sk, D] (Hq a multiple of Hkv: query head h
    reads key-value head h // (Hq // Hkv)), CPU, float32 / float16 / bfloat16
    (accumulated in float32).  Returns o [B, Hq, Sq, D]:

        x_ij = scale q_i . k_j,  c_ij = x_ij, or softcap tanh(x_ij / softcap) (soft-capping)
        s_ij = c_ij + bias_ij - slope_h |i + Sk - Sq - j|
        s_ij = -inf where mask_ij is False, or (causal) j > i + Sk - Sq, or
               (window W) i + Sk - Sq - j >= W  (and j - (i + Sk - Sq) >= W when not causal)
        o_i  = sum_j softmax_j(s_ij) z_ij / (1 - p) v_j

    Queries are the last Sq of the Sk positions (bottom-right causal alignment,
    as for decoding with a KV cache).  scale defaults to 1 / sqrt(D); head size
    D = 0 gives the empty result (and zero gradients), as torch's SDPA.  mask:
    bool, [B, Sk] (key padding), [H, Sq, Sk] or 4-D broadcastable to
    [B, Hq, Sq, Sk]; a floating-point mask is additive and joins the bias.
    bias: additive, same shapes, differentiable (its gradient is summed over
    the dimensions it broadcasts).  alibi_slopes: [Hq].  A row with every key
    masked gives 0.  Dropout p (training only): z_ij drawn from `seed` (from
    torch's generator when None) by a counter-based hash, redrawn in backward,
    never stored; ops.attention_dropout_mask shows the draws.  softcap: None / 0
    (none) or a finite cap > 0 on the scaled logits, before bias and masks
    (Gemma 2); backward multiplies by its derivative 1 - tanh^2(x_ij / softcap).
    """
    check_qkv(q, k, v, "attention")
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    if scale is None:   # 1 / sqrt(D); any value for D = 0, whose result is empty
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    scale = float(scale)
    window = 0 if window is None else int(window)
    if window < 0:
        raise ValueError(f"attention: window must be >= 0 (0 or None: no window), got {window}")
    p = float(dropout_p) if training else 0.0
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"attention: dropout_p must be in [0, 1], got {p}")
    seed = _seed(seed, p)
    if mask is not None:
        mask = _as_4d(mask, "attention mask", B, Hq, Sq, Sk)
        if mask.dtype.is_floating_point:
            bias = mask if bias is None else bias + mask
            mask = None
        elif mask.dtype in (torch.bool, torch.uint8):
            mask = mask.contiguous().view(torch.uint8)
        else:
            raise TypeError(f"attention mask: expected bool or a float (additive) mask, got {mask.dtype}")
    if bias is not None:
        bias = _as_4d(bias, "attention bias", B, Hq, Sq, Sk)
        if not bias.dtype.is_floating_point:
            raise TypeError(f"attention bias: expected a floating-point tensor, got {bias.dtype}")
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach().float().contiguous().reshape(-1)
        if alibi_slopes.numel() != Hq:
            raise ValueError(f"attention: alibi_slopes has {alibi_slopes.numel()} elements, expected {Hq} "
                             "(one per query head)")
    return _apply("attention", q, k, v, bias, scale, bool(causal), window, alibi_slopes, mask, p, seed,
                            check_softcap(softcap, "attention"))


def check_softcap(softcap, who: str) -> float:
    """softcap as the kernel takes it: 0.0 for None / 0 (no soft-capping), else
    a finite float > 0 (ValueError otherwise)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"{who}: softcap must be a float or None, got {type(softcap).__name__}")
    cap = float(softcap)
    if not (cap == 0.0 or (cap > 0.0 and math.isfinite(cap))):
        raise ValueError(f"{who}: softcap must be finite and > 0 (0 or None: no soft-capping), got {softcap!r}")
    return cap


def attention_dropout_mask(shape, p: float, seed: int, qpos=None, kpos=None, seq: int = 0) -> torch.Tensor:
    """The keep draws z [B, H, Sq, Sk] (bool) attention() uses for (p, seed);
    with qpos [Sq] / kpos [Sk] (int64 positions in a sequence of `seq` rows)
    the draws of those rows and columns of that sequence's mask, as the ring's
    blocks draw them."""
    keep = torch.empty(tuple(shape), dtype=torch.uint8)
    pos = [None if t is None else torch.as_tensor(t, dtype=torch.int64).contiguous() for t in (qpos, kpos)]
    _C.attention_dropout_keep(keep, float(p), int(seed), pos[0], pos[1], int(seq))
    return keep.bool()


def kernel_input(x: torch.Tensor) -> bool:
    """Whether the C (CPU) kernels take `x`: a CPU tensor of a float dtype they
    compute (FLOAT_DTYPES); attention falls back to torch otherwise."""
    return x.device.type == "cpu" and x.dtype in FLOAT_DTYPES


def fused_input(x: torch.Tensor) -> bool:
    """Whether the ops with CUDA kernels (norms, bias_gelu, swiglu,
    bias_dropout_add, vocab_embedding, cross-entropy) take `x`: a float tensor
    on the CPU, or on a CUDA device when shardformer._cuda was built (without
    it the fused modules fall back to torch on CUDA, as before) and the card is
    one the kernels are built for (CUDA_MIN_CAPABILITY and newer)."""
    if x.dtype not in FLOAT_DTYPES:
        return False
    return x.device.type == "cpu" or (x.device.type == "cuda" and cuda_built() and _cuda_arch_ok(x.device))


#: The oldest compute capability the CUDA kernels are built for (setup.py: sm_90 code and
#: compute_90 PTX, which newer cards compile); older cards keep torch's ops in the fused modules.
CUDA_MIN_CAPABILITY = (9, 0)
_arch_ok: dict = {}


def _cuda_arch_ok(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _arch_ok:
        _arch_ok[index] = torch.cuda.get_device_capability(index) >= CUDA_MIN_CAPABILITY
    return _arch_ok[index]


#: skinny_linear's paths (csrc/kernels/linear.h: sfk_linear_path), by name
SKINNY_PATHS = {"auto": 0, "portable": 1, "avx2": 2, "avx512_bf16": 3}
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def skinny_linear_path(dtype: torch.dtype) -> str:
    """The path skinny_linear takes for `dtype` on this CPU by default:
    "avx512_bf16" (bfloat16 where the CPU has AVX512-BF16), "avx2" or
    "portable" (see SHARDFORMER_SIMD in docs/kernels.md)."""
    code = _C.skinny_linear_path(_DTYPE_CODE[dtype])
    return next(name for name, c in SKINNY_PATHS.items() if c == code)


def _rows_in_place(weight: torch.Tensor) -> bool:
    """A 2-D weight whose rows the kernel reads where they are: unit stride
    within a row, rows at least a row apart (contiguous, or a column slice
    W_full[:, a:b] of a wider row-major tensor)."""
    if weight.dim() != 2 or weight.numel() == 0:
        return True
    n, k = weight.shape
    return (k == 1 or weight.stride(1) == 1) and (n == 1 or weight.stride(0) >= k)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  path: str = "auto") -> torch.Tensor:
    """y = x weight^T + bias for x [..., k], weight [n, k] (nn.Linear's layout),
    bias [n] or None: the C kernel for few rows (csrc/kernels/linear.h), which
    reads the weight once at the memory's rate; fp32 sums, x's dtype out.  A
    weight whose rows are strided (a column slice of a wider tensor, as a
    memory-mapped row-parallel shard is) is read in place, not copied
    (counted in CALLS["skinny_linear_strided"]).

    For inference: it records nothing for autograd, so it raises when a
    gradient would be needed (grad mode on and x or weight requiring one).
    Any number of rows is computed right; past a few (a decode step's), torch's
    blocked matmul is the faster one, which is why callers choose per call
    (shardformer.layer.linear: ShardConfig.enable_skinny_linear).  path: one of
    SKINNY_PATHS, "auto" the widest this CPU has (skinny_linear_path); a path
    the CPU lacks is refused (ValueError), for tests and benchmarks."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                    (bias is not None and bias.requires_grad)):
        raise RuntimeError("skinny_linear: a gradient is required (grad mode on and an input requires grad); "
                           "the kernel is for inference, use torch.nn.functional.linear")
    if x.dtype not in FLOAT_DTYPES or weight.dtype != x.dtype:
        raise TypeError(f"skinny_linear: x ({x.dtype}) and weight ({weight.dtype}) must be one of "
                        f"float32 / float16 / bfloat16, the same")
    if x.dim() == 0:
        raise ValueError("skinny_linear: x is a scalar; it needs a last dimension of in_features")
    if path not in SKINNY_PATHS:
        raise ValueError(f"skinny_linear: path={path!r} is not one of {sorted(SKINNY_PATHS)}")
    y = torch.empty(x.shape[:-1] + (weight.shape[0],), dtype=x.dtype, device=x.device)
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    strided = not weight.is_contiguous() and _rows_in_place(weight)
    w = weight.detach() if strided else weight.detach().contiguous()
    _C.skinny_linear(x.detach().contiguous(), w, b, y, SKINNY_PATHS[path])
    CALLS["skinny_linear"] += 1
    CALLS["skinny_linear_strided"] += strided
    return y


#: op name -> the autograd.Function that runs its kernel in eager mode
EAGER = {"norm": _Norm, "bias_gelu": _BiasGelu, "swiglu": _SwiGLU, "bias_dropout_add": _BiasDropoutAdd,
         "vocab_embedding": _VocabEmbedding, "attention": _Attention}

#: op name -> the traceable custom-op call with the same arguments as EAGER's
#: apply: registered by shardformer.compile_ops when it is imported (by the
#: package root, so before any model is compiled), which builds the custom
#: ops on this module's *_fwd / *_bwd functions.
TRACEABLE: dict = {}
