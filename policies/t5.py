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
full-sequence states (SplitGatherMixin).  With enable_sequence_overlap the three regions take
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
from shardformer.layer.sequence_layout import BLOCK
from shardformer.plan import record_ties, residual_dropout, split_gather_ends, split_gather_layer
from shardformer.policies.shapes import SplitGatherMixin, new_sequence_state, sp_overlap
from shardformer.policy import ModulePolicyDescription
from shardformer.policy import SubModuleReplacementDescription as Sub

# Modules that may share the weight of a model's `shared` embedding (the LM
# head's tie is FamilyPolicy's, by identity with the input embeddings).
_TIED = ("encoder.embed_tokens", "decoder.embed_tokens")


# The modules whose `encoder` / `decoder` are the T5Stacks (the classification
# and token models hold a T5Model / T5EncoderModel as `transformer`).
_OWNERS = ("T5Model", "T5EncoderModel", "T5ForConditionalGeneration", "T5ForQuestionAnswering")


class T5Shape(SplitGatherMixin, FamilyPolicy):
    attention_weights_at = {"T5Attention": 2}     # (output, position_bias, weights)
    @property
    def pipeline_split(self):
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
        from shardformer.pipeline.stages import StageSplit, StageStack

        model = getattr(self, "model", None)
        owner = next((m for m in model.modules() if type(m).__name__ in _OWNERS), None) if model is not None else None
        if owner is None:
            return None
        bias = (("position_bias", 1),)
        heads = ("lm_head", "qa_outputs")
        if getattr(owner, "decoder", None) is None:
            return StageSplit(type(owner).__name__, "encoder.block", last=("encoder.final_layer_norm",) + heads,
                              carry=bias)
        decoder = StageStack("decoder.block", first=("decoder.embed_tokens",),
                             last=("decoder.final_layer_norm",) + heads,
                             carry=bias + (("encoder_decoder_position_bias", 2),),
                             source="encoder_hidden_states", skip="encoder_outputs")
        return StageSplit(type(owner).__name__, "encoder.block", last=("encoder.final_layer_norm",), carry=bias,
                          then=decoder)

    sp_modes = ("split_gather",)

    def split_attention_modes(self) -> tuple[str, ...]:
        return ("all_to_all", "ring_attn")

    def split_attention_targets(self) -> list:
        """all_to_all / ring_attn over each stack's `block` (base: the T5Stack): the
        first block's relative position bias built for the whole padded
        sequence (compute_bias, see shardformer.layer.sequence_attention),
        the decoder's EncDecAttention rows attending to the whole encoder
        output."""
        owner = next((m for m in self.model.modules() if type(m).__name__ in _OWNERS), None)
        if owner is None:
            raise ValueError(f"{type(self.model).__name__}: no T5 module owning the stacks ({', '.join(_OWNERS)})")
        targets = []
        for stack_name in ("encoder", "decoder"):
            stack = getattr(owner, stack_name, None)
            if stack is None:
                continue
            cross = ("EncDecAttention",) if stack.is_decoder else ()
            targets.append((type(owner).__name__, f"{stack_name}.block", stack,
                            {"cross": cross, "full_bias": "compute_bias"}))
        return targets

    def attention_description(self, heads: Heads, attention: str, col: dict, row: dict, kv_col: dict) -> list[Sub]:
        """q, k, v, o of the T5Attention at `attention` (under its T5Layer*):
        `col` / `row` the extra kwargs of q and o, `kv_col` those of k and v."""
        return [Sub(f"{attention}.q", Linear1D_Col, kwargs={"split": heads.q, **col}),
                Sub(f"{attention}.k", Linear1D_Col, kwargs={"split": heads.q, **kv_col}),
                Sub(f"{attention}.v", Linear1D_Col, kwargs={"split": heads.q, **kv_col}),
                Sub(f"{attention}.o", Linear1D_Row, kwargs={"split": heads.q, **row})]

    def sequence_parallel_ends(self) -> dict:
        """{owner class: the split / gather of each stack and its blocks' regions}."""
        policy = {}
        overlap = sp_overlap(self.shard_config)
        for owner in self.model.modules():
            cls = type(owner).__name__
            if cls not in _OWNERS or cls in policy:
                continue
            subs = []
            for stack_name in ("encoder", "decoder"):
                stack = getattr(owner, stack_name, None)
                if stack is None:
                    continue
                state = new_sequence_state()
                if stack.is_decoder:
                    regions = ["layer.0.SelfAttention", "layer.1.EncDecAttention", "layer.2.DenseReluDense"]
                else:
                    regions = ["layer.0.SelfAttention", "layer.1.DenseReluDense"]
                subs += split_gather_layer({f"{stack_name}.block.*.{r}": BLOCK for r in regions}, (), state, overlap)
                subs += split_gather_ends(f"{stack_name}.block", len(stack.block), state)
            policy[cls] = ModulePolicyDescription(sub_module_replacement=subs)
        return policy

    def body_policy(self):
        if not self.tensor_parallel:
            return {}
        cfg = self.model.config
        heads = Heads(cfg.num_heads, cfg.num_heads, cfg.d_kv)
        sp = self.shard_config.sequence_parallel
        # T5 has no biases: with SP the row layers leave partial sums to the blocks' reduce-scatter
        col = row = {"sequence_parallel": True} if sp else {}
        drop = residual_dropout(self.shard_config)
        policy = {
            "T5Attention": ModulePolicyDescription(
                attribute_replacement=heads.attributes({"n_heads": "heads", "inner_dim": "width"}),
                sub_module_replacement=[
                    Sub("relative_attention_bias", Embedding1D,
                        kwargs={"split": Heads(cfg.num_heads).q, "gather_output": False}, ignore_if_not_exist=True),
                ]),
            "T5LayerSelfAttention": ModulePolicyDescription(sub_module_replacement=[
                *self.attention_description(heads, "SelfAttention", col, row, col), Sub("dropout", drop)]),
            # the cross attention's keys and values read the encoder output (full sequence, replicated)
            "T5LayerCrossAttention": ModulePolicyDescription(sub_module_replacement=[
                *self.attention_description(heads, "EncDecAttention", col, row, {}), Sub("dropout", drop)]),
            "T5LayerFF": ModulePolicyDescription(sub_module_replacement=[Sub("dropout", drop)]),
            "T5DenseActDense": ModulePolicyDescription(sub_module_replacement=[
                Sub("wi", Linear1D_Col, kwargs=col), Sub("wo", Linear1D_Row, kwargs=row),
                Sub("dropout", DropoutForParallelInput)]),
            "T5DenseGatedActDense": ModulePolicyDescription(sub_module_replacement=[
                Sub("wi_0", Linear1D_Col, kwargs=col), Sub("wi_1", Linear1D_Col, kwargs=col),
                Sub("wo", Linear1D_Row, kwargs=row), Sub("dropout", DropoutForParallelInput)]),
            "T5Stack": ModulePolicyDescription(sub_module_replacement=[Sub("dropout", DropoutForReplicatedInput)]),
        }
        if sp:
            from shardformer.layer.replicated import ReplicatedInParallelRegion

            for cls in ("T5LayerSelfAttention", "T5LayerCrossAttention", "T5LayerFF"):
                policy[cls].sub_module_replacement.append(Sub("layer_norm", ReplicatedInParallelRegion))
        for cls in _OWNERS:
            policy[cls] = ModulePolicyDescription(sub_module_replacement=[
                Sub(name, VocabParallelEmbedding1D, kwargs=self.vocab_kwargs(), ignore_if_not_exist=True)
                for name in ("shared", "encoder.embed_tokens", "decoder.embed_tokens")])
        if sp:
            for cls, desc in self.sequence_parallel_ends().items():
                policy[cls].sub_module_replacement += desc.sub_module_replacement
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
        if self.tensor_parallel:                # re-tied by Policy.postprocess
            record_ties(self.state, self.model, self._find_ties())
        return super().preprocess()


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
