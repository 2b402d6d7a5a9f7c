"""BLOOM: attention heads and MLP features split; vocabulary-parallel embedding
and LM head (tied); ALiBi slopes follow their heads.

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
"""
from __future__ import annotations

from shardformer.layer import DropoutForParallelInput, FusedLayerNorm, Linear1D_Col, Linear1D_Row
from shardformer.layer import VocabParallelEmbedding1D
from shardformer.layout import Heads
from shardformer.policies.mistral import DecoderPolicy
from shardformer.policy import ModulePolicyDescription
from shardformer.policy import SubModuleReplacementDescription as Sub


def local_alibi(hf_build, q_start: int, q_count: int):
    """BloomModel.build_alibi_tensor keeping heads [q_start, q_start + q_count)."""

    def build_alibi_tensor(self, attention_mask, num_heads, dtype):
        alibi = hf_build(attention_mask, num_heads, dtype)  # [B * H, 1, S]
        batch = attention_mask.shape[0]
        alibi = alibi.view(batch, num_heads, 1, -1)[:, q_start:q_start + q_count]
        return alibi.reshape(batch * q_count, 1, alibi.shape[-1])

    return build_alibi_tensor


class BloomPolicy(DecoderPolicy):
    hf_module = "bloom.modeling_bloom"
    tie_source = "transformer.word_embeddings"

    def config_sanity_check(self):
        cfg = self.model.config
        if cfg.pretraining_tp > 1 and cfg.slow_but_exact:
            raise ValueError(f"{type(self.model).__name__}: pretraining_tp={cfg.pretraining_tp} with "
                             "slow_but_exact=True is not supported (set slow_but_exact=False)")

    def module_policy(self):
        hf = self.hf()
        cfg = self.model.config
        head_dim = cfg.hidden_size // cfg.n_head
        heads = Heads(cfg.n_head, cfg.n_head, head_dim)
        fused_heads = Heads(cfg.n_head, cfg.n_head, 3 * head_dim)  # one head = [q_h k_h v_h]
        policy = {}
        if self.tensor_parallel:
            q_start, q_count, _, _ = heads.layout(self.tp_size, self.shard_config.tensor_parallel_rank)
            policy[hf.BloomBlock] = ModulePolicyDescription(
                attribute_replacement={"self_attention.num_heads": heads.local_heads()},
                sub_module_replacement=[
                    Sub("self_attention.query_key_value", Linear1D_Col, kwargs={"split": fused_heads.q}),
                    Sub("self_attention.dense", Linear1D_Row, kwargs={"split": heads.q}),
                    Sub("self_attention.attention_dropout", DropoutForParallelInput),
                    Sub("mlp.dense_h_to_4h", Linear1D_Col),
                    Sub("mlp.dense_4h_to_h", Linear1D_Row),
                ],
            )
            policy[hf.BloomModel] = ModulePolicyDescription(
                sub_module_replacement=[
                    Sub("word_embeddings", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs())],
                method_replacement={"build_alibi_tensor": local_alibi(hf.build_alibi_tensor, q_start, q_count)},
            )
            self.add_head(policy, hf)
        if self.shard_config.enable_fused_normalization:
            self.append_or_create_submodule_replacement(
                [Sub("input_layernorm", FusedLayerNorm), Sub("post_attention_layernorm", FusedLayerNorm)],
                policy, hf.BloomBlock)
            self.append_or_create_submodule_replacement(
                [Sub("word_embeddings_layernorm", FusedLayerNorm), Sub("ln_f", FusedLayerNorm)], policy, hf.BloomModel)
        return policy


class BloomModelPolicy(BloomPolicy):
    pass


class BloomForCausalLMPolicy(BloomPolicy):
    model_class, head = "BloomForCausalLM", "lm_head"


class BloomForSequenceClassificationPolicy(BloomPolicy):
    model_class, head = "BloomForSequenceClassification", "score"


class BloomForTokenClassificationPolicy(BloomPolicy):
    model_class, head = "BloomForTokenClassification", "classifier"


class BloomForQuestionAnsweringPolicy(BloomPolicy):
    model_class, head = "BloomForQuestionAnswering", "qa_outputs"
