"""T5 (and the gated-GELU v1.1 variant): heads and feed-forward features
split in the encoder, the decoder and the cross attention; vocabulary-parallel
embeddings and LM head.

    T5Attention.{q,k,v}                      Linear1D_Col (per head)
    T5Attention.o                            Linear1D_Row (all-reduce forward)
    T5Attention.relative_attention_bias      Embedding1D, table [buckets, n_heads] split by
                                             the same heads, not gathered: each rank adds
                                             the bias of its own heads (first layer only)
    DenseReluDense.wi (wi_0, wi_1)           Linear1D_Col
    DenseReluDense.wo                        Linear1D_Row (all-reduce forward)
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

from shardformer.family import Family, FamilyPolicy, gathered, lm, replicated_dropout
from shardformer.layer import (
    DropoutForParallelInput,
    DropoutForReplicatedInput,
    Embedding1D,
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelEmbedding1D,
)
from shardformer.layout import Heads
from shardformer.policy import ModulePolicyDescription
from shardformer.policy import SubModuleReplacementDescription as Sub

# Modules that may share the weight of a model's `shared` embedding (the LM
# head's tie is FamilyPolicy's, by identity with the input embeddings).
_TIED = ("encoder.embed_tokens", "decoder.embed_tokens")


class T5Shape(FamilyPolicy):
    def body_policy(self):
        if not self.tensor_parallel:
            return {}
        cfg = self.model.config
        heads = Heads(cfg.num_heads, cfg.num_heads, cfg.d_kv)
        policy = {
            "T5Attention": ModulePolicyDescription(
                attribute_replacement={"n_heads": heads.local_heads(), "inner_dim": heads.local_width(cfg.d_kv)},
                sub_module_replacement=[
                    Sub("q", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("k", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("v", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub("o", Linear1D_Row, kwargs={"split": heads.q}),
                    Sub("relative_attention_bias", Embedding1D,
                        kwargs={"split": Heads(cfg.num_heads).q, "gather_output": False}, ignore_if_not_exist=True),
                ]),
            "T5DenseActDense": ModulePolicyDescription(sub_module_replacement=[
                Sub("wi", Linear1D_Col), Sub("wo", Linear1D_Row), Sub("dropout", DropoutForParallelInput)]),
            "T5DenseGatedActDense": ModulePolicyDescription(sub_module_replacement=[
                Sub("wi_0", Linear1D_Col), Sub("wi_1", Linear1D_Col), Sub("wo", Linear1D_Row),
                Sub("dropout", DropoutForParallelInput)]),
        }
        for cls in ("T5LayerFF", "T5LayerSelfAttention", "T5LayerCrossAttention", "T5Stack"):
            policy[cls] = ModulePolicyDescription(sub_module_replacement=[Sub("dropout", DropoutForReplicatedInput)])
        # The classification / token models hold a T5Model / T5EncoderModel as `transformer`.
        for cls in ("T5Model", "T5EncoderModel", "T5ForConditionalGeneration", "T5ForQuestionAnswering"):
            policy[cls] = ModulePolicyDescription(sub_module_replacement=[
                Sub(name, VocabParallelEmbedding1D, kwargs=self.vocab_kwargs(), ignore_if_not_exist=True)
                for name in ("shared", "encoder.embed_tokens", "decoder.embed_tokens")])
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

    def preprocess(self):
        self._ties = self._find_ties()
        return super().preprocess()

    def postprocess(self):
        super().postprocess()
        if self.tensor_parallel:
            for source, target in self._ties:
                self.tie_weight(source, target)
        return self.model


FAMILY = Family("t5", "t5.modeling_t5", T5Shape, heads={
    "T5Model": (),
    "T5ForConditionalGeneration": lm("lm_head"),
    "T5EncoderModel": (),
    # T5ClassificationHead: dense (and its dropout) replicated, out_proj gathered.
    "T5ForSequenceClassification": (replicated_dropout("classification_head.dropout"),
                                    gathered("classification_head.out_proj")),
    "T5ForTokenClassification": (replicated_dropout("dropout"), gathered("classifier")),
    "T5ForQuestionAnswering": gathered("qa_outputs"),
})
globals().update(FAMILY.policy_classes())
