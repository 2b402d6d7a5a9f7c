"""ChatGLM2 (remote code, matched by class name): multi-query attention heads
and SwiGLU features split; vocabulary-parallel embedding and output layer.

    encoder.layers.*.self_attention.query_key_value   FusedLinear1D_Col, [q | k | v] each split
                                                      per head; the multi_query_group_num KV groups
                                                      are replicated when fewer than ranks
    encoder.layers.*.self_attention.dense              Linear1D_Row
    encoder.layers.*.mlp.dense_h_to_4h                 FusedLinear1D_Col, [gate | up] each split
    encoder.layers.*.mlp.dense_4h_to_h                 Linear1D_Row
    embedding.word_embeddings                          VocabParallelEmbedding1D
    output_layer                                       VocabParallelLMHead1D (gathered; tied to
                                                       word_embeddings when the model tied them)

The attention reads its per-partition sizes from attributes, which become
this rank's values: num_attention_heads_per_partition,
num_multi_query_groups_per_partition, projection_size, and core_attention's
num_attention_heads_per_partition / hidden_size_per_partition.

Remote code need not define get_input_embeddings, so the tie of the output
layer is found on ChatGLMModel's embedding.word_embeddings directly.
original_rope=False is refused.
"""
from __future__ import annotations

from shardformer.family import Family, FamilyPolicy, lm
from shardformer.layer import FusedLinear1D_Col, Linear1D_Row, VocabParallelEmbedding1D
from shardformer.layout import Fused, Heads
from shardformer.policy import ModulePolicyDescription
from shardformer.policy import SubModuleReplacementDescription as Sub


class ChatGLM2Shape(FamilyPolicy):
    def config_sanity_check(self):
        if getattr(self.model.config, "original_rope", True) is False:
            raise ValueError(f"{type(self.model).__name__}: original_rope=False is not supported")

    def body_policy(self):
        if not self.tensor_parallel:
            return {}
        cfg = self.model.config
        d = cfg.kv_channels
        groups = cfg.multi_query_group_num if cfg.multi_query_attention else cfg.num_attention_heads
        heads = Heads(cfg.num_attention_heads, groups, d)
        return {
            "GLMBlock": ModulePolicyDescription(
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
            ),
            "ChatGLMModel": ModulePolicyDescription(sub_module_replacement=[
                Sub("embedding.word_embeddings", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs())]),
        }

    def input_embeddings(self):
        # The remote code has no get_input_embeddings(): found by path.
        glm = self.model.transformer if hasattr(self.model, "transformer") else self.model
        return glm.embedding.word_embeddings


FAMILY = Family("chatglm2", "", ChatGLM2Shape, heads={
    "ChatGLMModel": lm("output_layer"),
    "ChatGLMForConditionalGeneration": lm("transformer.output_layer", loss="causal"),  # its own shifted CE
})
globals().update(FAMILY.policy_classes())
