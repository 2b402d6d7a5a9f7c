"""ChatGLM2 (remote code, matched by class name): multi-query attention heads
and SwiGLU features split; vocabulary-parallel embedding and output layer.

    encoder.layers.*.self_attention.query_key_value   FusedLinear1D_Col, [q | k | v] each split
                                                      per head; the multi_query_group_num KV groups
                                                      are replicated when fewer than ranks
    encoder.layers.*.self_attention.dense              Linear1D_Row
    encoder.layers.*.mlp.dense_h_to_4h                 FusedLinear1D_Col, [gate | up] each split
    encoder.layers.*.mlp.dense_4h_to_h                 Linear1D_Row
    embedding.word_embeddings                          VocabParallelEmbedding1D
    output_layer                                       VocabParallelLMHead1D (gathered)

The attention reads its per-partition sizes from attributes, which become
this rank's values: num_attention_heads_per_partition,
num_multi_query_groups_per_partition, and core_attention's
num_attention_heads_per_partition / hidden_size_per_partition.
"""
from __future__ import annotations

from shardformer.layer import (
    FusedLinear1D_Col,
    FusedRMSNorm,
    Linear1D_Row,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
)
from shardformer.layout import Fused, Heads
from shardformer.policy import ModulePolicyDescription, Policy
from shardformer.policy import SubModuleReplacementDescription as Sub


class ChatGLM2Policy(Policy):
    def config_sanity_check(self):
        cfg = self.model.config
        if getattr(cfg, "original_rope", True) is False:
            raise ValueError(f"{type(self.model).__name__}: original_rope=False is not supported")

    def module_policy(self):
        cfg = self.model.config
        d = cfg.kv_channels
        groups = cfg.multi_query_group_num if cfg.multi_query_attention else cfg.num_attention_heads
        heads = Heads(cfg.num_attention_heads, groups, d)
        policy = {}
        if self.tensor_parallel:
            policy["GLMBlock"] = ModulePolicyDescription(
                attribute_replacement={
                    "self_attention.num_attention_heads_per_partition": heads.local_heads(),
                    "self_attention.num_multi_query_groups_per_partition": heads.local_kv_heads(),
                    "self_attention.projection_size": heads.local_width(d),
                    "self_attention.core_attention.num_attention_heads_per_partition": heads.local_heads(),
                    "self_attention.core_attention.hidden_size_per_partition": heads.local_width(d),
                },
                sub_module_replacement=[
                    Sub("self_attention.query_key_value", FusedLinear1D_Col, kwargs={"split": heads.qkv}),
                    Sub("self_attention.dense", Linear1D_Row, kwargs={"split": heads.q}),
                    Sub("mlp.dense_h_to_4h", FusedLinear1D_Col, kwargs={"split": Fused.equal(2)}),
                    Sub("mlp.dense_4h_to_h", Linear1D_Row),
                ],
            )
            policy["ChatGLMModel"] = ModulePolicyDescription(sub_module_replacement=[
                Sub("embedding.word_embeddings", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs()),
                Sub("output_layer", VocabParallelLMHead1D, kwargs=self.lm_head_kwargs()),
            ])
        if self.shard_config.enable_fused_normalization:
            self.append_or_create_submodule_replacement(
                [Sub("input_layernorm", FusedRMSNorm), Sub("post_attention_layernorm", FusedRMSNorm)],
                policy, "GLMBlock")
            self.append_or_create_submodule_replacement(Sub("final_layernorm", FusedRMSNorm), policy,
                                                        "GLMTransformer")
        return policy

    def postprocess(self):
        if self.tensor_parallel and self.ties_word_embeddings():
            prefix = "transformer." if hasattr(self.model, "transformer") else ""
            self.tie_weight(f"{prefix}embedding.word_embeddings", f"{prefix}output_layer")
        return self.model


class ChatGLMModelPolicy(ChatGLM2Policy):
    pass


class ChatGLMForConditionalGenerationPolicy(ChatGLM2Policy):
    pass
