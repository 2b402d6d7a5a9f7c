"""RoBERTa: the BERT layer layout (heads and intermediate features split),
vocabulary-parallel word embeddings and LM head.

    encoder.layer.*.attention.self.{query,key,value}   Linear1D_Col (per head)
    encoder.layer.*.attention.output.dense             Linear1D_Row
    encoder.layer.*.crossattention.*                   same, when add_cross_attention
    encoder.layer.*.intermediate.dense                 Linear1D_Col
    encoder.layer.*.output.dense                       Linear1D_Row
    embeddings.word_embeddings                         VocabParallelEmbedding1D
    lm_head.decoder                                    VocabParallelLMHead1D (tied; its bias is lm_head.bias)
    classifier.out_proj / classifier / qa_outputs      Linear1D_Col, gathered
    dropouts: attention probabilities parallel, hidden states replicated

The self-attention infers its head count from the projection width; its
num_attention_heads and all_head_size become this rank's values.

`EncoderLayerPolicy` is shared with the other BERT-shaped families (ERNIE):
a family sets `hf_module` (the modeling module), `prefix` (class-name
prefix) and `base` (the attribute holding the base model in head classes).
"""
from __future__ import annotations

import importlib

from shardformer.layer import (
    DropoutForParallelInput,
    DropoutForReplicatedInput,
    FusedLayerNorm,
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
)
from shardformer.layout import Heads
from shardformer.policy import ModulePolicyDescription, Policy
from shardformer.policy import SubModuleReplacementDescription as Sub


def attention_block(prefix: str, heads: Heads, head_dim: int):
    """(attributes, sub-module replacements) of one BERT-style attention block
    at `prefix` (`attention` or `crossattention`): Q/K/V column-parallel by
    head, output dense row-parallel (all-reduce forward)."""
    attrs = {
        f"{prefix}.self.num_attention_heads": heads.local_heads(),
        f"{prefix}.self.all_head_size": heads.local_width(head_dim),
    }
    subs = [
        Sub(f"{prefix}.self.query", Linear1D_Col, kwargs={"split": heads.q}),
        Sub(f"{prefix}.self.key", Linear1D_Col, kwargs={"split": heads.q}),
        Sub(f"{prefix}.self.value", Linear1D_Col, kwargs={"split": heads.q}),
        Sub(f"{prefix}.self.dropout", DropoutForParallelInput),
        Sub(f"{prefix}.output.dense", Linear1D_Row, kwargs={"split": heads.q}),
        Sub(f"{prefix}.output.dropout", DropoutForReplicatedInput),
    ]
    return attrs, subs


class EncoderLayerPolicy(Policy):
    """Layers and embeddings of a BERT-shaped encoder."""

    hf_module = "transformers.models.roberta.modeling_roberta"
    prefix = "Roberta"
    base = "roberta"

    def hf(self, name: str):
        return getattr(importlib.import_module(self.hf_module), self.prefix + name)

    def module_policy(self):
        cfg = self.model.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        heads = Heads(cfg.num_attention_heads, cfg.num_attention_heads, head_dim)
        cross = bool(getattr(cfg, "add_cross_attention", False))
        policy = {}
        if self.tensor_parallel:
            attrs, subs = attention_block("attention", heads, head_dim)
            if cross:
                cross_attrs, cross_subs = attention_block("crossattention", heads, head_dim)
                attrs.update(cross_attrs)
                subs += cross_subs
            subs += [
                Sub("intermediate.dense", Linear1D_Col),
                Sub("output.dense", Linear1D_Row),
                Sub("output.dropout", DropoutForReplicatedInput),
            ]
            policy[self.hf("Layer")] = ModulePolicyDescription(attribute_replacement=attrs,
                                                               sub_module_replacement=subs)
            policy[self.hf("Embeddings")] = ModulePolicyDescription(sub_module_replacement=[
                Sub("word_embeddings", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs()),
                Sub("dropout", DropoutForReplicatedInput),
            ])
        if self.shard_config.enable_fused_normalization:
            norms = [Sub("attention.output.LayerNorm", FusedLayerNorm), Sub("output.LayerNorm", FusedLayerNorm)]
            if cross:
                norms.append(Sub("crossattention.output.LayerNorm", FusedLayerNorm))
            self.append_or_create_submodule_replacement(norms, policy, self.hf("Layer"))
            self.append_or_create_submodule_replacement(Sub("LayerNorm", FusedLayerNorm), policy,
                                                        self.hf("Embeddings"))
        return policy

    def add_subs(self, policy, model_class: str, subs):
        """Append `subs` to the entry of the head class `model_class`."""
        if self.tensor_parallel:
            self.append_or_create_submodule_replacement(subs, policy, self.hf(model_class))
        return policy

    def gathered(self, suffix: str):
        """A small classifier layer: column-parallel, outputs all-gathered."""
        return Sub(suffix, Linear1D_Col, kwargs={"gather_output": True})


class RobertaPolicy(EncoderLayerPolicy):
    pass


class RobertaModelPolicy(RobertaPolicy):
    pass


class _RobertaLMPolicy(RobertaPolicy):
    """lm_head.decoder split by vocabulary and tied to the word embeddings;
    HF ties the decoder bias to lm_head.bias, kept one Parameter here too."""

    model_class = ""

    def module_policy(self):
        policy = super().module_policy()
        self.add_subs(policy, self.model_class,
                      [Sub("lm_head.decoder", VocabParallelLMHead1D, kwargs=self.lm_head_kwargs())])
        if self.shard_config.enable_fused_normalization:
            self.append_or_create_submodule_replacement(Sub("lm_head.layer_norm", FusedLayerNorm), policy,
                                                        self.hf(self.model_class))
        return policy

    def postprocess(self):
        if self.tensor_parallel:
            if self.ties_word_embeddings():
                self.tie_weight(f"{self.base}.embeddings.word_embeddings", "lm_head.decoder")
            self.tie_weight("lm_head.decoder", "lm_head", name="bias")
        return self.model


class RobertaForMaskedLMPolicy(_RobertaLMPolicy):
    model_class = "ForMaskedLM"


class RobertaForCausalLMPolicy(_RobertaLMPolicy):
    model_class = "ForCausalLM"


class RobertaForSequenceClassificationPolicy(RobertaPolicy):
    """RobertaClassificationHead: dense stays replicated (its dropout too),
    out_proj is column-parallel and gathered."""

    def module_policy(self):
        return self.add_subs(super().module_policy(), "ForSequenceClassification", [
            Sub("classifier.dropout", DropoutForReplicatedInput),
            self.gathered("classifier.out_proj"),
        ])


class RobertaForTokenClassificationPolicy(RobertaPolicy):
    def module_policy(self):
        return self.add_subs(super().module_policy(), "ForTokenClassification", [
            Sub("dropout", DropoutForReplicatedInput), self.gathered("classifier")])


class RobertaForMultipleChoicePolicy(RobertaPolicy):
    def module_policy(self):
        return self.add_subs(super().module_policy(), "ForMultipleChoice", [
            Sub("dropout", DropoutForReplicatedInput), self.gathered("classifier")])


class RobertaForQuestionAnsweringPolicy(RobertaPolicy):
    def module_policy(self):
        return self.add_subs(super().module_policy(), "ForQuestionAnswering", [self.gathered("qa_outputs")])
