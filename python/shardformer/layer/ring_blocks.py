"""One block of ring attention in torch ops, on any device.

The ring (ring_attention.py) computes attention block by block: one query
block q [B, Hq, Sq, D] against one key/value block k, v [B, Hkv, Sk, D].
On CPU each block is a call of the C kernel (csrc/kernels/attention.h);
on other devices (CUDA) the same block contract is computed here with
torch's ops, in float32, so that no tensor of the ring leaves its device.

Forward, with off = Sk - Sq and query head h reading key head h // (Hq / Hkv):

    x_ij = scale q_i . k_j,   c_ij = x_ij, or (cap > 0) cap tanh(x_ij / cap)
    s_ij = c_ij + bias_ij,    -inf where mask_ij == 0, or (causal) j > i + off,
           or (window W > 0) i + off - j >= W, or (W, not causal) j - (i + off) >= W
    lse_i = log sum_j exp(s_ij)          (+inf when every key is masked)
    o_i   = sum_j exp(s_ij - lse_i) z_ij / (1 - dropout) v_j   (0 when all masked)

z_ij are the kernel's own keep draws for the block's global positions
(ops.attention_dropout_mask, a small uint8 mask built once per block on the
CPU and moved to the device), so a forced torch block draws what the kernel
draws.

Backward, given the FINAL (o, lse) of the whole row (the ring's contract:
p_ij = exp(s_ij - lse_i) are then the global probabilities):

    delta_i = dout_i . o_i,   dp_ij = z_ij / (1 - dropout) dout_i . v_j
    ds_ij = p_ij (dp_ij - delta_i),  dx_ij = ds_ij (1 - tanh^2(x_ij / cap)) with a cap
    dq_i = scale sum_j dx_ij k_j,  dk_j = scale sum_{h in group, i} dx_ij q_i,
    dv_j = sum_{h in group, i} p_ij z_ij / (1 - dropout) dout_i,  dbias_ij = ds_ij

ALiBi slopes are not part of the ring's block calls and are not taken here.
"""
from __future__ import annotations

import math

import torch

from .. import ops

__all__ = ["block_forward", "block_backward"]


def _visible(Sq: int, Sk: int, causal: bool, window: int, mask, device) -> torch.Tensor | None:
    """bool [.., Sq, Sk]: the pairs not masked by causality, the window and
    `mask` (uint8, nonzero = attend, broadcastable to [B, H, Sq, Sk]); None: all."""
    vis = ops.visible_pairs(Sq, Sk, causal, window, device) if causal or window else None
    if mask is not None:
        m = mask.to(device) != 0
        vis = m if vis is None else (m & vis)
    return vis


def _keep(shape, drop, pos, device):
    """The dropout factor z_ij / (1 - p) [B, H, Sq, Sk] (float32), or None."""
    if drop is None or drop[0] == 0.0:
        return None
    p, seed = drop
    qpos, kpos, seq = pos
    z = ops.attention_dropout_mask(shape, p, seed, qpos, kpos, seq).to(device)
    return z.float() * (0.0 if p >= 1.0 else 1.0 / (1.0 - p))


def _scores(qb, kb, scale, causal, window, bias, mask, softcap):
    """(s, tanh(x / cap) or None, heads per key head): the masked logits, float32."""
    B, Hq, Sq, _ = qb.shape
    g = Hq // kb.shape[1]
    k = kb.float().repeat_interleave(g, dim=1) if g > 1 else kb.float()
    x = torch.matmul(qb.float(), k.transpose(-1, -2)) * scale
    t = None
    if softcap:
        t = torch.tanh(x / softcap)
        x = t * softcap
    if bias is not None:
        x = x + bias.to(x.device, torch.float32)
    vis = _visible(Sq, kb.shape[2], causal, window, mask, x.device)
    if vis is not None:
        x = x.masked_fill(~vis, -math.inf)
    return x, t, g


def _expand(t: torch.Tensor, g: int) -> torch.Tensor:
    return t.float().repeat_interleave(g, dim=1) if g > 1 else t.float()


def _fold(t: torch.Tensor, g: int) -> torch.Tensor:
    """[B, Hq, S, D] -> [B, Hkv, S, D]: the sum over each key head's query heads."""
    if g == 1:
        return t
    B, Hq, S, D = t.shape
    return t.view(B, Hq // g, g, S, D).sum(dim=2)


def block_forward(qb, kb, vb, scale, causal, window, bias, mask, drop, softcap, pos):
    """(o [B, Hq, Sq, D] in q's dtype, lse [B, Hq, Sq] float32): the kernel's
    forward of one block (module docstring).  drop: None or (p, seed); pos:
    (qpos, kpos, drop_seq) of the dropout draws."""
    s, _t, g = _scores(qb, kb, scale, causal, window, bias, mask, softcap)
    lse = torch.logsumexp(s, dim=-1)
    empty = lse == -math.inf
    p = torch.exp(s - lse.masked_fill(empty, 0.0).unsqueeze(-1))
    keep = _keep(s.shape, drop, pos, s.device)
    if keep is not None:
        p = p * keep
    o = torch.matmul(p, _expand(vb, g))
    return o.to(qb.dtype), lse.masked_fill(empty, math.inf)


def block_backward(qb, kb, vb, ob, dout, lse, scale, causal, window, bias, mask, drop, softcap, pos,
                   want_ds: bool = False):
    """(dq, dk, dv in the inputs' dtypes, ds float32 [B, Hq, Sq, Sk] or None):
    the kernel's backward of one block with the row's final (o, lse)."""
    s, t, g = _scores(qb, kb, scale, causal, window, bias, mask, softcap)
    p = torch.exp(s - lse.float().unsqueeze(-1))          # lse = +inf (all masked): p = 0
    keep = _keep(s.shape, drop, pos, s.device)
    pk = p if keep is None else p * keep
    do = dout.float()
    dv = _fold(torch.matmul(pk.transpose(-1, -2), do), g)
    dp = torch.matmul(do, _expand(vb, g).transpose(-1, -2))
    if keep is not None:
        dp = dp * keep
    delta = (do * ob.float()).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    dx = ds if t is None else ds * (1.0 - t * t)
    dq = torch.matmul(dx, _expand(kb, g)) * scale
    dk = _fold(torch.matmul(dx.transpose(-1, -2), qb.float()), g) * scale
    return dq.to(qb.dtype), dk.to(kb.dtype), dv.to(vb.dtype), (ds if want_ds else None)
