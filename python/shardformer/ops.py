"""Autograd functions over the C kernels in csrc/kernels/ (shardformer._C).

Every op takes CPU tensors of float32, float16 or bfloat16 of any leading
shape, computes in float32 and returns the input's dtype.  Non-contiguous
inputs are copied to contiguous ones first; anything else (another device,
an integer dtype, mismatched shapes) raises before any work.  Parameters
(norm weights, biases) are handed to C as float32 and their gradients are
cast back to the parameter's dtype.

    layer_norm(x, w, b, eps)      y = (x - mean) / sqrt(var + eps) * w + b   (last dim)
    rms_norm(x, w, eps)           y = x / sqrt(mean(x^2) + eps) * w
    bias_gelu(x, b, approximate)  y = gelu(x + b), erf ("none") or "tanh" form
    swiglu(gate, up)              y = silu(gate) * up
    bias_dropout_add(x, b, r, p)  y = r + dropout_p(x + b); the mask is redrawn
                                  in backward from a seed, never stored
    vocab_embedding(ids, W, ...)  rows of W for ids in [start, start + real), 0 elsewhere
    xent_stats / xent_grad        the local halves of vocabulary-parallel cross-entropy
                                  (shardformer.layer.loss combines them across ranks)
"""
from __future__ import annotations

import math

import torch

from . import _C

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def set_num_threads(n: int) -> None:
    """Threads the kernels split rows over, for inputs large enough to pay."""
    _C.kernel_set_num_threads(int(n))


def get_num_threads() -> int:
    return _C.kernel_get_num_threads()


def _data(t: torch.Tensor, what: str) -> torch.Tensor:
    """`t` ready for C: detached, contiguous, CPU, a float dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{what}: the C kernels run on CPU tensors, got device {t.device}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{what}: dtype must be float32, float16 or bfloat16, got {t.dtype}")
    return t.detach().contiguous()


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
    if t.device.type != "cpu":
        raise ValueError(f"{what}: the C kernels run on CPU tensors, got device {t.device}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{what}: expected integer ids, got {t.dtype}")
    return t.detach().to(torch.int64).contiguous()


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"{what}: shapes/dtypes differ: {tuple(a.shape)} {a.dtype} vs "
                         f"{tuple(b.shape)} {b.dtype}")


# ---- normalization ----------------------------------------------------------

class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        xd = _data(x, "rms_norm input" if rms else "layer_norm input")
        n = xd.shape[-1] if xd.dim() else 1
        w, b = _param(weight, n, "norm weight"), None if rms else _param(bias, n, "norm bias")
        rows = math.prod(xd.shape[:-1])
        y = torch.empty_like(xd)
        mean = None if rms else torch.empty(rows, dtype=torch.float32)
        rstd = torch.empty(rows, dtype=torch.float32)
        _C.norm_forward(rms, xd, w, b, float(eps), y, mean, rstd)
        ctx.save_for_backward(xd, w, mean, rstd)
        ctx.rms = rms
        ctx.wdtype = None if weight is None else weight.dtype
        ctx.bdtype = None if bias is None or rms else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        xd, w, mean, rstd = ctx.saved_tensors
        dy = _data(dy, "norm grad").to(xd.dtype).contiguous()
        dx = torch.empty_like(xd)
        n = xd.shape[-1] if xd.dim() else 1
        dw = torch.empty(n, dtype=torch.float32) if w is not None and ctx.needs_input_grad[1] else None
        db = torch.empty(n, dtype=torch.float32) if ctx.bdtype is not None and ctx.needs_input_grad[2] \
            else None
        _C.norm_backward(ctx.rms, dy, xd, w, mean, rstd, dx, dw, db)
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
    return _Norm.apply(x, weight, bias, eps, False)


def rms_norm(x, normalized_shape, weight=None, eps: float = 1e-6):
    """F.rms_norm over the last dimension (weight applied in float32), by the C kernel."""
    _check_shape(x, normalized_shape, weight)
    return _Norm.apply(x, weight, None, eps, True)


# ---- elementwise ------------------------------------------------------------

class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, tanh):
        xd = _data(x, "bias_gelu input")
        n = xd.shape[-1] if xd.dim() else 1
        b = _param(bias, n, "bias_gelu bias")
        y = torch.empty_like(xd)
        _C.bias_gelu_forward(xd, b, tanh, y)
        ctx.save_for_backward(xd, b)
        ctx.tanh, ctx.bdtype = tanh, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        xd, b = ctx.saved_tensors
        dy = _data(dy, "bias_gelu grad").to(xd.dtype).contiguous()
        dx = torch.empty_like(xd)
        db = torch.empty(b.numel(), dtype=torch.float32) if b is not None and ctx.needs_input_grad[1] \
            else None
        _C.bias_gelu_backward(dy, xd, b, ctx.tanh, dx, db)
        return dx, None if db is None else db.to(ctx.bdtype), None


def bias_gelu(x, bias=None, approximate: str = "none"):
    """gelu(x + bias) (bias over the last dimension, optional); approximate as in F.gelu."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"bias_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return _BiasGelu.apply(x, bias, approximate == "tanh")


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        g, u = _data(gate, "swiglu gate"), _data(up, "swiglu up")
        _same(g, u, "swiglu(gate, up)")
        y = torch.empty_like(g)
        _C.swiglu_forward(g, u, y)
        ctx.save_for_backward(g, u)
        return y

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        dy = _data(dy, "swiglu grad").to(g.dtype).contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        _C.swiglu_backward(dy, g, u, dg, du)
        return dg, du


def swiglu(gate, up):
    """silu(gate) * up."""
    return _SwiGLU.apply(gate, up)


class _BiasDropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, p, seed):
        xd, r = _data(x, "bias_dropout_add input"), _data(residual, "bias_dropout_add residual")
        _same(xd, r, "bias_dropout_add(x, residual)")
        n = xd.shape[-1] if xd.dim() else 1
        b = _param(bias, n, "bias_dropout_add bias")
        y = torch.empty_like(xd)
        _C.bias_dropout_add_forward(xd, b, r, p, seed, y)
        ctx.p, ctx.seed, ctx.n = p, seed, n
        ctx.bdtype = None if bias is None else bias.dtype
        ctx.xdtype = xd.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        dy = _data(dy, "bias_dropout_add grad").to(ctx.xdtype).contiguous()
        dx = torch.empty_like(dy)
        db = torch.empty(ctx.n, dtype=torch.float32) if ctx.bdtype is not None and ctx.needs_input_grad[1] \
            else None
        _C.bias_dropout_add_backward(dy, ctx.p, ctx.seed, dx, db)
        return dx, None if db is None else db.to(ctx.bdtype), dy, None, None


def bias_dropout_add(x, bias, residual, p: float = 0.0, training: bool = True, seed: int | None = None):
    """residual + dropout(x + bias, p); the keep mask comes from `seed` (drawn from
    torch's generator when None), so the same seed gives the same mask."""
    p = float(p) if training else 0.0
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"bias_dropout_add: p must be in [0, 1], got {p}")
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item()) if p > 0 else 0
    return _BiasDropoutAdd.apply(x, bias, residual, p, int(seed))


# ---- embedding --------------------------------------------------------------

class _VocabEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, vocab_start, vocab_real, padding_local):
        w = _data(weight, "embedding weight")
        if w.dim() != 2:
            raise ValueError(f"embedding weight must be 2-D, got shape {tuple(w.shape)}")
        if not 0 <= vocab_real <= w.shape[0]:
            raise ValueError(f"vocab_real={vocab_real} outside [0, {w.shape[0]}] (rows of the weight)")
        i = _ids(ids, "embedding ids")
        out = torch.empty(*i.shape, w.shape[1], dtype=w.dtype)
        _C.embedding_forward(w, i, vocab_start, vocab_real, out)
        ctx.save_for_backward(i)
        ctx.args = (vocab_start, vocab_real, padding_local, tuple(w.shape), w.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        (i,) = ctx.saved_tensors
        vocab_start, vocab_real, padding_local, shape, dtype = ctx.args
        dw = torch.zeros(shape, dtype=torch.float32)
        dout = _data(dout, "embedding grad").to(dtype).contiguous()
        _C.embedding_backward(dout, i, vocab_start, vocab_real,
                              -1 if padding_local is None else padding_local, dw)
        return None, dw.to(dtype), None, None, None


def vocab_embedding(ids, weight, vocab_start: int = 0, vocab_real: int | None = None,
                    padding_idx: int | None = None):
    """out[..., :] = weight[id - vocab_start] for ids in [vocab_start, vocab_start +
    vocab_real), zeros otherwise; padding_idx (a local row) gets no gradient."""
    real = weight.shape[0] if vocab_real is None else int(vocab_real)
    return _VocabEmbedding.apply(ids, weight, int(vocab_start), real, padding_idx)


# ---- cross-entropy halves ---------------------------------------------------

def xent_stats(logits2d: torch.Tensor, labels1d: torch.Tensor, vocab_start: int, vocab_real: int,
               ignore_index: int, need_sumz: bool):
    """Per-row (max, sum exp(z - max), z_target or 0, sum z or None) over the real
    columns of a [rows, V_local] shard, read in one pass."""
    rows = logits2d.shape[0]
    mx, se, tg = (torch.empty(rows, dtype=torch.float32) for _ in range(3))
    sz = torch.empty(rows, dtype=torch.float32) if need_sumz else None
    _C.xent_forward(logits2d, labels1d, vocab_start, vocab_real, ignore_index, mx, se, tg, sz)
    return mx, se, tg, sz


def xent_grad(logits2d, labels1d, vocab_start, vocab_real, ignore_index, lse, scale, eps, vocab,
              out=None):
    """scale[r] * (softmax - (1 - eps) onehot - eps / vocab) over the real columns,
    0 on padding columns; written into `out` (may be logits2d itself)."""
    out = torch.empty_like(logits2d) if out is None else out
    _C.xent_backward(logits2d, labels1d, vocab_start, vocab_real, ignore_index,
                     lse.contiguous(), scale.contiguous(), float(eps), vocab, out)
    return out


# ---- fused module forwards (method replacements under enable_jit_fused) -----

#: HF activation names -> bias_gelu's `approximate`.
GELU_APPROX = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": None}


def gelu_kind(act_name) -> str | None:
    """'none' / 'tanh' when `act_name` is an HF GeLU the C kernel computes exactly, else None."""
    return GELU_APPROX.get(act_name) if isinstance(act_name, str) else None


def _kernel_input(x) -> bool:
    return x.device.type == "cpu" and x.dtype in FLOAT_DTYPES


def llama_mlp_forward(self, x):
    """LlamaMLP.forward (down(silu(gate(x)) * up(x))) with silu * up in one C kernel."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    if not _kernel_input(gate):
        return self.down_proj(self.act_fn(gate) * up)
    return self.down_proj(swiglu(gate, up))


def gpt2_mlp_forward(approximate: str):
    """GPT2MLP.forward (dropout(c_proj(gelu(c_fc(x))))) with the GeLU (`approximate`
    as in F.gelu) by the C kernel."""
    def forward(self, hidden_states):
        h = self.c_fc(hidden_states)
        h = bias_gelu(h, None, approximate) if _kernel_input(h) else self.act(h)
        return self.dropout(self.c_proj(h))
    return forward


def bert_intermediate_forward(approximate: str):
    """BertIntermediate.forward (gelu(dense(x))) with the GeLU by the C kernel."""
    def forward(self, hidden_states):
        h = self.dense(hidden_states)
        return bias_gelu(h, None, approximate) if _kernel_input(h) else self.intermediate_act_fn(h)
    return forward
