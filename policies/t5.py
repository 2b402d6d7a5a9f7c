"""T5 (and the gated-GELU v1.1 variant): heads and feed-forward features
split in the encoder, the decoder and the cross attention; vocabulary-parallel
embeddings and LM head.

    T5Attention.{q,k,v}                      Linear1D_Col (per head)
    T5Attention.o                            Linear1D_Row
    T5Attention.relative_attention_bias      Embedding1D, table [buckets, n_heads] split by
                                             the same heads, not gathered: each rank adds
                                             the bias of its own heads (first layer only)
    DenseReluDense.wi (wi_0, wi_1)           Linear1D_Col
    DenseReluDense.wo                        Linear1D_Row
    shared, {encoder,decoder}.embed_tokens   VocabParallelEmbedding1D, re-tied after sharding
    lm_head                                  VocabParallelLMHead1D (tied to shared when HF ties it;
                                             transformers 5 always ties, and scales the decoder
                                             output by d_model**-0.5 unless the config was made
                                             with tie_word_embeddings=False; both left to HF)
    classification_head.out_proj / classifier / qa_outputs   Linear1D_Col, gathered
    dropouts: inside the feed-forward parallel, on hidden states replicated

T5Attention infers the head count from the projection width except where it
builds a zero position bias (n_heads) for layers without the bias table, so
n_heads and inner_dim become this rank's values.
"""
from __future__ import annotations

from torch import nn

from shardformer.layer import (
    DropoutForParallelInput,
    DropoutForReplicatedInput,
    Embedding1D,
    FusedRMSNorm,
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
)
from shardformer.layout import Heads
from shardformer.policy import ModulePolicyDescription, Policy
from shardformer.policy import SubModuleReplacementDescription as Sub

# Modules that may share the weight of a model's `shared` embedding.
_TIED = ("encoder.embed_tokens", "decoder.embed_tokens", "lm_head")


def _hf():
    from transformers.models.t5 import modeling_t5

    return modeling_t5


class T5Policy(Policy):
    def module_policy(self):
        hf = _hf()
        cfg = self.model.config
        heads = Heads(cfg.num_heads, cfg.num_heads, cfg.d_kv)
        self._ties = self._find_ties()
        policy = {}
        if self.tensor_parallel:
            policy[hf.T5Attention] = ModulePolicyDescription(
                attribute_replacement={"n_heads": heads.local_heads(), "inner_dim": heads.local_width(cfg.d_kv)},
                sub_module_replacement=[
                    Sub("q", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("k", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("v", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("o", Linear1D_Row, kwargs={"split": heads.q}),
                    Sub("relative_attention_bias", Embedding1D,
                        kwargs={"split": Heads(cfg.num_heads).q, "gather_output": False}, ignore_if_not_exist=True),
                ],
            )
            policy[hf.T5DenseActDense] = ModulePolicyDescription(sub_module_replacement=[
                Sub("wi", Linear1D_Col), Sub("wo", Linear1D_Row), Sub("dropout", DropoutForParallelInput)])
            policy[hf.T5DenseGatedActDense] = ModulePolicyDescription(sub_module_replacement=[
                Sub("wi_0", Linear1D_Col), Sub("wi_1", Linear1D_Col), Sub("wo", Linear1D_Row),
                Sub("dropout", DropoutForParallelInput)])
            for cls in (hf.T5LayerFF, hf.T5LayerSelfAttention, hf.T5LayerCrossAttention, hf.T5Stack):
                policy[cls] = ModulePolicyDescription(
                    sub_module_replacement=[Sub("dropout", DropoutForReplicatedInput)])
            embeddings = [Sub(name, VocabParallelEmbedding1D, kwargs=self.vocab_kwargs(), ignore_if_not_exist=True)
                          for name in ("shared", "encoder.embed_tokens", "decoder.embed_tokens")]
            for cls in (hf.T5Model, hf.T5EncoderModel, hf.T5ForConditionalGeneration, hf.T5ForQuestionAnswering):
                policy[cls] = ModulePolicyDescription(sub_module_replacement=list(embeddings))
        if self.shard_config.enable_fused_normalization:
            for cls in (hf.T5LayerFF, hf.T5LayerSelfAttention, hf.T5LayerCrossAttention):
                self.append_or_create_submodule_replacement(Sub("layer_norm", FusedRMSNorm), policy, cls)
            self.append_or_create_submodule_replacement(Sub("final_layer_norm", FusedRMSNorm), policy, hf.T5Stack)
        return policy

    def _find_ties(self) -> list[tuple[str, str]]:
        """(source, target) module paths whose weights are one Parameter now."""
        ties = []
        for path, module in self.model.named_modules():
            shared = getattr(module, "shared", None)
            if not isinstance(shared, nn.Embedding):
                continue
            prefix = f"{path}." if path else ""
            for name in _TIED:
                try:
                    target = module.get_submodule(name)
                except AttributeError:
                    continue
                if getattr(target, "weight", None) is shared.weight:
                    ties.append((f"{prefix}shared", f"{prefix}{name}"))
        return ties

    def postprocess(self):
        if self.tensor_parallel:
            for source, target in self._ties:
                self.tie_weight(source, target)
        return self.model

    def _head(self, policy, model_class: str, subs):
        if self.tensor_parallel:
            self.append_or_create_submodule_replacement(subs, policy, getattr(_hf(), model_class))
        return policy


def _gathered(suffix: str):
    return Sub(suffix, Linear1D_Col, kwargs={"gather_output": True})


class T5ModelPolicy(T5Policy):
    pass


class T5EncoderModelPolicy(T5Policy):
    pass


class T5ForConditionalGenerationPolicy(T5Policy):
    def module_policy(self):
        return self._head(super().module_policy(), "T5ForConditionalGeneration",
                          [Sub("lm_head", VocabParallelLMHead1D, kwargs=self.lm_head_kwargs())])


class T5ForSequenceClassificationPolicy(T5Policy):
    """T5ClassificationHead: dense replicated, out_proj gathered."""

    def module_policy(self):
        return self._head(super().module_policy(), "T5ForSequenceClassification", [
            Sub("classification_head.dropout", DropoutForReplicatedInput),
            _gathered("classification_head.out_proj")])


class T5ForTokenClassificationPolicy(T5Policy):
    def module_policy(self):
        return self._head(super().module_policy(), "T5ForTokenClassification", [
            Sub("dropout", DropoutForReplicatedInput), _gathered("classifier")])


class T5ForQuestionAnsweringPolicy(T5Policy):
    def module_policy(self):
        return self._head(super().module_policy(), "T5ForQuestionAnswering", [_gathered("qa_outputs")])
