"""Falcon: attention heads and MLP features split; vocabulary-parallel embedding
and LM head (tied).  The fused query_key_value layout depends on the config,
and each gets the split that keeps every rank's rows in the same layout:

    new_decoder_architecture   rows grouped per KV head [q_1 .. q_g | k | v]:
                               Heads.grouped_qkv (a KV head is replicated on the
                               ranks that split its query heads when
                               num_kv_heads < tp)
    multi_query                [q (all heads) | k | v] with one KV head:
                               Heads(n, 1).qkv, k and v replicated on every rank
    neither                    interleaved per head [q_h k_h v_h]: one head is a
                               block of 3 * head_dim rows

    h.*.self_attention.query_key_value   Linear1D_Col, split as above
    h.*.self_attention.dense             Linear1D_Row
    h.*.mlp.dense_h_to_4h / dense_4h_to_h   Linear1D_Col / Linear1D_Row
    word_embeddings                      VocabParallelEmbedding1D
    lm_head                              VocabParallelLMHead1D (tied)
    score / classifier / qa_outputs      Linear1D_Col, gathered

FalconAttention reshapes by self.num_heads and self.num_kv_heads, which become
this rank's counts.  ALiBi Falcon models (config.alibi) are refused: FalconModel
builds the bias for all heads with a module-level function inside its forward.
"""
from __future__ import annotations

from shardformer.layer import DropoutForParallelInput, FusedLayerNorm, Linear1D_Col, Linear1D_Row
from shardformer.layer import VocabParallelEmbedding1D
from shardformer.layout import Heads
from shardformer.policies.mistral import DecoderPolicy
from shardformer.policy import ModulePolicyDescription
from shardformer.policy import SubModuleReplacementDescription as Sub


class FalconPolicy(DecoderPolicy):
    hf_module = "falcon.modeling_falcon"
    tie_source = "transformer.word_embeddings"

    def config_sanity_check(self):
        cfg = self.model.config
        if self.tensor_parallel and cfg.alibi:
            raise ValueError(f"{type(self.model).__name__}: alibi=True is not supported by the Falcon policy "
                             "(FalconModel builds the ALiBi bias for all heads inside its forward)")

    def module_policy(self):
        hf = self.hf()
        cfg = self.model.config
        n, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        if cfg.new_decoder_architecture:
            heads = Heads(n, cfg.num_kv_heads, head_dim)
            qkv, kv_heads = heads.grouped_qkv, heads.local_kv_heads()
        elif cfg.multi_query:
            heads = Heads(n, 1, head_dim)
            qkv, kv_heads = heads.qkv, 1
        else:
            heads = Heads(n, n, head_dim)
            qkv, kv_heads = Heads(n, n, 3 * head_dim).q, heads.local_heads()
        policy = {}
        if self.tensor_parallel:
            policy[hf.FalconDecoderLayer] = ModulePolicyDescription(
                attribute_replacement={"self_attention.num_heads": heads.local_heads(),
                                       "self_attention.num_kv_heads": kv_heads},
                sub_module_replacement=[
                    Sub("self_attention.query_key_value", Linear1D_Col, kwargs={"split": qkv}),
                    Sub("self_attention.dense", Linear1D_Row, kwargs={"split": heads.q}),
                    Sub("self_attention.attention_dropout", DropoutForParallelInput),
                    Sub("mlp.dense_h_to_4h", Linear1D_Col),
                    Sub("mlp.dense_4h_to_h", Linear1D_Row),
                ],
            )
            policy[hf.FalconModel] = ModulePolicyDescription(
                sub_module_replacement=[
                    Sub("word_embeddings", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs())])
            self.add_head(policy, hf)
        if self.shard_config.enable_fused_normalization:
            self.append_or_create_submodule_replacement(
                [Sub(name, FusedLayerNorm, ignore_if_not_exist=True)
                 for name in ("input_layernorm", "post_attention_layernorm", "ln_attn", "ln_mlp")],
                policy, hf.FalconDecoderLayer)
            self.append_or_create_submodule_replacement(Sub("ln_f", FusedLayerNorm), policy, hf.FalconModel)
        return policy


class FalconModelPolicy(FalconPolicy):
    pass


class FalconForCausalLMPolicy(FalconPolicy):
    model_class, head = "FalconForCausalLM", "lm_head"


class FalconForSequenceClassificationPolicy(FalconPolicy):
    model_class, head = "FalconForSequenceClassification", "score"


class FalconForTokenClassificationPolicy(FalconPolicy):
    model_class, head = "FalconForTokenClassification", "classifier"


class FalconForQuestionAnsweringPolicy(FalconPolicy):
    model_class, head = "FalconForQuestionAnswering", "qa_outputs"
