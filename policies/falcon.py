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
"""
from __future__ import annotations

from shardformer.family import Family
from shardformer.layout import Heads
from shardformer.policies.shapes import FusedQKVShape, gpt_heads


class FalconShape(FusedQKVShape):
    def config_sanity_check(self):
        cfg = self.model.config
        if self.tensor_parallel and cfg.alibi:
            raise ValueError(f"{type(self.model).__name__}: alibi=True is not supported by the Falcon policy "
                             "(FalconModel builds the ALiBi bias for all heads inside its forward)")
        if self.shard_config.sequence_parallel and (cfg.hidden_dropout or cfg.attention_dropout):
            raise NotImplementedError(
                f"{type(self.model).__name__}: sequence parallelism (split_gather) with hidden_dropout="
                f"{cfg.hidden_dropout} / attention_dropout={cfg.attention_dropout} is not available (Falcon's "
                f"residual dropouts are functional calls on the split rows; set both to 0)")

    def residual_dropouts(self):
        return 0.0, ()          # in the decoder layer, refused above when > 0

    def qkv_layout(self):
        cfg = self.model.config
        n, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        if cfg.new_decoder_architecture:
            heads = Heads(n, cfg.num_kv_heads, head_dim)
            qkv, kv_heads = heads.grouped_qkv, heads.local_kv_heads()
        elif cfg.multi_query:
            heads = Heads(n, 1, head_dim)
            qkv, kv_heads = heads.qkv, 1
        else:
            heads, qkv, _ = super().qkv_layout()
            kv_heads = heads.local_heads()
        return heads, qkv, {"self_attention.num_heads": heads.local_heads(), "self_attention.num_kv_heads": kv_heads}


FAMILY = Family("falcon", "falcon.modeling_falcon", FalconShape, options={"prefix": "Falcon", "layer": "DecoderLayer"},
                heads=gpt_heads("Falcon"))
globals().update(FAMILY.policy_classes())
