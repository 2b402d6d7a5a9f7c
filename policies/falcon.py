"""Falcon: the BLOOM-shaped decoder of policies/shapes.py (FusedQKVShape):
attention heads and MLP features split; vocabulary-parallel embedding and LM
head (tied when HF tied it).  The fused query_key_value layout depends on the
config, and each gets the split that keeps every rank's rows in the same layout:

    new_decoder_architecture   rows grouped per KV head [q_1 .. q_g | k | v]:
                               Heads.grouped_qkv (a KV head is replicated on the
                               ranks that split its query heads when
                               num_kv_heads < tp)
    multi_query                [q (all heads) | k | v] with one KV head:
                               Heads(n, 1).qkv, k and v replicated on every rank
    neither                    interleaved per head [q_h k_h v_h]: one head is a
                               block of 3 * head_dim rows (as BLOOM)

    h.*.self_attention.query_key_value   Linear1D_Col, split as above
    h.*.self_attention.dense             Linear1D_Row
    h.*.mlp.dense_h_to_4h / dense_4h_to_h   Linear1D_Col / Linear1D_Row
    word_embeddings                      VocabParallelEmbedding1D
    lm_head                              VocabParallelLMHead1D (tied)
    score / classifier / qa_outputs      Linear1D_Col, gathered

FalconAttention reshapes by self.num_heads and self.num_kv_heads, which become
this rank's counts.  ALiBi Falcon models (config.alibi) are refused: FalconModel
builds the bias for all heads with a module-level function inside its forward.

Split-gather sequence parallelism as FusedQKVShape's (attention and MLP
gather their input, dense / dense_4h_to_h reduce-scatter; with parallel_attn
both read the same norm output and gather it once each).  Falcon's residual
dropouts are functional calls in the decoder layer on the sum of the
attention and MLP outputs, with the probabilities read from the shared
config (hidden_dropout, attention_dropout): they cannot move into the row
layers, and on this rank's rows torch's global generator would draw the
same mask on every rank, so SP is refused when either is > 0.

all_to_all / ring_attn: Falcon's attention is outside transformers' registry
and computes its scores inline in FalconAttention.forward, so that forward is
the seam (split_attention below), for every fused layout above: query_key_value
on this rank's rows, the model's own _split_heads, the rotary embedding from
the cos / sin of this rank's rows (the layers receive them), then

    rotary   all_to_all: softmax((q . k) / sqrt(D) + mask) @ v on H/p heads
             over the whole padded sequence (no attention dropout, as the
             model's eager and sdpa paths; an sdpa model's boolean mask
             taken as 0 / min); ring_attn: the ring kernel, causal, scale
             1 / sqrt(D), the one or few KV heads shared by their query heads
    ALiBi    all_to_all: softmax((q . k + alibi_h[key]) / sqrt(D) + mask_h),
             attention dropout, @ v, with alibi_h and mask_h (the model folds
             alibi_h / sqrt(D) into its per-head mask too) this rank's heads
             over the absolute key positions; under sdpa, as the model's sdpa
             path, the bias only through the mask: softmax(q . k / sqrt(D) +
             mask_h); ring_attn: the ring kernel, scale 1 / sqrt(D), each
             block adding the model's ALiBi term at its key columns
             (_alibi_key_bias), attention dropout in training drawn by the
             ring as one kernel call over the whole sequence would

and dense on this rank's rows after the all-to-all back.  Those modes do not
move the decoder layer's functional dropouts: in eval they are off; in
training each rank draws the masks of its own rows.  ALiBi with tensor
parallelism stays refused (above).

enable_flash_attention: FalconAttention.forward with the C kernel
(kernel_attention below), every fused layout, rotary and ALiBi.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from shardformer.family import Family
from shardformer.layer import sequence_attention as sa
from shardformer.layout import Heads
from shardformer.policies.shapes import FusedQKVShape, gpt_heads
from shardformer.spec import Refusal


def _heads_major(attention, hidden):
    """q [B, H, S_r, D], k / v [B, Hkv, S_r, D] of this rank's rows (Hkv: 1
    for multi-query, H for the others: the new architecture's _split_heads
    repeats its KV heads)."""
    query, key, value = attention._split_heads(attention.query_key_value(hidden))   # [B, S_r, heads, D]
    kv = attention.num_heads if attention.new_decoder_architecture else attention.num_kv_heads
    batch, rows = hidden.shape[:2]
    query = query.transpose(1, 2).reshape(batch, attention.num_heads, rows, attention.head_dim)
    key, value = (t.transpose(1, 2).reshape(batch, kv, rows, attention.head_dim) for t in (key, value))
    return query, key, value


def _rotary_core(attention, dtype):
    def core(q, k, v, mask):
        if k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(attention.head_dim)
        if mask is not None:
            scores = scores + sa.additive(mask, scores.dtype)
        return torch.matmul(F.softmax(scores, dim=-1, dtype=dtype), v)
    return core


def _alibi_core(state, attention, alibi, dtype):
    heads = attention.num_heads
    bias = sa.padded_keys(alibi.view(-1, heads, 1, alibi.shape[-1]), state)      # [B, H, 1, S']
    sdpa = attention.config._attn_implementation == "sdpa"

    def core(q, k, v, mask):
        if k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        scores = torch.matmul(q, k.transpose(-1, -2))
        if scores.dtype in (torch.float16, torch.bfloat16):
            scores = scores.float()
        if sdpa:        # the model folded alibi / sqrt(D) into its mask; sdpa adds nothing else
            logits = scores * attention.inv_norm_factor
        else:           # eager adds the bias to the scores as well
            logits = (scores + sa.local_heads(bias, state, heads)) * attention.inv_norm_factor
        if mask is not None:
            logits = logits + sa.local_heads(sa.additive(mask, logits.dtype), state, heads)
        probs = attention.attention_dropout(F.softmax(logits, dim=-1, dtype=dtype))
        return torch.matmul(probs, v)
    return core


_NAMES = ("hidden_states", "alibi", "attention_mask", "position_ids", "layer_past", "use_cache", "output_attentions",
          "position_embeddings")


def _alibi_key_bias(attention, alibi):
    """The ALiBi term the model adds to the scaled scores, per head and key
    [B, H, 1, Sk]: eager adds alibi_h to q . k before scaling and again, scaled,
    through its per-head mask (2 alibi_h / sqrt(D)); sdpa through the mask only
    (alibi_h / sqrt(D))."""
    times = 1.0 if attention.config._attn_implementation == "sdpa" else 2.0
    return (times * attention.inv_norm_factor) * alibi.view(-1, attention.num_heads, 1, alibi.shape[-1])


def _visible(mask):
    """The model's per-head ALiBi mask (alibi_h / sqrt(D) where a key is seen,
    the dtype's minimum where hidden) reduced to what is hidden: 0 / min,
    the ALiBi term then coming from _alibi_key_bias alone."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return torch.zeros_like(mask).masked_fill(mask < -1, torch.finfo(mask.dtype).min)


def _merged(attention, context):
    """context [B, H, S, D] -> dense([B, S, H D])."""
    batch, heads, rows, head_dim = context.shape
    return attention.dense(context.transpose(1, 2).reshape(batch, rows, heads * head_dim))


def split_attention(state, attention, original, args, kwargs):
    """FalconAttention.forward in a split forward: hidden_states [B, S_r,
    hidden] of this rank's rows -> (output [B, S_r, hidden], None)."""
    hidden, alibi, mask, *_, rotary = sa.bind_args(args, kwargs, _NAMES)
    query, key, value = _heads_major(attention, hidden)
    if alibi is None:
        cos, sin = rotary                                           # this rank's rows (the layer hook)
        rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb
        query, key = rotate(query, key, cos, sin)
        if state.mode == "ring_attn":
            context = sa.ring_rows(state, query, key, value, mask, scale=1.0 / math.sqrt(attention.head_dim))
        else:
            context = sa.ulysses(state, query, key, value, _rotary_core(attention, hidden.dtype), mask)
    elif state.mode == "ring_attn":
        p = attention.attention_dropout.p if attention.training else 0.0
        bias = sa.padded_keys(_alibi_key_bias(attention, alibi), state)
        context = sa.ring_rows(state, query, key, value, _visible(mask), scale=attention.inv_norm_factor,
                               dropout=p, key_bias=bias)
    else:
        context = sa.ulysses(state, query, key, value, _alibi_core(state, attention, alibi, hidden.dtype), mask)
    return _merged(attention, context), None


def kernel_attention(attention, original, args, kwargs):
    """FalconAttention.forward with the C kernel (enable_flash_attention),
    after the model's own projections, rotary embedding and cache update:

        rotary   softmax(q . k / sqrt(D) + mask) @ v (eager: the additive mask;
                 sdpa: its boolean mask, or causal when it passes none); no
                 attention dropout, as the model's rotary path
        ALiBi    softmax(q . k / sqrt(D) + c alibi_h[key] + mask) @ v with the
                 ALiBi term as the kernel's bias [B, H, 1, Sk] (c: 2 / sqrt(D)
                 eager, 1 / sqrt(D) sdpa; _alibi_key_bias) and the mask reduced
                 to 0 / min; the model's forward where attention dropout is
                 active in training

    The one (multi-query) or few KV heads are shared by their query heads in
    the kernel.  The model's forward where the weights are asked for."""
    from shardformer.attention import own_attention, seam_kernel, seam_kernel_reason

    hidden, alibi, mask, _, cache, _, weights, rotary = sa.bind_args(args, kwargs, _NAMES)
    dropout = attention.attention_dropout.p if alibi is not None and attention.training else 0.0
    reason = seam_kernel_reason(attention, (hidden,), dropout, bool(weights))
    if reason is not None:
        return own_attention(reason, original, args, kwargs)
    query, key, value = _heads_major(attention, hidden)
    if alibi is None:
        cos, sin = rotary
        query, key = sys.modules[type(attention).__module__].apply_rotary_pos_emb(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, attention.layer_idx)
    if alibi is None:
        causal = mask is None and attention.is_causal and query.shape[2] > 1
        context = seam_kernel(query, key, value, scale=1.0 / math.sqrt(attention.head_dim), causal=causal,
                              mask=mask)
    else:
        context = seam_kernel(query, key, value, scale=attention.inv_norm_factor, mask=_visible(mask),
                              bias=_alibi_key_bias(attention, alibi), dropout=dropout)
    return _merged(attention, context), None


SEAM = sa.AttentionSeam("FalconAttention", "forward", split_attention,
                        kernel=kernel_attention).registered(__name__, "SEAM")


class FalconShape(FusedQKVShape):
    split_attention_at = ("FalconModel", "h")
    attention_seam = SEAM

    def refusals(self):
        """ALiBi under TP (FalconModel builds the bias for all heads inside its
        forward); split_gather with either residual dropout (functional calls on
        the split rows, which the row layers cannot draw: one message for both)."""
        return (Refusal("alibi", allowed=(False, None), default=False, when=("tensor_parallel",),
                        message="{model}: alibi={value} is not supported by the Falcon policy (FalconModel builds "
                                "the ALiBi bias for all heads inside its forward)"),
                Refusal("hidden_dropout", also=("attention_dropout",), allowed=(0, None), default=0.0,
                        when=("sequence_parallel",), error="NotImplementedError",
                        message="{model}: sequence parallelism (split_gather) with hidden_dropout={hidden_dropout} / "
                                "attention_dropout={attention_dropout} is not available (Falcon's residual dropouts "
                                "are functional calls on the split rows; set both to 0)"))

    def residual_dropouts(self):
        return 0.0, ()          # in the decoder layer, refused above when > 0

    def qkv_layout(self):
        cfg = self.model.config
        n, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        if cfg.new_decoder_architecture:
            heads = Heads(n, cfg.num_kv_heads, head_dim)
            qkv, kv = "colwise_grouped_qkv", {"self_attention.num_kv_heads": "kv_heads"}
        elif cfg.multi_query:       # one KV head, on every rank
            heads = Heads(n, 1, head_dim)
            qkv, kv = "colwise_qkv", {}
        else:
            heads, qkv, _ = super().qkv_layout()
            kv = {"self_attention.num_kv_heads": "heads"}
        attributes = heads.attributes({"self_attention.num_heads": "heads", **kv})
        return heads, qkv, attributes if kv else {**attributes, "self_attention.num_kv_heads": 1}


FAMILY = Family("falcon", "falcon.modeling_falcon", FalconShape, options={"prefix": "Falcon", "layer": "DecoderLayer"},
                heads=gpt_heads("Falcon"))
globals().update(FAMILY.policy_classes())
