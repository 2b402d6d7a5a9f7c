"""ALBERT: one AlbertLayer per layer group, reused by every layer of the
group (num_hidden_layers calls, num_hidden_groups modules).  The sharder
plans each module object once, so the shared layer is split once and its
gradients accumulate over all the layers that call it, as in HF.

    albert_layers.*.attention.{query,key,value}   Linear1D_Col (per head)
    albert_layers.*.attention.dense               Linear1D_Row
    albert_layers.*.ffn                           Linear1D_Col
    albert_layers.*.ffn_output                    Linear1D_Row
    embeddings.word_embeddings                    VocabParallelEmbedding1D ([vocab, embedding_size])
    encoder.embedding_hidden_mapping_in           replicated (embedding_size -> hidden_size)
    predictions.decoder                           VocabParallelLMHead1D (tied; its bias is predictions.bias)
    classifier / qa_outputs / sop_classifier.classifier   Linear1D_Col, gathered

AlbertAttention infers the head count from the projection width; its
num_attention_heads and all_head_size become this rank's values.
"""
from __future__ import annotations

from shardformer.layer import (
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


def _hf():
    from transformers.models.albert import modeling_albert

    return modeling_albert


class AlbertPolicy(Policy):
    def module_policy(self):
        hf = _hf()
        cfg = self.model.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        heads = Heads(cfg.num_attention_heads, cfg.num_attention_heads, head_dim)
        policy = {}
        if self.tensor_parallel:
            policy[hf.AlbertLayer] = ModulePolicyDescription(
                attribute_replacement={
                    "attention.num_attention_heads": heads.local_heads(),
                    "attention.all_head_size": heads.local_width(head_dim),
                },
                sub_module_replacement=[
                    Sub("attention.query", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("attention.key", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("attention.value", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("attention.dense", Linear1D_Row, kwargs={"split": heads.q}),
                    Sub("attention.output_dropout", DropoutForReplicatedInput),
                    Sub("ffn", Linear1D_Col),
                    Sub("ffn_output", Linear1D_Row),
                    Sub("dropout", DropoutForReplicatedInput),
                ],
            )
            policy[hf.AlbertEmbeddings] = ModulePolicyDescription(sub_module_replacement=[
                Sub("word_embeddings", VocabParallelEmbedding1D, kwargs=self.vocab_kwargs()),
                Sub("dropout", DropoutForReplicatedInput),
            ])
        if self.shard_config.enable_fused_normalization:
            self.append_or_create_submodule_replacement(
                [Sub("attention.LayerNorm", FusedLayerNorm), Sub("full_layer_layer_norm", FusedLayerNorm)],
                policy, hf.AlbertLayer)
            self.append_or_create_submodule_replacement(Sub("LayerNorm", FusedLayerNorm), policy,
                                                        hf.AlbertEmbeddings)
        return policy

    def _head(self, policy, model_class: str, subs):
        if self.tensor_parallel:
            self.append_or_create_submodule_replacement(subs, policy, getattr(_hf(), model_class))
        return policy


def _gathered(suffix: str):
    return Sub(suffix, Linear1D_Col, kwargs={"gather_output": True})


class AlbertModelPolicy(AlbertPolicy):
    pass


class _AlbertMLMPolicy(AlbertPolicy):
    model_class = ""
    extra: tuple = ()

    def module_policy(self):
        subs = [Sub("predictions.decoder", VocabParallelLMHead1D, kwargs=self.lm_head_kwargs()), *self.extra]
        return self._head(super().module_policy(), self.model_class, subs)

    def postprocess(self):
        if self.tensor_parallel:
            if self.ties_word_embeddings():
                self.tie_weight("albert.embeddings.word_embeddings", "predictions.decoder")
            self.tie_weight("predictions.decoder", "predictions", name="bias")
        return self.model


class AlbertForPreTrainingPolicy(_AlbertMLMPolicy):
    model_class = "AlbertForPreTraining"
    extra = (Sub("sop_classifier.dropout", DropoutForReplicatedInput), _gathered("sop_classifier.classifier"))


class AlbertForMaskedLMPolicy(_AlbertMLMPolicy):
    model_class = "AlbertForMaskedLM"


class _AlbertHeadPolicy(AlbertPolicy):
    model_class = ""
    head = "classifier"

    def module_policy(self):
        subs = [_gathered(self.head)]
        if self.head == "classifier":
            subs.append(Sub("dropout", DropoutForReplicatedInput))
        return self._head(super().module_policy(), self.model_class, subs)


class AlbertForSequenceClassificationPolicy(_AlbertHeadPolicy):
    model_class = "AlbertForSequenceClassification"


class AlbertForTokenClassificationPolicy(_AlbertHeadPolicy):
    model_class = "AlbertForTokenClassification"


class AlbertForMultipleChoicePolicy(_AlbertHeadPolicy):
    model_class = "AlbertForMultipleChoice"


class AlbertForQuestionAnsweringPolicy(_AlbertHeadPolicy):
    model_class, head = "AlbertForQuestionAnswering", "qa_outputs"
