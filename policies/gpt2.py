"""GPT-2: HF Conv1D projections split per head; vocabulary-parallel wte/lm_head.

    h.*.attn.c_attn     GPT2FusedLinearConv1D_Col  ([q | k | v], each split per head)
    h.*.attn.c_proj     GPT2FusedLinearConv1D_Row
    h.*.mlp.c_fc        GPT2FusedLinearConv1D_Col  (one segment, features)
    h.*.mlp.c_proj      GPT2FusedLinearConv1D_Row
    wte                 VocabParallelEmbedding1D
    lm_head             VocabParallelLMHead1D (tied to wte)
    dropouts            replicated after row-parallel layers, parallel on attention probabilities
    score / classifier / qa_outputs   Linear1D_Col, gathered

GPT2Attention splits c_attn's output by `split_size`, so that (and the head
count it keeps) becomes this rank's value; head_dim is unchanged.
"""
from __future__ import annotations

from shardformer.layer import (
    DropoutForParallelInput,
    DropoutForReplicatedInput,
    FusedLayerNorm,
    GPT2FusedLinearConv1D_Col,
    GPT2FusedLinearConv1D_Row,
    Linear1D_Col,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
)
from shardformer.layout import Heads, Split
from shardformer.policy import ModulePolicyDescription, Policy
from shardformer.policy import SubModuleReplacementDescription as Sub


class GPT2Policy(Policy):
    def config_sanity_check(self):
        cfg = self.model.config
        if self.tensor_parallel and getattr(cfg, "add_cross_attention", False):
            raise ValueError(f"{type(self.model).__name__}: add_cross_attention=True (GPT-2 as a decoder with "
                             "cross attention) is not supported by the GPT-2 policy")

    def module_policy(self):
        from transformers.models.gpt2 import modeling_gpt2 as hf

        cfg = self.model.config
        head_dim = cfg.n_embd // cfg.n_head
        heads = Heads(cfg.n_head, cfg.n_head, head_dim)
        policy = {}
        if self.tensor_parallel:
            policy[hf.GPT2Model] = ModulePolicyDescription(
                sub_module_replacement=[
                    Sub("wte", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs()),
                    Sub("drop", DropoutForReplicatedInput),
                ]
            )
            policy[hf.GPT2Block] = ModulePolicyDescription(
                attribute_replacement={
                    "attn.num_heads": heads.local_heads(),
                    "attn.split_size": heads.local_width(head_dim),
                    "attn.embed_dim": heads.local_width(head_dim),
                },
                sub_module_replacement=[
                    Sub("attn.c_attn", GPT2FusedLinearConv1D_Col, kwargs={"split": heads.qkv}),
                    Sub("attn.c_proj", GPT2FusedLinearConv1D_Row, kwargs={"split": heads.q}),
                    Sub("attn.attn_dropout", DropoutForParallelInput),
                    Sub("attn.resid_dropout", DropoutForReplicatedInput),
                    Sub("mlp.c_fc", GPT2FusedLinearConv1D_Col, kwargs={"split": Split()}),
                    Sub("mlp.c_proj", GPT2FusedLinearConv1D_Row, kwargs={"split": Split()}),
                    Sub("mlp.dropout", DropoutForReplicatedInput),
                ],
            )
        if self.shard_config.enable_fused_normalization:
            self.append_or_create_submodule_replacement(
                [Sub("ln_1", FusedLayerNorm), Sub("ln_2", FusedLayerNorm)], policy, hf.GPT2Block)
            self.append_or_create_submodule_replacement(Sub("ln_f", FusedLayerNorm), policy, hf.GPT2Model)
        if self.shard_config.enable_jit_fused:
            from shardformer.ops import gelu_kind, gpt2_mlp_forward
            kind = gelu_kind(self.model.config.activation_function)
            if kind is not None:   # the MLP's GeLU by the C kernel
                policy.setdefault(hf.GPT2MLP, ModulePolicyDescription()).method_replacement["forward"] = \
                    gpt2_mlp_forward(kind)
        return policy


class GPT2ModelPolicy(GPT2Policy):
    pass


class _GPT2LMPolicy(GPT2Policy):
    model_class = ""

    def module_policy(self):
        from transformers.models.gpt2 import modeling_gpt2 as hf

        policy = super().module_policy()
        if self.tensor_parallel:
            self.append_or_create_submodule_replacement(
                Sub("lm_head", VocabParallelLMHead1D, kwargs=self.lm_head_kwargs()),
                policy, getattr(hf, self.model_class))
        return policy

    def postprocess(self):
        if self.tensor_parallel and self.ties_word_embeddings():
            self.tie_weight("transformer.wte", "lm_head")
        return self.model


class GPT2LMHeadModelPolicy(_GPT2LMPolicy):
    model_class = "GPT2LMHeadModel"


class GPT2DoubleHeadsModelPolicy(_GPT2LMPolicy):
    """LM head split by vocabulary; the multiple-choice summary head (one
    output) stays replicated."""

    model_class = "GPT2DoubleHeadsModel"


class _GPT2HeadPolicy(GPT2Policy):
    model_class = ""
    head = ""

    def module_policy(self):
        from transformers.models.gpt2 import modeling_gpt2 as hf

        policy = super().module_policy()
        if self.tensor_parallel:
            self.append_or_create_submodule_replacement(
                Sub(self.head, Linear1D_Col, kwargs={"gather_output": True}), policy, getattr(hf, self.model_class))
        return policy


class GPT2ForSequenceClassificationPolicy(_GPT2HeadPolicy):
    model_class, head = "GPT2ForSequenceClassification", "score"


class GPT2ForTokenClassificationPolicy(_GPT2HeadPolicy):
    model_class, head = "GPT2ForTokenClassification", "classifier"


class GPT2ForQuestionAnsweringPolicy(_GPT2HeadPolicy):
    model_class, head = "GPT2ForQuestionAnswering", "qa_outputs"
