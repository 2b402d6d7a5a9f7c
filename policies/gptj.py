"""GPT-J: attention heads and MLP features split; vocabulary-parallel wte and
LM head (with its bias; not tied by default).

    h.*.attn.q_proj, k_proj, v_proj   Linear1D_Col (per head)
    h.*.attn.out_proj                 Linear1D_Row
    h.*.mlp.fc_in / fc_out            Linear1D_Col / Linear1D_Row
    wte                               VocabParallelEmbedding1D
    lm_head                           VocabParallelLMHead1D
    score / qa_outputs                Linear1D_Col, gathered
    dropouts                          parallel on attention probabilities,
                                      replicated after row-parallel layers

GPTJAttention splits and merges heads with self.num_attention_heads, so that
becomes this rank's head count; rotary embeddings act within each head.
"""
from __future__ import annotations

from shardformer.layer import (
    DropoutForParallelInput,
    DropoutForReplicatedInput,
    FusedLayerNorm,
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelEmbedding1D,
)
from shardformer.layout import Heads
from shardformer.policies.mistral import DecoderPolicy
from shardformer.policy import ModulePolicyDescription
from shardformer.policy import SubModuleReplacementDescription as Sub


class GPTJPolicy(DecoderPolicy):
    hf_module = "gptj.modeling_gptj"
    tie_source = "transformer.wte"

    def config_sanity_check(self):
        pass

    def module_policy(self):
        hf = self.hf()
        cfg = self.model.config
        heads = Heads(cfg.n_head, cfg.n_head, cfg.n_embd // cfg.n_head)
        policy = {}
        if self.tensor_parallel:
            policy[hf.GPTJBlock] = ModulePolicyDescription(
                attribute_replacement={"attn.num_attention_heads": heads.local_heads()},
                sub_module_replacement=[
                    Sub("attn.q_proj", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("attn.k_proj", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("attn.v_proj", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("attn.out_proj", Linear1D_Row, kwargs={"split": heads.q}),
                    Sub("attn.attn_dropout", DropoutForParallelInput),
                    Sub("attn.resid_dropout", DropoutForReplicatedInput),
                    Sub("mlp.fc_in", Linear1D_Col),
                    Sub("mlp.fc_out", Linear1D_Row),
                    Sub("mlp.dropout", DropoutForReplicatedInput),
                ],
            )
            policy[hf.GPTJModel] = ModulePolicyDescription(
                sub_module_replacement=[
                    Sub("wte", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs()),
                    Sub("drop", DropoutForReplicatedInput),
                ]
            )
            self.add_head(policy, hf)
        if self.shard_config.enable_fused_normalization:
            self.append_or_create_submodule_replacement(Sub("ln_1", FusedLayerNorm), policy, hf.GPTJBlock)
            self.append_or_create_submodule_replacement(Sub("ln_f", FusedLayerNorm), policy, hf.GPTJModel)
        return policy


class GPTJModelPolicy(GPTJPolicy):
    pass


class GPTJForCausalLMPolicy(GPTJPolicy):
    model_class, head = "GPTJForCausalLM", "lm_head"


class GPTJForSequenceClassificationPolicy(GPTJPolicy):
    model_class, head = "GPTJForSequenceClassification", "score"


class GPTJForQuestionAnsweringPolicy(GPTJPolicy):
    model_class, head = "GPTJForQuestionAnswering", "qa_outputs"
