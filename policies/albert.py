"""ALBERT: one AlbertLayer per layer group, reused by every layer of the
group (num_hidden_layers calls, num_hidden_groups modules).  The sharder
plans each module object once, so the shared layer is split once and its
gradients accumulate over all the layers that call it, as in HF.

    albert_layers.*.attention.{query,key,value}   Linear1D_Col (per head)
    albert_layers.*.attention.dense               Linear1D_Row (all-reduce forward)
    albert_layers.*.ffn                           Linear1D_Col
    albert_layers.*.ffn_output                    Linear1D_Row (all-reduce forward)
    albert_layers.*.{attention.output_dropout, dropout}, embeddings.dropout
                                                  DropoutForReplicatedInput
    embeddings.word_embeddings                    VocabParallelEmbedding1D ([vocab, embedding_size])
    encoder.embedding_hidden_mapping_in           replicated (embedding_size -> hidden_size)
    predictions.decoder                           VocabParallelLMHead1D (tied when HF tied it;
                                                  its bias is predictions.bias)
    classifier / qa_outputs / sop_classifier.classifier   Linear1D_Col, gathered

The embeddings are the BERT-shaped encoder's (policies/shapes.py
EncoderShape); the layer is ALBERT's own.  AlbertAttention infers the head
count from the projection width; its num_attention_heads and all_head_size
become this rank's values.
"""
from __future__ import annotations

from shardformer.family import Family, gathered, lm, replicated_dropout
from shardformer.layer import DropoutForReplicatedInput, Linear1D_Col, Linear1D_Row
from shardformer.layout import Heads
from shardformer.policies.shapes import EncoderShape, attention_by_heads
from shardformer.policy import ModulePolicyDescription
from shardformer.policy import SubModuleReplacementDescription as Sub


class AlbertShape(EncoderShape):
    def layer_description(self, heads: Heads) -> ModulePolicyDescription:
        return ModulePolicyDescription(
            attribute_replacement={"attention.num_attention_heads": heads.local_heads(),
                                   "attention.all_head_size": heads.local_width(heads.head_dim)},
            sub_module_replacement=[
                *attention_by_heads("attention", heads, q="query", k="key", v="value", o="dense"),
                Sub("attention.output_dropout", DropoutForReplicatedInput),
                Sub("ffn", Linear1D_Col),
                Sub("ffn_output", Linear1D_Row),
                Sub("dropout", DropoutForReplicatedInput),
            ])


MLM = lm("predictions.decoder", bias_of="predictions")
CLASSIFIER = (gathered("classifier"), replicated_dropout("dropout"))

FAMILY = Family("albert", "albert.modeling_albert", AlbertShape, options={"prefix": "Albert"}, heads={
    "AlbertModel": (),
    "AlbertForPreTraining": (MLM, replicated_dropout("sop_classifier.dropout"),
                             gathered("sop_classifier.classifier")),
    "AlbertForMaskedLM": MLM,
    "AlbertForSequenceClassification": CLASSIFIER,
    "AlbertForTokenClassification": CLASSIFIER,
    "AlbertForQuestionAnswering": gathered("qa_outputs"),
    "AlbertForMultipleChoice": CLASSIFIER,
})
globals().update(FAMILY.policy_classes())
