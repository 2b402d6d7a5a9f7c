"""BLOOM: the BLOOM-shaped decoder of policies/shapes.py (FusedQKVShape):
attention heads and MLP features split; vocabulary-parallel embedding and LM
head (tied when HF tied it); ALiBi slopes follow their heads.

    h.*.self_attention.query_key_value   Linear1D_Col, per head: its rows are
                                         interleaved [q_h k_h v_h] per head, so a
                                         head is one block of 3 * head_dim rows
    h.*.self_attention.dense             Linear1D_Row
    h.*.mlp.dense_h_to_4h / dense_4h_to_h   Linear1D_Col / Linear1D_Row
    word_embeddings                      VocabParallelEmbedding1D
    lm_head                              VocabParallelLMHead1D (tied)
    score / classifier / qa_outputs      Linear1D_Col, gathered

BloomAttention reshapes by self.num_heads, which becomes this rank's head
count.  BloomModel builds the ALiBi bias [batch * n_head, 1, seq] from the
global head count inside its forward; its build_alibi_tensor method is
replaced by one that builds the global bias and keeps this rank's heads
[q_start, q_start + q_count), so head h keeps slope m_h on whichever rank it lands.
pretraining_tp > 1 with slow_but_exact=True is refused.

Split-gather sequence parallelism: FusedQKVShape's.  ALiBi needs nothing more:
the model builds the bias for the whole sequence and the attention sees the
whole (gathered) sequence; dropout_add's probability moves into the row layers.

all_to_all: BLOOM's attention is outside transformers' registry and computes
its scores inline in BloomAttention.forward, so that forward is the seam
(split_attention below): query_key_value on this rank's rows, the
all-to-all to H/p heads over the whole padded sequence, there

    scores = alibi_h[key] + (q . k) / sqrt(D) + mask,   softmax, dropout, @ v

with alibi_h the model's bias (slope_h x absolute key position, built for the
whole sequence) for this rank's heads, then the all-to-all back, dense and
the residual dropout_add on this rank's rows.  ring_attn: the ring kernel
on the zigzag rows, scale inv_norm_factor, causal with the key padding of the
model's mask, each block of the ring adding beta alibi_h at its key columns
(global positions; ring_rows' key_bias), attention dropout in training drawn
by the ring as one kernel call over the whole sequence would.

enable_flash_attention: BloomAttention.forward with the C kernel
(kernel_attention below), ALiBi as the kernel's additive bias.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F

from shardformer.family import Family
from shardformer.layer import sequence_attention as sa
from shardformer.policies.shapes import FusedQKVShape, gpt_heads
from shardformer.spec import Method, Refusal


def local_alibi(hf_build, q_start: int, q_count: int):
    """BloomModel.build_alibi_tensor keeping heads [q_start, q_start + q_count)
    (a partial of a module-level function, so the model pickles)."""
    return functools.partial(_local_alibi, hf_build, q_start, q_count)


def alibi_method(hf_build, heads, site):
    """build_alibi_tensor on this rank (a shardformer.spec.Method's make, given
    its MethodSite): the global bias cut to the query heads this rank holds."""
    q_start, q_count, _, _ = heads.layout(site.size, site.rank)
    return local_alibi(hf_build, q_start, q_count)


def _local_alibi(hf_build, q_start: int, q_count: int, model, attention_mask, num_heads, dtype):
    """hf_build's bias [B * H, 1, S] for all heads, cut to the heads
    [q_start, q_start + q_count): [B * q_count, 1, S]."""
    alibi = hf_build(attention_mask, num_heads, dtype)  # [B * H, 1, S]
    batch = attention_mask.shape[0]
    alibi = alibi.view(batch, num_heads, 1, -1)[:, q_start:q_start + q_count]
    return alibi.reshape(batch * q_count, 1, alibi.shape[-1])


def split_attention(state, attention, original, args, kwargs):
    """BloomAttention.forward in a split forward: hidden_states [B, S_r,
    hidden] of this rank's rows -> (output [B, S_r, hidden], None)."""
    hidden, residual, alibi, mask = sa.bind_args(args, kwargs, ("hidden_states", "residual", "alibi",
                                                                "attention_mask"))
    batch, heads = hidden.shape[0], attention.num_heads
    query, key, value = attention._reshape(attention.query_key_value(hidden))      # [B, H, S_r, D]
    bias = sa.padded_keys(alibi.view(batch, heads, 1, -1), state)                 # [B, H, 1, S']

    def core(q, k, v, full_mask):
        scores = attention.beta * sa.local_heads(bias, state, heads) + \
            attention.inv_norm_factor * torch.matmul(q, k.transpose(-1, -2))
        if full_mask is not None:
            scores = scores + full_mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(attention.attention_dropout(probs), v)

    if state.mode == "ring_attn":
        p = attention.attention_dropout.p if attention.training else 0.0
        context = sa.ring_rows(state, query, key, value, mask, scale=attention.inv_norm_factor, dropout=p,
                               key_bias=attention.beta * bias)
    else:
        context = sa.ulysses(state, query, key, value, core, mask)                 # [B, H, S_r, D]
    return _output(attention, context, residual), None


def _output(attention, context, residual):
    """The attention's context [B, H, S, D] -> dense, then the residual
    dropout_add, as BloomAttention ends."""
    batch, heads, rows, head_dim = context.shape
    output = attention.dense(context.transpose(1, 2).reshape(batch, rows, heads * head_dim))
    return F.dropout(output, attention.hidden_dropout, attention.training) + residual


def kernel_attention(attention, original, args, kwargs):
    """BloomAttention.forward with the C kernel (enable_flash_attention):
    softmax(inv_norm_factor q . k + beta alibi_h[key] + mask) @ v, the ALiBi
    term as the kernel's additive bias [B, H, 1, Sk] (the same for every
    query row) and the model's additive mask added as it adds it; the key /
    value cache updated first as the model does.  The model's own forward
    where attention dropout is active in training or the weights are asked for."""
    from shardformer.attention import own_attention, seam_kernel, seam_kernel_reason

    hidden, residual, alibi, mask, cache, _, weights = sa.bind_args(args, kwargs, (
        "hidden_states", "residual", "alibi", "attention_mask", "layer_past", "use_cache", "output_attentions"))
    p = attention.attention_dropout.p if attention.training else 0.0
    reason = seam_kernel_reason(attention, (hidden,), p, bool(weights))
    if reason is not None:
        return own_attention(reason, original, args, kwargs)
    query, key, value = attention._reshape(attention.query_key_value(hidden))      # [B, H, S, D]
    if cache is not None:
        key, value = cache.update(key, value, attention.layer_idx)
    bias = attention.beta * alibi.view(hidden.shape[0], attention.num_heads, 1, -1)
    context = seam_kernel(query, key, value, scale=attention.inv_norm_factor, mask=mask, bias=bias, dropout=p)
    return _output(attention, context, residual), None


SEAM = sa.AttentionSeam("BloomAttention", "forward", split_attention,
                        kernel=kernel_attention).registered(__name__, "SEAM")


class BloomShape(FusedQKVShape):
    attention_draws_replicated = ("BloomAttention",)   # its dropout_add of the residual
    split_attention_at = ("BloomModel", "h")
    attention_seam = SEAM

    def refusals(self):
        return (Refusal("pretraining_tp", allowed=(None, 0, 1), default=1, when=("config:slow_but_exact",),
                        message="{model}: pretraining_tp={value} with slow_but_exact=True is not supported (set "
                                "slow_but_exact=False)"),)

    def build_spec(self):
        """FusedQKVShape's spec, BloomModel's build_alibi_tensor a Method row
        keeping this rank's heads (alibi_method)."""
        spec = super().build_spec()
        heads = next(e.heads for e in spec.module("BloomBlock").entries if e.suffix == "self_attention.query_key_value")
        make = functools.partial(alibi_method, self.hf_class("build_alibi_tensor"), heads)
        alibi = Method("build_alibi_tensor", make)
        return replace(spec, modules=tuple(replace(m, attributes=m.attributes + (alibi,)) if m.key == "BloomModel"
                                           else m for m in spec.modules))


FAMILY = Family("bloom", "bloom.modeling_bloom", BloomShape, options={"prefix": "Bloom", "layer": "Block"},
                heads=gpt_heads("Bloom"))
globals().update(FAMILY.policy_classes())
