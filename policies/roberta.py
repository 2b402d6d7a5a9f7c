"""RoBERTa: the BERT-shaped encoder (policies/shapes.py EncoderShape): heads
and intermediate features split, vocabulary-parallel word embeddings and LM head.

    encoder.layer.*.attention.self.{query,key,value}   Linear1D_Col (per head)
    encoder.layer.*.attention.output.dense             Linear1D_Row (all-reduce forward)
    encoder.layer.*.crossattention.*                   same, when add_cross_attention
    encoder.layer.*.intermediate.dense                 Linear1D_Col
    encoder.layer.*.output.dense                       Linear1D_Row (all-reduce forward)
    embeddings.word_embeddings                         VocabParallelEmbedding1D
    lm_head.decoder                                    VocabParallelLMHead1D (tied when HF tied it;
                                                       its bias is lm_head.bias)
    classifier.dense                                   replicated (RobertaClassificationHead;
                                                       its dropout DropoutForReplicatedInput)
    classifier.out_proj / classifier / qa_outputs      Linear1D_Col, gathered
    dropouts: attention probabilities parallel, hidden states replicated

The self-attention infers its head count from the projection width; its
num_attention_heads and all_head_size become this rank's values.

Split-gather sequence parallelism (EncoderShape): hidden states split along
the sequence from the first encoder layer to the last; attention.self and
intermediate all-gather their input; the output denses reduce-scatter and
add their bias on this rank's rows; the hidden dropouts draw a mask per rank
and the LayerNorms get their gradients all-reduced.
"""
from shardformer.family import Family, gathered, lm, replicated_dropout
from shardformer.policies.shapes import EncoderShape

LM = lm("lm_head.decoder", bias_of="lm_head")                    # HF's loss_function
MLM_CE = lm("lm_head.decoder", bias_of="lm_head", loss="masked")  # nn.CrossEntropyLoss in forward
CLASSIFIER = (replicated_dropout("dropout"), gathered("classifier"))

FAMILY = Family("roberta", "roberta.modeling_roberta", EncoderShape, options={"prefix": "Roberta"}, heads={
    "RobertaModel": (),
    "RobertaForMaskedLM": MLM_CE,
    "RobertaForCausalLM": LM,
    # RobertaClassificationHead: dense (and its dropout) replicated, out_proj gathered.
    "RobertaForSequenceClassification": (replicated_dropout("classifier.dropout"), gathered("classifier.out_proj")),
    "RobertaForTokenClassification": CLASSIFIER,
    "RobertaForQuestionAnswering": gathered("qa_outputs"),
    "RobertaForMultipleChoice": CLASSIFIER,
})
globals().update(FAMILY.policy_classes())
