"""BERT: the BERT-shaped encoder (policies/shapes.py EncoderShape): attention
heads and intermediate features split; vocabulary-parallel word embeddings
and MLM decoder.

    encoder.layer.*.attention.self.{query,key,value}   Linear1D_Col (per head)
    encoder.layer.*.attention.output.dense             Linear1D_Row (all-reduce forward)
    encoder.layer.*.crossattention.*                   same, when add_cross_attention
    encoder.layer.*.intermediate.dense                 Linear1D_Col
    encoder.layer.*.output.dense                       Linear1D_Row (all-reduce forward)
    embeddings.word_embeddings                         VocabParallelEmbedding1D
    cls.predictions.decoder                            VocabParallelLMHead1D (tied when HF tied it;
                                                       its bias is cls.predictions.bias)
    classifier / qa_outputs / cls.seq_relationship     Linear1D_Col, gathered
    dropouts: attention probabilities parallel, hidden states replicated

BertSelfAttention infers the head count from the projection width; its
num_attention_heads and all_head_size become this rank's values.

Split-gather sequence parallelism (EncoderShape): hidden states split along
the sequence from the first encoder layer to the last; attention.self and
intermediate all-gather their input; the output denses reduce-scatter and
add their bias on this rank's rows; the hidden dropouts draw a mask per rank
and the LayerNorms get their gradients all-reduced.
"""
from shardformer.family import Family, gathered, lm
from shardformer.policies.shapes import EncoderShape

# BertLMHeadModel's loss goes through HF's loss_function; the other two call
# nn.CrossEntropyLoss themselves (pre-training adds the next-sentence loss).
MLM = lm("cls.predictions.decoder", bias_of="cls.predictions")
MLM_CE = lm("cls.predictions.decoder", bias_of="cls.predictions", loss="masked")
PRETRAIN = lm("cls.predictions.decoder", bias_of="cls.predictions", loss="masked",
              also=("next_sentence_label", "seq_relationship_logits"))

FAMILY = Family("bert", "bert.modeling_bert", EncoderShape, options={"prefix": "Bert"}, heads={
    "BertModel": (),
    "BertForPreTraining": (PRETRAIN, gathered("cls.seq_relationship")),
    "BertLMHeadModel": MLM,
    "BertForMaskedLM": MLM_CE,
    "BertForSequenceClassification": gathered("classifier"),
    "BertForTokenClassification": gathered("classifier"),
    "BertForNextSentencePrediction": gathered("cls.seq_relationship"),
    "BertForMultipleChoice": gathered("classifier"),
    "BertForQuestionAnswering": gathered("qa_outputs"),
})
globals().update(FAMILY.policy_classes())
