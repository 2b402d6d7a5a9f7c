"""ERNIE: the BERT layer layout (see policies/roberta.py EncoderLayerPolicy)
with ERNIE's optional task-type embeddings (kept replicated).

    encoder.layer.*                     heads / intermediate features split
    embeddings.word_embeddings          VocabParallelEmbedding1D
    cls.predictions.decoder             VocabParallelLMHead1D (tied; its bias is cls.predictions.bias)
    cls.seq_relationship / classifier / qa_outputs   Linear1D_Col, gathered
"""
from __future__ import annotations

from shardformer.layer import DropoutForReplicatedInput, FusedLayerNorm, VocabParallelLMHead1D
from shardformer.policy import SubModuleReplacementDescription as Sub

from .roberta import EncoderLayerPolicy


class ErniePolicy(EncoderLayerPolicy):
    hf_module = "transformers.models.ernie.modeling_ernie"
    prefix = "Ernie"
    base = "ernie"


class ErnieModelPolicy(ErniePolicy):
    pass


class _ErnieMLMPolicy(ErniePolicy):
    model_class = ""
    extra: tuple[str, ...] = ()

    def module_policy(self):
        policy = super().module_policy()
        subs = [Sub("cls.predictions.decoder", VocabParallelLMHead1D, kwargs=self.lm_head_kwargs())]
        subs += [self.gathered(s) for s in self.extra]
        self.add_subs(policy, self.model_class, subs)
        if self.shard_config.enable_fused_normalization:
            self.append_or_create_submodule_replacement(
                Sub("cls.predictions.transform.LayerNorm", FusedLayerNorm), policy, self.hf(self.model_class))
        return policy

    def postprocess(self):
        if self.tensor_parallel:
            if self.ties_word_embeddings():
                self.tie_weight("ernie.embeddings.word_embeddings", "cls.predictions.decoder")
            self.tie_weight("cls.predictions.decoder", "cls.predictions", name="bias")
        return self.model


class ErnieForPreTrainingPolicy(_ErnieMLMPolicy):
    model_class, extra = "ForPreTraining", ("cls.seq_relationship",)


class ErnieForMaskedLMPolicy(_ErnieMLMPolicy):
    model_class = "ForMaskedLM"


class ErnieForCausalLMPolicy(_ErnieMLMPolicy):
    model_class = "ForCausalLM"


class _ErnieHeadPolicy(ErniePolicy):
    model_class = ""
    head = "classifier"
    dropout = True

    def module_policy(self):
        subs = [self.gathered(self.head)]
        if self.dropout:
            subs.append(Sub("dropout", DropoutForReplicatedInput))
        return self.add_subs(super().module_policy(), self.model_class, subs)


class ErnieForNextSentencePredictionPolicy(_ErnieHeadPolicy):
    model_class, head, dropout = "ForNextSentencePrediction", "cls.seq_relationship", False


class ErnieForSequenceClassificationPolicy(_ErnieHeadPolicy):
    model_class = "ForSequenceClassification"


class ErnieForMultipleChoicePolicy(_ErnieHeadPolicy):
    model_class = "ForMultipleChoice"


class ErnieForTokenClassificationPolicy(_ErnieHeadPolicy):
    model_class = "ForTokenClassification"


class ErnieForQuestionAnsweringPolicy(_ErnieHeadPolicy):
    model_class, head, dropout = "ForQuestionAnswering", "qa_outputs", False
