"""BERT: attention heads and intermediate features split; vocabulary-parallel
word embeddings and MLM decoder.

    encoder.layer.*.attention.self.{query,key,value}   Linear1D_Col (per head)
    encoder.layer.*.attention.output.dense             Linear1D_Row
    encoder.layer.*.intermediate.dense                 Linear1D_Col
    encoder.layer.*.output.dense                       Linear1D_Row
    embeddings.word_embeddings                         VocabParallelEmbedding1D
    cls.predictions.decoder                            VocabParallelLMHead1D (tied, with its bias)
    classifier / qa_outputs / cls.seq_relationship     Linear1D_Col, gathered
    dropouts: attention probabilities parallel, hidden states replicated

BertSelfAttention infers the head count from the projection width; its
num_attention_heads and all_head_size become this rank's values.
"""
from __future__ import annotations

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


def _attention_subs(prefix: str, heads: Heads):
    return [
        Sub(f"{prefix}.self.query", Linear1D_Col, kwargs={"split": heads.q}),
        Sub(f"{prefix}.self.key", Linear1D_Col, kwargs={"split": heads.q}),
        Sub(f"{prefix}.self.value", Linear1D_Col, kwargs={"split": heads.q}),
        Sub(f"{prefix}.self.dropout", DropoutForParallelInput),
        Sub(f"{prefix}.output.dense", Linear1D_Row, kwargs={"split": heads.q}),
        Sub(f"{prefix}.output.dropout", DropoutForReplicatedInput),
    ]


def _attention_attrs(prefix: str, heads: Heads, head_dim: int):
    return {
        f"{prefix}.self.num_attention_heads": heads.local_heads(),
        f"{prefix}.self.all_head_size": heads.local_width(head_dim),
    }


class BertPolicy(Policy):
    def module_policy(self):
        from transformers.models.bert import modeling_bert as hf

        cfg = self.model.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        heads = Heads(cfg.num_attention_heads, cfg.num_attention_heads, head_dim)
        cross = bool(getattr(cfg, "add_cross_attention", False))
        policy = {}
        if self.tensor_parallel:
            attrs = _attention_attrs("attention", heads, head_dim)
            subs = _attention_subs("attention", heads)
            if cross:
                attrs.update(_attention_attrs("crossattention", heads, head_dim))
                subs += _attention_subs("crossattention", heads)
            subs += [
                Sub("intermediate.dense", Linear1D_Col),
                Sub("output.dense", Linear1D_Row),
                Sub("output.dropout", DropoutForReplicatedInput),
            ]
            policy[hf.BertLayer] = ModulePolicyDescription(attribute_replacement=attrs, sub_module_replacement=subs)
            policy[hf.BertEmbeddings] = ModulePolicyDescription(
                sub_module_replacement=[
                    Sub("word_embeddings", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs()),
                    Sub("dropout", DropoutForReplicatedInput),
                ]
            )
        if self.shard_config.enable_fused_normalization:
            norms = [Sub("attention.output.LayerNorm", FusedLayerNorm), Sub("output.LayerNorm", FusedLayerNorm)]
            if cross:
                norms.append(Sub("crossattention.output.LayerNorm", FusedLayerNorm))
            self.append_or_create_submodule_replacement(norms, policy, hf.BertLayer)
            self.append_or_create_submodule_replacement(Sub("LayerNorm", FusedLayerNorm), policy, hf.BertEmbeddings)
        if self.shard_config.enable_jit_fused:
            from shardformer.ops import bert_intermediate_forward, gelu_kind
            kind = gelu_kind(self.model.config.hidden_act)
            if kind is not None:   # the intermediate GeLU by the C kernel
                policy.setdefault(hf.BertIntermediate, ModulePolicyDescription()).method_replacement["forward"] = \
                    bert_intermediate_forward(kind)
        return policy


class BertModelPolicy(BertPolicy):
    pass


class _BertMLMPolicy(BertPolicy):
    """Models with cls.predictions: the decoder is split by vocabulary and
    tied to the word embeddings; its bias is cls.predictions.bias."""

    model_class = ""

    def module_policy(self):
        from transformers.models.bert import modeling_bert as hf

        policy = super().module_policy()
        if self.tensor_parallel:
            self.append_or_create_submodule_replacement(
                Sub("cls.predictions.decoder", VocabParallelLMHead1D, kwargs=self.lm_head_kwargs()),
                policy, getattr(hf, self.model_class))
        if self.shard_config.enable_fused_normalization:
            self.append_or_create_submodule_replacement(
                Sub("cls.predictions.transform.LayerNorm", FusedLayerNorm), policy, getattr(hf, self.model_class))
        return policy

    def postprocess(self):
        if self.tensor_parallel:
            if self.ties_word_embeddings():
                self.tie_weight("bert.embeddings.word_embeddings", "cls.predictions.decoder")
            # HF ties the decoder bias to cls.predictions.bias; keep them one Parameter.
            self.tie_weight("cls.predictions.decoder", "cls.predictions", name="bias")
        return self.model


class BertForPreTrainingPolicy(_BertMLMPolicy):
    model_class = "BertForPreTraining"

    def module_policy(self):
        from transformers.models.bert import modeling_bert as hf

        policy = super().module_policy()
        if self.tensor_parallel:
            self.append_or_create_submodule_replacement(
                Sub("cls.seq_relationship", Linear1D_Col, kwargs={"gather_output": True}),
                policy, hf.BertForPreTraining)
        return policy


class BertLMHeadModelPolicy(_BertMLMPolicy):
    model_class = "BertLMHeadModel"


class BertForMaskedLMPolicy(_BertMLMPolicy):
    model_class = "BertForMaskedLM"


class _BertHeadPolicy(BertPolicy):
    model_class = ""
    head = ""

    def module_policy(self):
        from transformers.models.bert import modeling_bert as hf

        policy = super().module_policy()
        if self.tensor_parallel:
            self.append_or_create_submodule_replacement(
                Sub(self.head, Linear1D_Col, kwargs={"gather_output": True}), policy, getattr(hf, self.model_class))
        return policy


class BertForSequenceClassificationPolicy(_BertHeadPolicy):
    model_class, head = "BertForSequenceClassification", "classifier"


class BertForTokenClassificationPolicy(_BertHeadPolicy):
    model_class, head = "BertForTokenClassification", "classifier"


class BertForNextSentencePredictionPolicy(_BertHeadPolicy):
    model_class, head = "BertForNextSentencePrediction", "cls.seq_relationship"


class BertForMultipleChoicePolicy(_BertHeadPolicy):
    model_class, head = "BertForMultipleChoice", "classifier"


class BertForQuestionAnsweringPolicy(_BertHeadPolicy):
    model_class, head = "BertForQuestionAnswering", "qa_outputs"
