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

Sequence parallelism, split_gather only (the layout of
shardformer.layer.sequence with SequenceState(dim=0): ChatGLM2 runs
[S, batch, hidden], so the sequence is dimension 0).  The hidden states
are split along S (padded to a multiple of p) at encoder.layers.0 and
all-gathered after the last layer (final_layernorm, the output layer and the
loss see the full sequence).  self_attention and mlp are sequence-parallel
blocks: input all-gathered along S (backward: reduce-scatter),
query_key_value / dense_h_to_4h read it without copy_to_tp_region, dense /
dense_4h_to_h return partial sums, which the block reduce-scatters along S
(backward: all-gather).  The attention therefore sees the whole sequence with
the model's own rotary table and mask; input_layernorm,
post_attention_layernorm, the hidden dropouts and the residual adds run on
this rank's rows (a dropout mask per rank; the norms' gradients
all-reduced).  Refused by name: add_bias_linear=True (the row layers'
biases would be summed over the ranks by the block's reduce-scatter),
enable_sequence_overlap, and the all_to_all / ring_attn modes (the
attention is remote code outside transformers' AttentionInterface, with no
seam where a split attention could take q / k / v).
"""
from __future__ import annotations

from shardformer.family import Family, FamilyPolicy, lm, sequence_mode_refused
from shardformer.layer import FusedLinear1D_Col, Linear1D_Row, VocabParallelEmbedding1D
from shardformer.layout import Fused, Heads
from shardformer.policy import ModulePolicyDescription
from shardformer.policy import SubModuleReplacementDescription as Sub


class ChatGLM2Shape(FamilyPolicy):
    def config_sanity_check(self):
        if getattr(self.model.config, "original_rope", True) is False:
            raise ValueError(f"{type(self.model).__name__}: original_rope=False is not supported")
        self.check_sequence_mode()

    def layers_path(self) -> str:
        return "transformer.encoder.layers" if hasattr(self.model, "transformer") else "encoder.layers"

    def check_sequence_mode(self) -> None:
        cfg, name = self.shard_config, type(self.model).__name__
        mode = cfg.sequence_parallelism_mode
        if cfg.split_attention_mode:
            raise sequence_mode_refused(
                name, f"{self.layers_path()}.*.self_attention.core_attention", mode,
                "ChatGLM2's attention is remote code outside transformers' AttentionInterface, with no seam where "
                "a split attention could take q / k / v; use 'split_gather'")
        if cfg.sequence_parallel and getattr(self.model.config, "add_bias_linear", False):
            raise sequence_mode_refused(
                name, f"{self.layers_path()}.*.self_attention.dense / mlp.dense_4h_to_h", mode,
                "add_bias_linear=True: the sequence-parallel block reduce-scatters the row layers' outputs, "
                "which would sum their biases over the ranks")

    def sequence_parallel_modes(self) -> tuple[str, ...]:
        return ("split_gather",)

    def sequence_parallel_subs(self) -> tuple[list, list]:
        """(GLMBlock subs, GLMTransformer subs) of split_gather: the blocks,
        the norms (gradients all-reduced), the split and the gather, along
        dimension 0."""
        from shardformer.layer.replicated import ReplicatedInParallelRegion
        from shardformer.layer.sequence import SequenceParallelRegion, SequenceState

        state = SequenceState(dim=0)
        block = {"role": "block", "state": state}
        subs = [Sub("self_attention", SequenceParallelRegion, kwargs=block),
                Sub("mlp", SequenceParallelRegion, kwargs=block),
                Sub("input_layernorm", ReplicatedInParallelRegion),
                Sub("post_attention_layernorm", ReplicatedInParallelRegion)]
        last = len(self.model.get_submodule(self.layers_path())) - 1
        if last == 0:
            return subs, [Sub("layers.0", SequenceParallelRegion, kwargs={"role": ("split", "gather"), "state": state})]
        return subs, [Sub("layers.0", SequenceParallelRegion, kwargs={"role": "split", "state": state}),
                      Sub(f"layers.{last}", SequenceParallelRegion, kwargs={"role": "gather", "state": state})]

    def postprocess(self):
        model = super().postprocess()
        if self.tensor_parallel and self.shard_config.sequence_parallel and self.tp_size > 1:
            from shardformer.layer.sequence import refuse_recorded_hidden_states

            refuse_recorded_hidden_states(self.model, type(self.model).__name__)
        return model

    def body_policy(self):
        if not self.tensor_parallel:
            return {}
        cfg = self.model.config
        d = cfg.kv_channels
        groups = cfg.multi_query_group_num if cfg.multi_query_attention else cfg.num_attention_heads
        heads = Heads(cfg.num_attention_heads, groups, d)
        sp = {"sequence_parallel": True} if self.shard_config.sequence_parallel else {}
        policy = {
            "GLMBlock": ModulePolicyDescription(
                attribute_replacement={
                    "self_attention.num_attention_heads_per_partition": heads.local_heads(),
                    "self_attention.num_multi_query_groups_per_partition": heads.local_kv_heads(),
                    "self_attention.projection_size": heads.local_width(d),
                    "self_attention.core_attention.num_attention_heads_per_partition": heads.local_heads(),
                    "self_attention.core_attention.hidden_size_per_partition": heads.local_width(d),
                },
                sub_module_replacement=[
                    Sub("self_attention.query_key_value", FusedLinear1D_Col, kwargs={"split": heads.qkv, **sp}),
                    Sub("self_attention.dense", Linear1D_Row, kwargs={"split": heads.q, **sp}),
                    Sub("mlp.dense_h_to_4h", FusedLinear1D_Col, kwargs={"split": Fused.equal(2), **sp}),
                    Sub("mlp.dense_4h_to_h", Linear1D_Row, kwargs=sp),
                ],
            ),
            "ChatGLMModel": ModulePolicyDescription(sub_module_replacement=[
                Sub("embedding.word_embeddings", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs())]),
        }
        if sp:
            block_subs, encoder_subs = self.sequence_parallel_subs()
            policy["GLMBlock"].sub_module_replacement.extend(block_subs)
            policy["GLMTransformer"] = ModulePolicyDescription(sub_module_replacement=encoder_subs)
        return policy

    def input_embeddings(self):
        # The remote code has no get_input_embeddings(): found by path.
        glm = self.model.transformer if hasattr(self.model, "transformer") else self.model
        return glm.embedding.word_embeddings


FAMILY = Family("chatglm2", "", ChatGLM2Shape, heads={
    "ChatGLMModel": lm("output_layer"),
    "ChatGLMForConditionalGeneration": lm("transformer.output_layer", loss="causal"),  # its own shifted CE
})
globals().update(FAMILY.policy_classes())
