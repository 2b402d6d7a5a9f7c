"""GPT-Neo: attention heads and MLP features split; vocabulary-parallel wte and
LM head (tied to wte).

    h.*.attn.attention.q_proj, k_proj, v_proj   Linear1D_Col (per head)
    h.*.attn.attention.out_proj                 Linear1D_Row
    h.*.mlp.c_fc / c_proj                       Linear1D_Col / Linear1D_Row
    wte                                         VocabParallelEmbedding1D
    lm_head                                     VocabParallelLMHead1D
    score / classifier / qa_outputs             Linear1D_Col, gathered
    dropouts                                    parallel on attention probabilities,
                                                replicated after row-parallel layers

GPTNeoSelfAttention splits and merges heads with self.num_heads, so that
becomes this rank's head count (global and local attention layers alike).
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


class GPTNeoPolicy(DecoderPolicy):
    hf_module = "gpt_neo.modeling_gpt_neo"
    tie_source = "transformer.wte"

    def config_sanity_check(self):
        pass

    def module_policy(self):
        hf = self.hf()
        cfg = self.model.config
        heads = Heads(cfg.num_heads, cfg.num_heads, cfg.hidden_size // cfg.num_heads)
        policy = {}
        if self.tensor_parallel:
            policy[hf.GPTNeoBlock] = ModulePolicyDescription(
                attribute_replacement={"attn.attention.num_heads": heads.local_heads()},
                sub_module_replacement=[
                    Sub("attn.attention.q_proj", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("attn.attention.k_proj", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("attn.attention.v_proj", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("attn.attention.out_proj", Linear1D_Row, kwargs={"split": heads.q}),
                    Sub("attn.attention.attn_dropout", DropoutForParallelInput),
                    Sub("attn.attention.resid_dropout", DropoutForReplicatedInput),
                    Sub("mlp.c_fc", Linear1D_Col),
                    Sub("mlp.c_proj", Linear1D_Row),
                    Sub("mlp.dropout", DropoutForReplicatedInput),
                ],
            )
            policy[hf.GPTNeoModel] = ModulePolicyDescription(
                sub_module_replacement=[
                    Sub("wte", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs()),
                    Sub("drop", DropoutForReplicatedInput),
                ]
            )
            self.add_head(policy, hf)
        if self.shard_config.enable_fused_normalization:
            self.append_or_create_submodule_replacement(
                [Sub("ln_1", FusedLayerNorm), Sub("ln_2", FusedLayerNorm)], policy, hf.GPTNeoBlock)
            self.append_or_create_submodule_replacement(Sub("ln_f", FusedLayerNorm), policy, hf.GPTNeoModel)
        return policy


class GPTNeoModelPolicy(GPTNeoPolicy):
    pass


class GPTNeoForCausalLMPolicy(GPTNeoPolicy):
    model_class, head = "GPTNeoForCausalLM", "lm_head"


class GPTNeoForSequenceClassificationPolicy(GPTNeoPolicy):
    model_class, head = "GPTNeoForSequenceClassification", "score"


class GPTNeoForTokenClassificationPolicy(GPTNeoPolicy):
    model_class, head = "GPTNeoForTokenClassification", "classifier"


class GPTNeoForQuestionAnsweringPolicy(GPTNeoPolicy):
    model_class, head = "GPTNeoForQuestionAnswering", "qa_outputs"
