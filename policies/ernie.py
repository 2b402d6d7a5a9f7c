"""ERNIE: the BERT-shaped encoder (policies/shapes.py EncoderShape) with
ERNIE's optional task-type embeddings (kept replicated).

    encoder.layer.*.attention.self.{query,key,value}   Linear1D_Col (per head)
    encoder.layer.*.attention.output.dense             Linear1D_Row (all-reduce forward)
    encoder.layer.*.intermediate.dense / output.dense  Linear1D_Col / Linear1D_Row
    embeddings.word_embeddings                         VocabParallelEmbedding1D
    cls.predictions.decoder                            VocabParallelLMHead1D (tied when HF tied it;
                                                       its bias is cls.predictions.bias)
    cls.seq_relationship / classifier / qa_outputs     Linear1D_Col, gathered
    dropout before the classifier                      DropoutForReplicatedInput

Split-gather sequence parallelism (EncoderShape): hidden states split along
the sequence from the first encoder layer to the last; attention.self and
intermediate all-gather their input; the output denses reduce-scatter and
add their bias on this rank's rows; the hidden dropouts draw a mask per rank
and the LayerNorms get their gradients all-reduced.
"""
from shardformer.family import Family, gathered, lm, replicated_dropout
from shardformer.policies.shapes import EncoderShape

# ErnieForCausalLM's loss goes through HF's loss_function; the other two call
# nn.CrossEntropyLoss themselves (pre-training adds the next-sentence loss).
MLM = lm("cls.predictions.decoder", bias_of="cls.predictions")
MLM_CE = lm("cls.predictions.decoder", bias_of="cls.predictions", loss="masked")
PRETRAIN = lm("cls.predictions.decoder", bias_of="cls.predictions", loss="masked",
              also=("next_sentence_label", "seq_relationship_logits"))
NSP = gathered("cls.seq_relationship")
CLASSIFIER = (gathered("classifier"), replicated_dropout("dropout"))

FAMILY = Family("ernie", "ernie.modeling_ernie", EncoderShape, options={"prefix": "Ernie"}, heads={
    "ErnieModel": (),
    "ErnieForPreTraining": (PRETRAIN, NSP),
    "ErnieForCausalLM": MLM,
    "ErnieForMaskedLM": MLM_CE,
    "ErnieForNextSentencePrediction": NSP,
    "ErnieForSequenceClassification": CLASSIFIER,
    "ErnieForMultipleChoice": CLASSIFIER,
    "ErnieForTokenClassification": CLASSIFIER,
    "ErnieForQuestionAnswering": gathered("qa_outputs"),
})
globals().update(FAMILY.policy_classes())
