"""Whisper: heads and feed-forward features split in the encoder, the
decoder and the cross attention; the audio front-end (conv1, conv2,
positional embeddings) stays replicated; vocabulary-parallel token
embeddings and output projection.

    *.self_attn / encoder_attn .{q,k,v}_proj   Linear1D_Col (per head)
    *.self_attn / encoder_attn .out_proj       Linear1D_Row (all-reduce forward)
    layers.*.fc1 / fc2                         Linear1D_Col / Linear1D_Row
    decoder.embed_tokens                       VocabParallelEmbedding1D
    proj_out                                   VocabParallelLMHead1D (tied to embed_tokens when HF ties it)
    projector / classifier (audio classification)   Linear1D_Col / Linear1D_Row: the mean over
                                               time of the projector's split features is split too

The encoder and decoder layers have their own head counts
(encoder_attention_heads, decoder_attention_heads).  WhisperAttention
reshapes keys and values with num_heads, so num_heads and embed_dim become
this rank's values.  Whisper's dropouts are functional (torch's global RNG),
so they are not replaced.

Split-gather sequence parallelism (the layout above sp_linear_kwargs in
policies/shapes.py), with one SequenceState per stack: the encoder's
hidden states are split at layers.0 (after conv1, conv2, the positional
embedding and the dropout, on the full sequence) and gathered after its
last layer (layer_norm and the heads see the full sequence); the decoder's
likewise (after its token and position embeddings; the causal mask is built
for the full sequence).  self_attn and encoder_attn take layouts ENTER (the
query input all-gathered; encoder_attn's k_proj / v_proj read the encoder
output, full on every rank: plain column layers, gradient all-reduced);
fc1 gathers its input rows itself (Linear1D_Col gather_input=True; with
enable_sequence_overlap the all-gather overlaps its matmul); out_proj and
fc2 reduce-scatter and add their bias on this rank's rows.  The layers'
residual dropouts are functional calls with the layer's `dropout`: that
becomes 0 and p moves into out_proj / fc2 (Linear1D_Row dropout=p: a mask
per rank, on this rank's rows).  The layer norms run on this rank's rows
(gradients all-reduced).  Refused: encoder_layerdrop / decoder_layerdrop > 0
(a skipped first or last layer would skip the split or the gather).
output_hidden_states records full-sequence states (shardformer.plan.record_hidden_states), which
audio classification's use_weighted_layer_sum reads.

all_to_all / ring_attn (shardformer.layer.sequence_attention): the
encoder's and the decoder's `layers` are split each on its own, after the
conv front end and positions (encoder) or the token and position
embeddings (decoder), all on the full sequence.  Encoder self-attention is
bidirectional (padded keys masked), decoder self-attention causal; the
decoder's encoder_attn runs this rank's query rows against the whole
encoder output (no collective; the encoder output's gradient all-reduced
over the group on entering the decoder).  Refused by name: layerdrop, and
use_weighted_layer_sum in these two modes.
"""
from __future__ import annotations

from dataclasses import replace

from shardformer.family import Family, SpecPolicy, lm, spec_capabilities, spec_stage_split
from shardformer.layer.sequence_layout import ENTER
from shardformer.layout import Heads
from shardformer.pipeline.stages import StageSplit, StageStack
from shardformer.spec import (Attribute, Entry, ModuleSpec, PolicySpec, Refusal, Region, Setting, SplitAttention,
                              SplitGatherSpec, SplitWhen)

#: (stack class, layer class, config attribute of its head count, its attentions) of the two stacks
#: the config attributes of Whisper's LayerDrop, refused under pipeline stages and sequence parallelism
LAYERDROPS = ("encoder_layerdrop", "decoder_layerdrop")
STACKS = (("WhisperEncoder", "WhisperEncoderLayer", "encoder_attention_heads", ("self_attn",)),
          ("WhisperDecoder", "WhisperDecoderLayer", "decoder_attention_heads", ("self_attn", "encoder_attn")))


# Pipeline stages over [encoder.layers | decoder.layers] of the WhisperModel (shardformer.pipeline.stages), or
# over the one stack of WhisperForCausalLM (the decoder) and WhisperForAudioClassification (the encoder).  The
# conv front end and the encoder positions sit on the first stage; a later stage stands in for them with zeros
# shaped like their outputs (`shaped`: the convolutions' output is transposed before the layers).
# encoder.layer_norm sits with the encoder's last layer; the decoder's embed_tokens (tied with proj_out:
# gradients summed over the two stages) and embed_positions with the decoder's first.  Stages past the encoder
# take its output from the message and pass it as encoder_outputs.  With sequence parallelism (every mode) the
# hidden states travel as this rank's rows of their stack, the encoder output (gathered after the encoder) whole.
_FRONT = ("conv1", "conv2", "embed_positions")
PIPELINE_SPLITS = (
    SplitWhen(("WhisperModel",), StageSplit(
        "WhisperModel", "encoder.layers", last=("encoder.layer_norm",), shaped=tuple(f"encoder.{m}" for m in _FRONT),
        then=StageStack("decoder.layers", first=("decoder.embed_tokens", "decoder.embed_positions"),
                        last=("decoder.layer_norm",), source="encoder_hidden_states", skip="encoder_outputs"))),
    SplitWhen(("WhisperEncoder",), StageSplit("WhisperEncoder", "layers", last=("layer_norm",), shaped=_FRONT),
              lacks=("WhisperDecoder",)),
    SplitWhen(("WhisperDecoder",), StageSplit("WhisperDecoder", "layers", last=("layer_norm",)),
              lacks=("WhisperEncoder",)))


class WhisperShape(SpecPolicy):
    """Option `split_head`: (column, row) module names of a head split by
    features rather than gathered (WhisperForAudioClassification's projector
    and classifier)."""

    split_head: tuple[str, str] | None = None

    pipeline_split = property(spec_stage_split)       # the spec's SplitWhen rows (PIPELINE_SPLITS)

    sp_modes = ("split_gather",)
    sequence_overlap = True         # fc1 gathers its own rows (Entry sp="gather_rows")

    def refusals(self) -> tuple[Refusal, ...]:
        """What Whisper refuses, as data: a layerdrop (a skipped first or last
        layer) under pipeline stages or any sequence parallelism;
        use_weighted_layer_sum on the audio classifier (the class with
        layer_weights) under pipeline stages or all_to_all / ring_attn."""
        no = "NotImplementedError"
        weighted = ("use_weighted_layer_sum", (False, None), False)
        return tuple(Refusal(key, (0.0, None), 0.0, ("pipeline_stages",), (
            "{model}: pipeline parallelism with {attribute}={value} is not available for Whisper "
            "(model.encoder.layers / model.decoder.layers): a skipped first or last layer of a stage would skip "
            "the hand-over between stages (set it to 0)"), no) for key in LAYERDROPS) + (
            Refusal(*weighted, ("pipeline_stages", "model:layer_weights"), (
                "{model}: pipeline parallelism with use_weighted_layer_sum=True is not available for Whisper: the "
                "weighted sum reads every encoder layer's hidden states, which live on different stages"), no),
        ) + tuple(Refusal(key, (0.0, None), 0.0, ("any_sequence_parallel",), (
            "{model}: sequence parallelism ({mode}) with {attribute}={value} is not available for Whisper: a "
            "skipped first or last layer would skip the split or the gather, and each rank would skip different "
            "layers (set it to 0)"), no) for key in LAYERDROPS) + (
            Refusal(*weighted, ("split_attention", "model:layer_weights"), (
                "{model}: sequence parallelism ({mode}) with use_weighted_layer_sum=True is not available for "
                "Whisper: the weighted sum reads every layer's hidden states, which hold this rank's rows only in "
                "this mode (split_gather gathers them)"), no),)

    def layer_spec(self, layer_cls: str, heads: Heads, attns: tuple[str, ...]) -> ModuleSpec:
        """The rows of one layer class: each attention's q / k / v by `heads`
        (the cross attention's k / v read the encoder output: no SP kwargs)
        and out_proj by the same heads, fc1 gathering its own input rows
        under SP (the MLP is no module), fc2; the functional residual dropout
        (`dropout`) moves into the row layers under SP and the activation
        dropout (`activation_dropout`, on fc1's split features) into fc2,
        each attribute set to 0."""
        cfg = self.model.config
        entries, attributes = (), ()
        for a in attns:
            kv = "" if a == "encoder_attn" else None
            entries += (Entry(f"{a}.q_proj", "colwise_heads", heads=heads),
                        Entry(f"{a}.k_proj", "colwise_heads", sp=kv, heads=heads),
                        Entry(f"{a}.v_proj", "colwise_heads", sp=kv, heads=heads),
                        Entry(f"{a}.out_proj", "rowwise_heads", heads=heads))
            attributes += (Attribute(f"{a}.num_heads", "heads", heads=heads),
                           Attribute(f"{a}.embed_dim", "width", heads=heads))
        act = (("input_dropout", float(cfg.activation_dropout)),) if cfg.activation_dropout else ()
        entries += (Entry("fc1", "colwise", sp="gather_rows"), Entry("fc2", "rowwise", kwargs=act))
        if cfg.dropout:
            drop = (("dropout", float(cfg.dropout)),)
            entries += tuple(Entry(e.suffix, e.style, ("sequence_parallel",), heads=e.heads, kwargs=drop + e.kwargs)
                             for e in entries if e.style.startswith("row"))
        if act:
            attributes += (Setting("activation_dropout", 0.0),)
        attributes += (Setting("dropout", 0.0, ("sequence_parallel",)),)
        return ModuleSpec(layer_cls, entries, attributes, sp_linear="rows")

    def build_spec(self) -> PolicySpec:
        """One ModuleSpec per layer class of the stacks the bound model has
        (each its own heads), the decoder's token embedding, the audio
        classifier's split head (`split_head`), one split-gather stack each;
        all_to_all / ring_attn over each stack's `layers` (the encoder after
        its conv front end and positions, bidirectional with padded keys
        masked; the decoder after its token and position embeddings, causal,
        its encoder_attn rows attending to the whole encoder output)."""
        cfg = self.model.config
        present = {type(m).__name__ for m in self.model.modules()}
        modules, stacks = (), ()
        for stack_cls, layer_cls, heads_at, attns in STACKS:
            if stack_cls not in present:
                continue
            n = getattr(cfg, heads_at)
            modules += (self.layer_spec(layer_cls, Heads(n, n, cfg.d_model // n), attns),)
            stacks += (SplitGatherSpec(stack_cls, "layers", layer_cls, tuple(Region(a, ENTER) for a in attns),
                                       overlap=False, skip=attns + ("fc1", "fc2")),)
        if "WhisperDecoder" in present:
            modules += (ModuleSpec("WhisperDecoder", (Entry("embed_tokens", "embedding_rowwise"),)),)
        if self.split_head is not None:
            col, row = self.split_head
            modules += (ModuleSpec(self.model_class, (Entry(col, "colwise", sp=""), Entry(row, "rowwise", sp=""))),)
        return PolicySpec(
            name=self.family.name if self.family is not None else "whisper",
            modules=modules,
            split_gather=stacks[0] if stacks else None,
            stacks=stacks[1:],
            refusals=self.refusals(),
            capabilities=replace(spec_capabilities(self, pipeline_split=PIPELINE_SPLITS),
                                 split_attention_stacks=tuple(
                                     SplitAttention(stack_cls, "layers", options=(("cross", attns[1:]),))
                                     for stack_cls, _, _, attns in STACKS if stack_cls in present)),
        )


FAMILY = Family("whisper", "whisper.modeling_whisper", WhisperShape, heads={
    "WhisperModel": (),
    # both call nn.CrossEntropyLoss in forward, on labels aligned with the logits (no shift)
    "WhisperForConditionalGeneration": lm("proj_out", loss="seq2seq"),
    "WhisperForCausalLM": lm("proj_out", loss="masked"),
})
AUDIO = Family("whisper", "whisper.modeling_whisper", WhisperShape, options={"split_head": ("projector", "classifier")},
               heads={"WhisperForAudioClassification": ()})
FAMILIES = (FAMILY, AUDIO)
for _family in FAMILIES:
    globals().update(_family.policy_classes())
