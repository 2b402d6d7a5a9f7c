"""GPT-2: HF Conv1D projections split per head; vocabulary-parallel wte/lm_head.
The GPT-style block of policies/shapes.py (GPTBlockShape) with GPT-2's fused,
transposed (Conv1D) projections:

    h.*.attn.c_attn     GPT2FusedLinearConv1D_Col  ([q | k | v], each split per head)
    h.*.attn.c_proj     GPT2FusedLinearConv1D_Row
    h.*.mlp.c_fc        GPT2FusedLinearConv1D_Col  (one segment, features)
    h.*.mlp.c_proj      GPT2FusedLinearConv1D_Row
    wte                 VocabParallelEmbedding1D
    lm_head             VocabParallelLMHead1D (tied to wte when HF tied it)
    dropouts            replicated after row-parallel layers, parallel on attention probabilities
    score / classifier / qa_outputs   Linear1D_Col, gathered
    multiple_choice_head (GPT2DoubleHeadsModel)   replicated (one output)

GPT2Attention splits c_attn's output by `split_size`, so that (and the head
count and embed_dim it keeps) becomes this rank's value; head_dim is unchanged.

Split-gather sequence parallelism as GPTBlockShape's: the hidden states split
along the sequence between h.0 and the last block; attn and mlp all-gather
their input; c_attn / c_fc take sequence_parallel=True; attn.c_proj and
mlp.c_proj reduce-scatter their partial sums along the sequence and add the
bias on this rank's rows (bias gradient all-reduced); attn.resid_dropout and
mlp.dropout draw a mask per rank; ln_1 and ln_2 get their gradients
all-reduced.  With ShardConfig.enable_sequence_overlap, c_attn and c_fc
gather their input rows themselves (c_attn: the exact sequence, c_fc: the
padded rows), overlapping the all-gather with the matmul of this rank's rows
and, backward, the reduce-scatter of dX with dW.
GPT-2 as a decoder with cross attention (add_cross_attention) is refused.
"""
from __future__ import annotations

from shardformer.family import Family, gathered, lm
from shardformer.layer.sequence_layout import ENTER
from shardformer.policies.shapes import GPTBlockShape
from shardformer.spec import Attribute, Entry, Refusal, Region


class GPT2Shape(GPTBlockShape):
    split_attention_at = ("GPT2Model", "h")

    def refusals(self):
        return (Refusal("add_cross_attention", allowed=(False, None), default=False, when=("tensor_parallel",),
                        message="{model}: add_cross_attention={value} (GPT-2 as a decoder with cross attention) is "
                                "not supported by the GPT-2 policy"),)

    def attention_attribute_rows(self):
        return (Attribute("attn.num_heads", "heads"), Attribute("attn.split_size", "width"),
                Attribute("attn.embed_dim", "width"))

    def attention_entries(self):
        # with overlap c_attn, the attention's only reader of its input, gathers the exact sequence itself
        return (Entry("attn.c_attn", "conv1d_colwise_qkv", sp="gather_exact"),
                Entry("attn.c_proj", "conv1d_rowwise_heads"))

    def mlp_entries(self):
        return Entry("mlp.c_fc", "conv1d_colwise", sp="gather"), Entry("mlp.c_proj", "conv1d_rowwise")

    def entered(self):
        return Region("attn", ENTER, ("no_overlap",)), Region("mlp", ENTER, ("no_overlap",))


FAMILY = Family("gpt2", "gpt2.modeling_gpt2", GPT2Shape, options={"prefix": "GPT2"}, heads={
    "GPT2Model": (),
    "GPT2LMHeadModel": lm("lm_head"),
    # the multiple-choice summary head stays replicated; its LM loss is nn.CrossEntropyLoss in forward
    "GPT2DoubleHeadsModel": lm("lm_head", loss="causal"),
    "GPT2ForSequenceClassification": gathered("score"),
    "GPT2ForTokenClassification": gathered("classifier"),
    "GPT2ForQuestionAnswering": gathered("qa_outputs"),
})
globals().update(FAMILY.policy_classes())
