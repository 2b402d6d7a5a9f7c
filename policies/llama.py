"""Llama: attention heads (with grouped-query KV heads) and MLP features split
over the tensor-parallel group; embeddings and the LM head split by vocabulary.

    self_attn.q_proj, k_proj, v_proj   Linear1D_Col  (per head; KV heads
                                                      replicated when fewer than ranks)
    self_attn.o_proj                   Linear1D_Row
    mlp.gate_proj, mlp.up_proj         Linear1D_Col
    mlp.down_proj                      Linear1D_Row
    model.embed_tokens                 VocabParallelEmbedding1D
    lm_head                            VocabParallelLMHead1D (tied when the config ties)
    score / qa_outputs                 Linear1D_Col, gathered (any label count)

HF's attention infers the head count from the projection width, so only
num_key_value_groups changes per rank.
"""
from __future__ import annotations

from shardformer.layer import (
    FusedRMSNorm,
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
)
from shardformer.layout import Heads
from shardformer.policy import ModulePolicyDescription, Policy
from shardformer.policy import SubModuleReplacementDescription as Sub


class LlamaPolicy(Policy):
    def config_sanity_check(self):
        cfg = self.model.config
        if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
            raise ValueError(f"{type(self.model).__name__}: pretraining_tp={cfg.pretraining_tp} is not supported "
                             "(set it to 1)")

    def module_policy(self):
        from transformers.models.llama import modeling_llama as hf

        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        heads = Heads(cfg.num_attention_heads, kv, head_dim)
        policy = {}
        if self.tensor_parallel:
            policy[hf.LlamaDecoderLayer] = ModulePolicyDescription(
                attribute_replacement={"self_attn.num_key_value_groups": heads.local_groups()},
                sub_module_replacement=[
                    Sub("self_attn.q_proj", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("self_attn.k_proj", Linear1D_Col, kwargs={"split": heads.kv}),
                    Sub("self_attn.v_proj", Linear1D_Col, kwargs={"split": heads.kv}),
                    Sub("self_attn.o_proj", Linear1D_Row, kwargs={"split": heads.q}),
                    Sub("mlp.gate_proj", Linear1D_Col),
                    Sub("mlp.up_proj", Linear1D_Col),
                    Sub("mlp.down_proj", Linear1D_Row),
                ],
            )
            policy[hf.LlamaModel] = ModulePolicyDescription(
                sub_module_replacement=[Sub("embed_tokens", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs())]
            )
        if self.shard_config.enable_fused_normalization:
            self.append_or_create_submodule_replacement(
                [Sub("input_layernorm", FusedRMSNorm), Sub("post_attention_layernorm", FusedRMSNorm)],
                policy, hf.LlamaDecoderLayer)
            self.append_or_create_submodule_replacement(Sub("norm", FusedRMSNorm), policy, hf.LlamaModel)
        if self.shard_config.enable_jit_fused:
            if getattr(cfg, "hidden_act", None) in ("silu", "swish"):   # SwiGLU in one C kernel
                from shardformer.ops import llama_mlp_forward
                policy.setdefault(hf.LlamaMLP, ModulePolicyDescription()).method_replacement["forward"] = \
                    llama_mlp_forward
        return policy


class LlamaModelPolicy(LlamaPolicy):
    pass


class LlamaForCausalLMPolicy(LlamaPolicy):
    def module_policy(self):
        from transformers.models.llama import modeling_llama as hf

        policy = super().module_policy()
        if self.tensor_parallel:
            self.append_or_create_submodule_replacement(
                Sub("lm_head", VocabParallelLMHead1D, kwargs=self.lm_head_kwargs()), policy, hf.LlamaForCausalLM)
        return policy

    def postprocess(self):
        if self.tensor_parallel and self.ties_word_embeddings():
            self.tie_weight("model.embed_tokens", "lm_head")
        return self.model


class _LlamaHeadPolicy(LlamaPolicy):
    """A Llama base model with a small classifier head, split and gathered."""

    head_class = ""
    head = ""

    def module_policy(self):
        from transformers.models.llama import modeling_llama as hf

        policy = super().module_policy()
        if self.tensor_parallel:
            self.append_or_create_submodule_replacement(
                Sub(self.head, Linear1D_Col, kwargs={"gather_output": True}), policy, getattr(hf, self.head_class))
        return policy


class LlamaForSequenceClassificationPolicy(_LlamaHeadPolicy):
    head_class, head = "LlamaForSequenceClassification", "score"


class LlamaForTokenClassificationPolicy(_LlamaHeadPolicy):
    head_class, head = "LlamaForTokenClassification", "score"


class LlamaForQuestionAnsweringPolicy(_LlamaHeadPolicy):
    head_class, head = "LlamaForQuestionAnswering", "qa_outputs"
