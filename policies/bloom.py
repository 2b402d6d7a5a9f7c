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
"""
from __future__ import annotations

from shardformer.family import Family
from shardformer.policies.shapes import FusedQKVShape, gpt_heads


def local_alibi(hf_build, q_start: int, q_count: int):
    """BloomModel.build_alibi_tensor keeping heads [q_start, q_start + q_count)."""

    def build_alibi_tensor(self, attention_mask, num_heads, dtype):
        alibi = hf_build(attention_mask, num_heads, dtype)  # [B * H, 1, S]
        batch = attention_mask.shape[0]
        alibi = alibi.view(batch, num_heads, 1, -1)[:, q_start:q_start + q_count]
        return alibi.reshape(batch * q_count, 1, alibi.shape[-1])

    return build_alibi_tensor


class BloomShape(FusedQKVShape):
    def config_sanity_check(self):
        cfg = self.model.config
        if cfg.pretraining_tp > 1 and cfg.slow_but_exact:
            raise ValueError(f"{type(self.model).__name__}: pretraining_tp={cfg.pretraining_tp} with "
                             "slow_but_exact=True is not supported (set slow_but_exact=False)")

    def body_policy(self):
        policy = super().body_policy()
        if self.tensor_parallel:
            heads, _, _ = self.qkv_layout()
            q_start, q_count, _, _ = heads.layout(self.tp_size, self.shard_config.tensor_parallel_rank)
            policy["BloomModel"].method_replacement["build_alibi_tensor"] = \
                local_alibi(self.hf_class("build_alibi_tensor"), q_start, q_count)
        return policy


FAMILY = Family("bloom", "bloom.modeling_bloom", BloomShape, options={"prefix": "Bloom", "layer": "Block"},
                heads=gpt_heads("Bloom"))
globals().update(FAMILY.policy_classes())
