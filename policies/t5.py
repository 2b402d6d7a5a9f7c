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
    shared, {encoder,decoder}.embed_tokens   VocabParallelEmbedding1D, still one Parameter (spec ties)
    lm_head                                  VocabParallelLMHead1D (tied to shared when HF ties it;
                                             transformers 5 always ties, and scales the decoder
                                             output by d_model**-0.5 unless the config was made
                                             with tie_word_embeddings=False; both left to HF)
    classification_head.out_proj / classifier / qa_outputs   Linear1D_Col, gathered
    dropouts: inside the feed-forward parallel, on hidden states replicated

T5Attention infers the head count from the projection width except where it
builds a zero position bias (n_heads) for layers without the bias table, so
n_heads and inner_dim become this rank's values.

Split-gather sequence parallelism (shardformer.layer.sequence): each stack
(encoder, decoder) has its own SequenceState; its hidden states are split
at block.0 (after the embeddings and the stack's dropout, full sequence)
and gathered after its last block (final_layer_norm, dropout and the heads
see the full sequence).  Inside a block:

    layer.0.SelfAttention       BLOCK: input all-gathered along S (the
                                attention, its mask and the relative position
                                bias, built from the gathered length in block
                                0 and passed on, cover the whole sequence),
                                o's partial sums reduce-scattered at the output
    layer.1.EncDecAttention     BLOCK (decoder): the query rows gathered
                                the same way; k and v read the encoder output,
                                which is the full sequence on every rank
                                (gathered after the encoder): plain column
                                layers (gradient all-reduced), as under TP
    layer.-1.DenseReluDense     BLOCK (wi / wi_0, wi_1 read the gathered
                                input; wo's partial sums reduce-scattered)
    q (and k, v of self attention), wi*   Linear1D_Col(sequence_parallel=True)
    o, wo                       Linear1D_Row(sequence_parallel=True): T5 has no
                                biases, so the blocks' output reduce-scatter sums
    layer.*.layer_norm          on this rank's rows, gradients all-reduced
    layer.*.dropout             on this rank's rows: DropoutForParallelInput

The region hooks sit on paths under the modules that own the stacks
(T5Model, T5EncoderModel, T5ForConditionalGeneration,
T5ForQuestionAnswering), since T5Stack is one class for both stacks and each
stack needs its own state (a recomputed encoder block in backward must not
read the decoder's length).  output_hidden_states records both stacks'
full-sequence states (shardformer.plan.record_hidden_states).  With enable_sequence_overlap the three regions take
overlap=True (shardformer.layer.sequence.gather_block_input): the block's one
all-gather is in flight while this rank's rows go through its
sequence-parallel column layers (q, k, v; the cross attention's q; wi or
wi_0 / wi_1), which share it.

all_to_all (Ulysses, shardformer.layer.sequence_attention): each stack's
`block` list is split on its own (base: the T5Stack; S' = S padded to a
multiple of p, rank r holding rows [r S'/p, (r+1) S'/p)).  Block 0's
compute_bias runs for the whole padded sequence, [1, H, S', S'] (encoder
bidirectional, decoder causal buckets), and is passed on to every block as
HF does; after the all-to-all (heads scattered, sequence gathered;
backward the inverse) each rank adds its H/p heads of it.  The decoder's
EncDecAttention: this rank's query rows against the whole encoder output
(gathered after the encoder), no collective; the encoder output's
gradient is all-reduced over the group on entering the decoder.

ring_attn: the same stacks and bias, the rows in zigzag order; no bias
travels: each block of the ring adds its (query rows, key columns) of the
whole-sequence bias (ring_attention's `bias`), and the bias gradient of
each block lands on this rank's query rows.
"""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from shardformer.family import (Family, SpecPolicy, gathered, lm, replicated_dropout, spec_capabilities,
                                spec_stage_split)
from shardformer.layer.sequence_layout import BLOCK
from shardformer.pipeline.stages import StageSplit, StageStack
from shardformer.spec import (Attribute, Entry, HeadsFrom, ModuleSpec, PolicySpec, Region, SplitAttention,
                              SplitGatherSpec, SplitWhen)

# Modules that may share the weight of a model's `shared` embedding (the LM
# head's tie is FamilyPolicy's, by identity with the input embeddings).
_TIED = ("encoder.embed_tokens", "decoder.embed_tokens")


# The modules whose `encoder` / `decoder` are the T5Stacks (the classification
# and token models hold a T5Model / T5EncoderModel as `transformer`).
_OWNERS = ("T5Model", "T5EncoderModel", "T5ForConditionalGeneration", "T5ForQuestionAnswering")

#: The blocks' regions under split-gather SP, per stack (paths under a T5Block).
_REGIONS = {"encoder": ("layer.0.SelfAttention", "layer.1.DenseReluDense"),
            "decoder": ("layer.0.SelfAttention", "layer.1.EncDecAttention", "layer.2.DenseReluDense")}


def _attention(at: str, kv_sp: str | None = None) -> tuple[Entry, ...]:
    """q, k, v, o of the T5Attention at `at` (under its T5Layer*), split by
    heads; `kv_sp`: the SP kwargs of k and v (the cross attention's read the
    encoder output, full on every rank: none)."""
    return (Entry(f"{at}.q", "colwise_heads"), Entry(f"{at}.k", "colwise_heads", sp=kv_sp),
            Entry(f"{at}.v", "colwise_heads", sp=kv_sp), Entry(f"{at}.o", "rowwise_heads"))


def _stage_split(owner: str, decoder: bool) -> StageSplit:
    """Pipeline stages over [encoder.block | decoder.block] of the module
    owning the stacks (shardformer.pipeline.stages): block 0 of each stack
    computes the relative position bias and later blocks take it as an
    argument, so the bias (output 1; the decoder's cross-attention bias,
    output 2) travels with the hidden states and its gradient comes back
    to the stage holding the bias table.  encoder.final_layer_norm sits
    with the encoder's last block; decoder.embed_tokens (the shared
    embedding, tied) with the decoder's first, its gradient summed with
    the other stages holding that Parameter (shared, the LM head).
    Stages past the encoder get its output in the message and pass it as
    encoder_outputs (the encoder is not run there).  With sequence
    parallelism (every mode) the hidden states travel as this rank's
    rows of their stack, the biases (whole sequence) and the encoder
    output (gathered) whole (shardformer.pipeline.stages)."""
    bias = (("position_bias", 1),)
    heads = ("lm_head", "qa_outputs")
    if not decoder:
        return StageSplit(owner, "encoder.block", last=("encoder.final_layer_norm",) + heads, carry=bias)
    then = StageStack("decoder.block", first=("decoder.embed_tokens",), last=("decoder.final_layer_norm",) + heads,
                      carry=bias + (("encoder_decoder_position_bias", 2),), source="encoder_hidden_states",
                      skip="encoder_outputs")
    return StageSplit(owner, "encoder.block", last=("encoder.final_layer_norm",), carry=bias, then=then)


#: The split of each owner class (the first module of a class in _OWNERS): T5EncoderModel has no decoder.
PIPELINE_SPLITS = tuple(SplitWhen((owner,), _stage_split(owner, owner != "T5EncoderModel")) for owner in _OWNERS)


class T5Shape(SpecPolicy):
    """A spec factory (build_spec(), interpreted by shardformer.plan.interpret):
    the rows of every T5 module class, one split-gather stack per T5Stack of
    the bound model (stacks()), the shared embeddings' ties (ties())."""

    attention_weights_at = {"T5Attention": 2}     # (output, position_bias, weights)

    pipeline_split = property(spec_stage_split)       # the spec's SplitWhen rows (PIPELINE_SPLITS)

    sp_modes = ("split_gather",)
    sequence_overlap = True         # the blocks' regions overlap their one input gather (SplitGatherSpec.overlap)

    def stacks(self) -> list[tuple[str, str]]:
        """(owner class, stack name) of every stack of the bound model: the
        first module of each class in _OWNERS, its `encoder` and `decoder`."""
        out, seen = [], set()
        for owner in self.model.modules():
            cls = type(owner).__name__
            if cls in _OWNERS and cls not in seen:
                seen.add(cls)
                out += [(cls, name) for name in ("encoder", "decoder") if getattr(owner, name, None) is not None]
        return out

    def ties(self) -> tuple[tuple[str, str], ...]:
        """(source, target) module paths of the `shared` embeddings' ties: each
        stack's embed_tokens (shardformer.plan.record_ties keeps those the
        model holds as one Parameter)."""
        ties = []
        for path, module in self.model.named_modules():
            if isinstance(getattr(module, "shared", None), nn.Embedding):
                prefix = f"{path}." if path else ""
                ties += [(f"{prefix}shared", f"{prefix}{name}") for name in _TIED
                         if getattr(module, name.split(".")[0], None) is not None]
        return tuple(ties)

    def build_spec(self) -> PolicySpec:
        """The attention, feed-forward and dropout rows of every T5 module
        class, the embeddings on the modules owning the stacks, one
        split-gather stack per T5Stack (its regions' paths from the owner
        through each block), the shared embeddings' ties."""
        sp = ("sequence_parallel",)
        norm = (Entry("layer_norm", "replicated_with_grad_allreduce", sp),)
        residual = (Entry("dropout", "dropout_residual"),)
        modules = (
            ModuleSpec("T5Attention", (Entry("relative_attention_bias", "embedding_heads", optional=True),),
                       (Attribute("n_heads", "heads"), Attribute("inner_dim", "width"))),
            ModuleSpec("T5LayerSelfAttention", _attention("SelfAttention") + residual + norm),
            ModuleSpec("T5LayerCrossAttention", _attention("EncDecAttention", kv_sp="") + residual + norm),
            ModuleSpec("T5LayerFF", residual + norm),
            ModuleSpec("T5DenseActDense", (Entry("wi", "colwise"), Entry("wo", "rowwise"),
                                           Entry("dropout", "dropout_parallel"))),
            ModuleSpec("T5DenseGatedActDense", (Entry("wi_0", "colwise"), Entry("wi_1", "colwise"),
                                                Entry("wo", "rowwise"), Entry("dropout", "dropout_parallel"))),
            ModuleSpec("T5Stack", (Entry("dropout", "dropout_replicated"),)),
        ) + tuple(ModuleSpec(cls, tuple(Entry(name, "embedding_rowwise", optional=True)
                                        for name in ("shared",) + _TIED)) for cls in _OWNERS)
        stacks = tuple(SplitGatherSpec(cls, f"{name}.block", cls,
                                       tuple(Region(f"{name}.block.*.{r}", BLOCK) for r in _REGIONS[name]))
                       for cls, name in self.stacks())
        return PolicySpec(
            name=self.family.name if self.family is not None else "t5",
            modules=modules,
            heads=HeadsFrom("num_heads", kv_heads=None, head_dim="d_kv", hidden="d_model"),
            split_gather=stacks[0] if stacks else None,
            stacks=stacks[1:],
            ties=self.ties(),
            capabilities=replace(spec_capabilities(self, pipeline_split=PIPELINE_SPLITS),
                                 split_attention_stacks=self.split_attention_stacks()),
        )

    def split_attention_stacks(self) -> tuple[SplitAttention, ...]:
        """all_to_all / ring_attn over each stack's `block` (base: the T5Stack)
        of the first module owning the stacks: the first block's relative
        position bias built for the whole padded sequence (compute_bias, see
        shardformer.layer.sequence_attention), the decoder's EncDecAttention
        rows attending to the whole encoder output."""
        stacks = self.stacks()
        return tuple(SplitAttention(cls, f"{name}.block", name,
                                    (("cross", ("EncDecAttention",) if name == "decoder" else ()),
                                     ("full_bias", "compute_bias")))
                     for cls, name in stacks if cls == stacks[0][0])


FAMILY = Family("t5", "t5.modeling_t5", T5Shape, heads={
    "T5Model": (),
    "T5ForConditionalGeneration": lm("lm_head", loss="seq2seq"),
    "T5EncoderModel": (),
    # T5ClassificationHead: dense (and its dropout) replicated, out_proj gathered.
    "T5ForSequenceClassification": (replicated_dropout("classification_head.dropout"),
                                    gathered("classification_head.out_proj")),
    "T5ForTokenClassification": (replicated_dropout("dropout"), gathered("classifier")),
    "T5ForQuestionAnswering": gathered("qa_outputs"),
})
globals().update(FAMILY.policy_classes())
