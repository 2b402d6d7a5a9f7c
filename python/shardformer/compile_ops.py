"""The C kernels of ops.py as torch.library custom ops, for torch.compile.

Eager code calls the kernels through ops.py's autograd.Functions, which hand
tensors to shardformer._C (a C extension dynamo cannot trace: one graph break
per call).  While torch.compile traces (`torch.compiler.is_compiling()`),
ops.py calls the entries of TRACEABLE instead: each kernel is a custom op
`shardformer::<name>` (forward) with a twin `shardformer::<name>_backward`,

  * the real implementation: the same *_fwd / *_bwd function of ops.py the
    eager autograd.Function runs (same checks, same kernel, same threads);
  * a fake implementation: the outputs' shapes and dtypes from the inputs',
    so dynamo and AOTAutograd trace through without running the kernel;
  * register_autograd: the backward op, saving what the eager Function saves.

Optional outputs (a gradient nobody asked for, the mean of RMSNorm) are empty
tensors of 0 elements (custom ops return tensors only).  Dropout seeds are
1-element int64 tensors (drawn in the graph by torch.randint), read by the
real implementation, so the graph needs no .item().

    op                   forward                         backward op returns
    norm                 y, mean ([0] for rms), rstd      dx, dw, db (float32)
    bias_gelu            gelu(x + b)                      dx, db (float32)
    swiglu               silu(gate) * up                  dgate, dup
    bias_dropout_add     r + dropout_p(x + b)             dx, db (float32)
    vocab_embedding      rows of W (0 outside the shard)  dW (float32)
    attention            out, lse (float32 [B, H, Sq])    dq, dk, dv, ds (float32)
"""
import math
from typing import Optional

import torch
from torch import Tensor

from . import ops

_NS = "shardformer"
_C_FMT = torch.contiguous_format
_NONE = (0,)  # shape of the empty tensor standing for None


def _or_empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    return like.new_empty(_NONE, dtype=torch.float32) if t is None else t


def _maybe(t: Tensor, wanted: bool, dtype) -> Optional[Tensor]:
    return t.to(dtype) if wanted else None


def _rows(x: Tensor):
    return math.prod(x.shape[:-1])


def _features(x: Tensor):
    return x.shape[-1] if x.dim() else 1


# ---- norms ------------------------------------------------------------------------------

@torch.library.custom_op(f"{_NS}::norm", mutates_args=())
def norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
         rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm (rms=False) or RMSNorm over the last dimension: y, mean, rstd."""
    _, _, y, mean, rstd = ops.norm_fwd(x, weight, bias, eps, rms)
    return y, _or_empty(mean, rstd), rstd


@norm.register_fake
def _(x, weight, bias, eps, rms):
    rows = _rows(x)
    return (torch.empty_like(x, memory_format=_C_FMT), x.new_empty((0 if rms else rows,), dtype=torch.float32),
            x.new_empty((rows,), dtype=torch.float32))


@torch.library.custom_op(f"{_NS}::norm_backward", mutates_args=())
def norm_backward(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor, rms: bool,
                  want_dw: bool, want_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    xd = ops._data(x, "norm input")
    w = ops._param(weight, _features(xd), "norm weight")
    dx, dw, db = ops.norm_bwd(dy, xd, w, None if rms else mean, rstd, rms, want_dw, want_db)
    return dx, _or_empty(dw, rstd), _or_empty(db, rstd)


@norm_backward.register_fake
def _(dy, x, weight, mean, rstd, rms, want_dw, want_db):
    n = _features(x)
    return (torch.empty_like(x, memory_format=_C_FMT),
            x.new_empty((n if want_dw and weight is not None else 0,), dtype=torch.float32),
            x.new_empty((n if want_db else 0,), dtype=torch.float32))


def _norm_setup(ctx, inputs, output):
    x, weight, bias, _, rms = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.rms = rms
    ctx.dtypes = (None if weight is None else weight.dtype, None if bias is None or rms else bias.dtype)


def _norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    wdtype, bdtype = ctx.dtypes
    want_dw = wdtype is not None and ctx.needs_input_grad[1]
    want_db = bdtype is not None and ctx.needs_input_grad[2]
    dx, dw, db = norm_backward(dy, x, weight, mean, rstd, ctx.rms, want_dw, want_db)
    return dx, _maybe(dw, want_dw, wdtype), _maybe(db, want_db, bdtype), None, None


norm.register_autograd(_norm_backward, setup_context=_norm_setup)


def _norm_apply(x, weight, bias, eps, rms):
    return norm(x, weight, bias, float(eps), bool(rms))[0]


# ---- bias + GeLU ------------------------------------------------------------------------

@torch.library.custom_op(f"{_NS}::bias_gelu", mutates_args=())
def bias_gelu(x: Tensor, bias: Optional[Tensor], tanh: bool) -> Tensor:
    return ops.bias_gelu_fwd(x, bias, tanh)[2]


@bias_gelu.register_fake
def _(x, bias, tanh):
    return torch.empty_like(x, memory_format=_C_FMT)


@torch.library.custom_op(f"{_NS}::bias_gelu_backward", mutates_args=())
def bias_gelu_backward(dy: Tensor, x: Tensor, bias: Optional[Tensor], tanh: bool,
                       want_db: bool) -> tuple[Tensor, Tensor]:
    xd = ops._data(x, "bias_gelu input")
    dx, db = ops.bias_gelu_bwd(dy, xd, ops._param(bias, _features(xd), "bias_gelu bias"), tanh, want_db)
    return dx, _or_empty(db, dx)


@bias_gelu_backward.register_fake
def _(dy, x, bias, tanh, want_db):
    n = _features(x) if want_db and bias is not None else 0
    return torch.empty_like(x, memory_format=_C_FMT), x.new_empty((n,), dtype=torch.float32)


def _bias_gelu_setup(ctx, inputs, output):
    x, bias, tanh = inputs
    ctx.save_for_backward(x, bias)
    ctx.tanh, ctx.bdtype = tanh, None if bias is None else bias.dtype


def _bias_gelu_backward(ctx, dy):
    x, bias = ctx.saved_tensors
    want_db = ctx.bdtype is not None and ctx.needs_input_grad[1]
    dx, db = bias_gelu_backward(dy, x, bias, ctx.tanh, want_db)
    return dx, _maybe(db, want_db, ctx.bdtype), None


bias_gelu.register_autograd(_bias_gelu_backward, setup_context=_bias_gelu_setup)


def _bias_gelu_apply(x, bias, tanh):
    return bias_gelu(x, bias, bool(tanh))


# ---- SwiGLU -----------------------------------------------------------------------------

@torch.library.custom_op(f"{_NS}::swiglu", mutates_args=())
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return ops.swiglu_fwd(gate, up)[2]


@swiglu.register_fake
def _(gate, up):
    return torch.empty_like(gate, memory_format=_C_FMT)


@torch.library.custom_op(f"{_NS}::swiglu_backward", mutates_args=())
def swiglu_backward(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return ops.swiglu_bwd(dy, ops._data(gate, "swiglu gate"), ops._data(up, "swiglu up"))


@swiglu_backward.register_fake
def _(dy, gate, up):
    return torch.empty_like(gate, memory_format=_C_FMT), torch.empty_like(up, memory_format=_C_FMT)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy):
    return swiglu_backward(dy, *ctx.saved_tensors)


swiglu.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


# ---- bias + dropout + residual ------------------------------------------------------------

@torch.library.custom_op(f"{_NS}::bias_dropout_add", mutates_args=())
def bias_dropout_add(x: Tensor, bias: Optional[Tensor], residual: Tensor, p: float, seed: Tensor) -> Tensor:
    return ops.bias_dropout_add_fwd(x, bias, residual, p, int(seed.item()))[0]


@bias_dropout_add.register_fake
def _(x, bias, residual, p, seed):
    return torch.empty_like(x, memory_format=_C_FMT)


@torch.library.custom_op(f"{_NS}::bias_dropout_add_backward", mutates_args=())
def bias_dropout_add_backward(dy: Tensor, n: int, p: float, seed: Tensor, want_db: bool) -> tuple[Tensor, Tensor]:
    dx, db, _ = ops.bias_dropout_add_bwd(dy, dy.dtype, n, p, int(seed.item()), want_db)
    return dx, _or_empty(db, dx)


@bias_dropout_add_backward.register_fake
def _(dy, n, p, seed, want_db):
    return torch.empty_like(dy, memory_format=_C_FMT), dy.new_empty((n if want_db else 0,), dtype=torch.float32)


def _bias_dropout_add_setup(ctx, inputs, output):
    x, bias, _, p, seed = inputs
    ctx.save_for_backward(seed)
    ctx.p, ctx.n, ctx.xdtype = p, _features(x), x.dtype
    ctx.bdtype = None if bias is None else bias.dtype


def _bias_dropout_add_backward(ctx, dy):
    (seed,) = ctx.saved_tensors
    want_db = ctx.bdtype is not None and ctx.needs_input_grad[1]
    dy = dy.to(ctx.xdtype)
    dx, db = bias_dropout_add_backward(dy, ctx.n, ctx.p, seed, want_db)
    return dx, _maybe(db, want_db, ctx.bdtype), dy, None, None


bias_dropout_add.register_autograd(_bias_dropout_add_backward, setup_context=_bias_dropout_add_setup)


def _bias_dropout_add_apply(x, bias, residual, p, seed):
    return bias_dropout_add(x, bias, residual, float(p), seed)


# ---- vocabulary-sharded embedding ----------------------------------------------------------

@torch.library.custom_op(f"{_NS}::vocab_embedding", mutates_args=())
def vocab_embedding(ids: Tensor, weight: Tensor, vocab_start: int, vocab_real: int, padding_local: int,
                    vocab_size: int) -> Tensor:
    """Rows of the shard for ids in [vocab_start, vocab_start + vocab_real), 0 elsewhere
    (padding_local: the local padding row, -1 none; read by backward only)."""
    return ops.embedding_fwd(ids, weight, vocab_start, vocab_real, vocab_size)[1]


@vocab_embedding.register_fake
def _(ids, weight, vocab_start, vocab_real, padding_local, vocab_size):
    return weight.new_empty(tuple(ids.shape) + (weight.shape[1],))


@torch.library.custom_op(f"{_NS}::vocab_embedding_backward", mutates_args=())
def vocab_embedding_backward(dout: Tensor, ids: Tensor, rows: int, vocab_start: int, vocab_real: int,
                             padding_local: int) -> Tensor:
    i = ops._ids(ids, "embedding ids")
    return ops.embedding_bwd(dout, i, vocab_start, vocab_real, padding_local, (rows, dout.shape[-1]), dout.dtype)


@vocab_embedding_backward.register_fake
def _(dout, ids, rows, vocab_start, vocab_real, padding_local):
    return dout.new_empty((rows, dout.shape[-1]))


def _vocab_embedding_setup(ctx, inputs, output):
    ids, weight, vocab_start, vocab_real, padding_local, _ = inputs
    ctx.save_for_backward(ids)
    ctx.args = (weight.shape[0], vocab_start, vocab_real, padding_local)
    ctx.wdtype = weight.dtype


def _vocab_embedding_backward(ctx, dout):
    (ids,) = ctx.saved_tensors
    dw = vocab_embedding_backward(dout.to(ctx.wdtype), ids, *ctx.args)
    return None, dw, None, None, None, None


vocab_embedding.register_autograd(_vocab_embedding_backward, setup_context=_vocab_embedding_setup)


def _vocab_embedding_apply(ids, weight, vocab_start, vocab_real, padding_local, vocab_size):
    ops.check_embedding(weight, vocab_real)
    return vocab_embedding(ids, weight, vocab_start, vocab_real, -1 if padding_local is None else padding_local,
                           -1 if vocab_size is None else vocab_size)


# ---- attention ----------------------------------------------------------------------------

@torch.library.custom_op(f"{_NS}::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], scale: float, causal: bool, window: int,
              alibi: Optional[Tensor], mask: Optional[Tensor], p: float, seed: Tensor,
              softcap: float) -> tuple[Tensor, Tensor]:
    """ops.attention's kernel: out, and lse (float32 [B, H, Sq]; zeros for head size 0)."""
    if q.shape[-1] == 0:  # empty result, as the eager Function gives it
        return torch.empty_like(q, memory_format=_C_FMT), q.new_zeros(q.shape[:3], dtype=torch.float32)
    _, _, _, _, out, lse = ops.attention_fwd(q, k, v, bias, scale, causal, window, alibi, mask, p,
                                             int(seed.item()), softcap)
    return out, lse


@attention.register_fake
def _(q, k, v, bias, scale, causal, window, alibi, mask, p, seed, softcap):
    return torch.empty_like(q, memory_format=_C_FMT), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op(f"{_NS}::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       bias: Optional[Tensor], alibi: Optional[Tensor], mask: Optional[Tensor], scale: float,
                       causal: bool, window: int, p: float, seed: Tensor, softcap: float,
                       want_db: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, and ds (the logits' gradient, [0] unless want_db)."""
    if q.shape[-1] == 0:
        ds = q.new_zeros((*q.shape[:3], k.shape[2]) if want_db else _NONE, dtype=torch.float32)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), ds
    qd, kd, vd = (ops._data(t, f"attention {n}") for t, n in ((q, "q"), (k, "k"), (v, "v")))
    bd = None if bias is None else bias.detach().float().contiguous()
    args = (scale, causal, window, p, int(seed.item()), softcap)
    dq, dk, dv, ds = ops.attention_bwd(dout, qd, kd, vd, out.contiguous(), lse, bd, alibi, mask, args, want_db)
    return dq, dk, dv, _or_empty(ds, lse)


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, bias, alibi, mask, scale, causal, window, p, seed, softcap, want_db):
    ds = (*q.shape[:3], k.shape[2]) if want_db else _NONE
    return (torch.empty_like(q, memory_format=_C_FMT), torch.empty_like(k, memory_format=_C_FMT),
            torch.empty_like(v, memory_format=_C_FMT), q.new_empty(ds, dtype=torch.float32))


def _attention_setup(ctx, inputs, output):
    q, k, v, bias, scale, causal, window, alibi, mask, p, seed, softcap = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, bias, alibi, mask, seed)
    ctx.args = (scale, causal, window, p, softcap)
    ctx.bdtype = None if bias is None else bias.dtype


def _attention_backward(ctx, dout, _dlse):
    q, k, v, out, lse, bias, alibi, mask, seed = ctx.saved_tensors
    scale, causal, window, p, softcap = ctx.args
    want_db = bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, ds = attention_backward(dout, q, k, v, out, lse, bias, alibi, mask, scale, causal, window, p,
                                        seed, softcap, want_db)
    dbias = ops.bias_grad(ds, bias.shape, ctx.bdtype) if want_db else None
    return dq, dk, dv, dbias, None, None, None, None, None, None, None, None


attention.register_autograd(_attention_backward, setup_context=_attention_setup)


def _attention_apply(q, k, v, bias, scale, causal, window, alibi, mask, p, seed, softcap):
    return attention(q, k, v, bias, float(scale), bool(causal), int(window), alibi, mask, float(p), seed,
                     float(softcap))[0]


#: op name (ops.EAGER) -> the traceable call with the same arguments as the
#: eager autograd.Function's apply (ops._apply picks it from ops.TRACEABLE
#: while torch.compile traces)
TRACEABLE = {
    "norm": _norm_apply,
    "bias_gelu": _bias_gelu_apply,
    "swiglu": swiglu,
    "bias_dropout_add": _bias_dropout_add_apply,
    "vocab_embedding": _vocab_embedding_apply,
    "attention": _attention_apply,
}
ops.TRACEABLE.update(TRACEABLE)
