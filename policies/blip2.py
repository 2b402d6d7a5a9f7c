"""BLIP-2: the vision encoder, the Q-Former and the language model split over
the tensor-parallel group.

    Blip2Attention (vision) .qkv            Linear1D_Col, split Fused(q, k, v) per head (the
                                            bias [q_bias | 0 | v_bias] is cut the same way)
    Blip2Attention .projection              Linear1D_Row (input split by the same heads)
    Blip2EncoderLayer .mlp.fc1 / fc2        Linear1D_Col / Linear1D_Row
    Q-Former attention and cross attention  query / key / value Linear1D_Col (per head; the
                                            cross attention's key / value read the image
                                            features), output.dense Linear1D_Row
    Q-Former intermediate(_query).dense     Linear1D_Col
             output(_query).dense           Linear1D_Row
    Q-Former text embeddings                VocabParallelEmbedding1D (retrieval / text models)
    Q-Former dropouts on hidden states      DropoutForReplicatedInput
    language_model                          the language model's own policy, found in the
                                            registry by its class (OPT, T5, Llama, ...) and
                                            composed in: its layers, vocabulary-parallel
                                            embedding and LM head, and its re-tying
    language_projection, vision_projection, Linear1D_Col, gathered
    text_projection, itm_head

Blip2Attention reshapes its fused output as [3, num_heads, embed_dim //
num_heads] with embed_dim the *input* width, which does not hold for one
rank's heads; its forward is replaced by one that reshapes by head_dim (the
attention itself is still HF's attention interface).  The Q-Former attention
infers its head count from the projection width.  Patch and position
embeddings, query tokens and layer norms stay replicated.

Split-gather sequence parallelism (split_gather, enable_sequence_overlap)
splits every part of the model, each in its own SequenceState:

    vision encoder   ViT's layout (policies/shapes.py VisionShape): the patch
                     tokens with [CLS] split from encoder.layers.0 to the last
                     layer; self_attn and mlp gather their input (overlap: mlp.fc1
                     gathers its own rows, the all-gather in flight during its
                     matmul); projection and fc2 reduce-scatter and add their
                     bias on this rank's rows; layer_norm1 / layer_norm2 on the
                     rows, gradients all-reduced
    Q-Former         BERT's layout per segment (layer/sequence_segments.py):
                     [queries; text] split segment by segment, each layer called
                     with this rank's query count; the self attention gathers
                     the whole sequence in order, the cross attention and the
                     query feed-forward gather the queries, the text
                     feed-forward the text (overlap: intermediate(_query).dense
                     gathers its own rows); the cross attention's key / value
                     read the replicated image features as under TP; the output
                     dense layers reduce-scatter, their dropouts draw a mask per
                     rank, the LayerNorms' gradients are all-reduced
    language model   its own policy's modes (OPT and T5: split_gather,
                     all_to_all, ring_attn): the Q-Former's query outputs,
                     projected, are joined to the text embeddings before its
                     first layer, which splits that sequence [B, S, H] along S

all_to_all / ring_attn split the language model only (the vision encoder and
Q-Former run unsplit, under TP where it is on); a class without a language
model is refused them by name, as is a mode the language model's policy lacks.

All of it is one PolicySpec (Blip2Shape.build_spec, run by
shardformer.plan.interpret): the vision encoder the first split-gather
stack, the Q-Former a segmented one (SplitGatherSpec.segments, its Region
rows among the layer's entries), the language model composed
(PolicySpec.compose, shardformer.family.ComposedPolicy); see
docs/writing-policies.md.
"""
from __future__ import annotations

import torch

from shardformer.family import ComposedPolicy, Family, gathered, spec_stage_split
from shardformer.layer.sequence_layout import ENTER
from shardformer.layout import Heads
from shardformer.pipeline.stages import StageSplit
from shardformer.spec import (GATHER_ORDER, Attribute, Capabilities, Entry, Method, ModuleSpec, PolicySpec, Refusal,
                              Region, SplitGatherSpec, SplitWhen)

SP = ("sequence_parallel",)


def vision_attention_forward(self, hidden_states: torch.Tensor, **kwargs):
    """Blip2Attention.forward over this rank's heads: qkv rows [3, local heads, head_dim]."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.blip_2 import modeling_blip_2

    bsz, tgt_len, _ = hidden_states.shape
    qkv = self.qkv(hidden_states).reshape(bsz, tgt_len, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                      modeling_blip_2.eager_attention_forward)
    out, weights = attention(self, qkv[0], qkv[1], qkv[2], attention_mask=None,
                             dropout=self.attention_dropout if self.training else 0.0, scaling=self.scale, **kwargs)
    return self.projection(out.reshape(bsz, tgt_len, -1).contiguous()), weights


def _heads(cfg) -> Heads:
    n = cfg.num_attention_heads
    return Heads(n, n, cfg.hidden_size // n)


def vision_modules(vision_cfg) -> tuple[ModuleSpec, ...]:
    """The vision encoder's rows: the attention's fused qkv by heads (the bias
    [q_bias | 0 | v_bias] cut the same way), its projection by the same heads,
    its forward reshaping by head_dim; the MLP by features (under split-gather
    SP fc1 gathers its own rows with enable_sequence_overlap)."""
    heads = _heads(vision_cfg)
    return (ModuleSpec("Blip2Attention", (Entry("qkv", "colwise_qkv", heads=heads),
                                          Entry("projection", "rowwise_heads", heads=heads)),
                       attributes=(Attribute("num_heads", "heads", heads=heads),
                                   Method.fixed("forward", vision_attention_forward)), sp_linear="rows"),
            ModuleSpec("Blip2EncoderLayer", (Entry("mlp.fc1", "colwise", sp="gather"), Entry("mlp.fc2", "rowwise")),
                       sp_linear="rows"))


def vision_split_gather(vision_cfg) -> SplitGatherSpec:
    """ViT's layout (policies/shapes.py VisionShape) on the vision encoder: the
    patch tokens with [CLS] split from encoder.layers.0 to the last layer;
    self_attn (and mlp, without overlap) gather their input, layer_norm1 /
    layer_norm2 run on the rows."""
    return SplitGatherSpec("Blip2VisionModel", "encoder.layers", "Blip2EncoderLayer", (
        Region("self_attn", ENTER), Region("mlp", ENTER, ("no_overlap",)), Region("layer_norm1"),
        Region("layer_norm2")), overlap=False)


def qformer_feed_forward(up: str, down: str, segment: str, optional: bool) -> tuple:
    """One Q-Former feed-forward (the queries' or the text's) as entry rows:
    `up`.dense by features (gathering its own rows with overlap, else `up`
    gathers `segment`'s rows), `down`.dense reduce-scattering, its dropout
    and LayerNorm on this rank's rows under split-gather SP."""
    return (Entry(f"{up}.dense", "colwise", sp="gather", optional=optional),
            Entry(f"{down}.dense", "rowwise", optional=optional),
            Entry(f"{down}.dropout", "dropout_residual", optional=optional),
            Region(f"{down}.LayerNorm", when=SP, optional=optional),
            Region(up, ENTER, ("no_overlap",), segment=segment, optional=optional))


def qformer_layer_entries(qformer_cfg) -> tuple:
    """The Blip2QFormerLayer rows.  Under TP its feed-forwards (the text one
    exists with use_qformer_text_input: optional); under split-gather SP
    also its attentions' projections (the cross attention every
    cross_attention_frequency layers: optional; its key / value read the
    replicated image features, as under TP) and the regions of BERT's layout
    per segment: the self attention gathers the whole sequence in order, the
    cross attention and the query feed-forward the queries, the text
    feed-forward the text."""
    heads = _heads(qformer_cfg)
    attention = tuple(Entry(f"attention.attention.{p}", "colwise_heads", SP, heads=heads)
                      for p in ("query", "key", "value"))
    cross = (Entry("crossattention.attention.query", "colwise_heads", SP, heads=heads, optional=True),
             Entry("crossattention.attention.key", "colwise_heads", SP, sp="", heads=heads, optional=True),
             Entry("crossattention.attention.value", "colwise_heads", SP, sp="", heads=heads, optional=True))
    return (attention + qformer_feed_forward("intermediate_query", "output_query", "query", False)
            + (Region("attention.attention", ENTER, SP), Region("attention.output", GATHER_ORDER, SP),
               Region("attention.output.LayerNorm", when=SP))
            + cross + qformer_feed_forward("intermediate", "output", "text", True)
            + (Region("crossattention.attention", ENTER, SP, segment="query", optional=True),
               Region("crossattention.output.LayerNorm", when=SP, optional=True)))


def qformer_modules(qformer_cfg) -> tuple[ModuleSpec, ...]:
    """The Q-Former's rows: self and cross attention alike split by heads
    (query / key / value, output.dense), the feed-forwards by features, the
    text embeddings by vocabulary, the dropouts on its hidden states with one
    mask (or, after a row layer under split-gather SP, a mask per rank)."""
    heads = _heads(qformer_cfg)
    return (
        ModuleSpec("Blip2QFormerMultiHeadAttention", tuple(
            Entry(p, "colwise_heads", ("no_sequence_parallel",), heads=heads) for p in ("query", "key", "value")),
            attributes=(Attribute("num_attention_heads", "heads", heads=heads),
                        Attribute("all_head_size", "width", heads=heads))),
        ModuleSpec("Blip2QFormerAttention", (Entry("output.dense", "rowwise_heads", heads=heads),
                                             Entry("output.dropout", "dropout_residual")), sp_linear="rows"),
        ModuleSpec("Blip2QFormerLayer", qformer_layer_entries(qformer_cfg), sp_linear="rows"),
        ModuleSpec("Blip2QFormerModel", (Entry("dropout", "dropout_replicated"),)),
        ModuleSpec("Blip2TextEmbeddings", (Entry("word_embeddings", "embedding_rowwise"),)))


def qformer_split_gather() -> SplitGatherSpec:
    """The Q-Former's sequence [queries; text] split segment by segment
    (layer/sequence_segments.py), each layer called with this rank's query
    count; its regions stand among the Blip2QFormerLayer entries."""
    return SplitGatherSpec("Blip2QFormerEncoder", "layer", "Blip2QFormerLayer", (),
                           overlap=False, ends="segments", segments=("query", "text"))


#: Sequence modes refused as data: split_gather under pipeline stages; all_to_all / ring_attn without a
#: language model ("not_composed"; with one, ComposedPolicy refuses a mode its policy lacks).
REFUSALS = (
    Refusal("", when=("mode:split_gather", "pipeline_stages"), error="NotImplementedError", message=(
        "{model}: sequence_parallelism_mode='split_gather' with pipeline parallelism is not available: the vision "
        "encoder's and the Q-Former's layers would be split over the stages while their sequence is split at "
        "their first layer (docs/sequence-parallelism.md, BLIP-2)")),
    Refusal("", when=("split_attention", "not_composed"), error="NotImplementedError", message=(
        "{model}: sequence_parallelism_mode='{mode}' is not available for vision_model / qformer: {mode} applies "
        "to the language model, and this class has none (split_gather splits its vision encoder and Q-Former)")))


# Where the stages split (shardformer.pipeline.stages), by what the class holds:
#
#     a vision encoder    its layers (vision_model.encoder.layers) are the stack; the post-layernorm, the
#                         Q-Former, the projections and any language model run on the last stage, which every
#                         micro-batch's text inputs reach (each stage is given the whole micro-batch)
#     a Q-Former only     its layers (encoder.layer); Blip2TextModelWithProjection's text embeddings run on the
#                         first stage, its projection on the last
#
# The query tokens (a Parameter of the model, read by the Q-Former on the last stage) are on every stage, their
# gradient summed over them (zeros but the last's).  docs/pipeline.md (BLIP-2) says why the vision encoder, not
# the language model, is the stack.  The Q-Former's encoder loops `for i in range(config.num_hidden_layers)`.
PIPELINE_SPLITS = (
    SplitWhen(("Blip2VisionModel",), StageSplit("Blip2VisionModel", "encoder.layers", last=("post_layernorm",),
                                                everywhere=("query_tokens",))),
    SplitWhen(("Blip2TextModelWithProjection",), StageSplit(
        "Blip2TextModelWithProjection", "qformer.encoder.layer", last=("text_projection",),
        everywhere=("query_tokens",), count="config.num_hidden_layers")),
    SplitWhen(("Blip2QFormerModel",), StageSplit("Blip2QFormerModel", "encoder.layer",
                                                 count="config.num_hidden_layers")))


class Blip2Shape(ComposedPolicy):
    """Option `parts`: what the model holds ("vision", "qformer"); a
    language_model is composed in when present (PolicySpec.compose)."""

    parts: tuple[str, ...] = ("vision", "qformer")

    pipeline_split = property(spec_stage_split)       # the spec's SplitWhen rows (PIPELINE_SPLITS)

    def build_spec(self) -> PolicySpec:
        """The vision encoder's and the Q-Former's part as a PolicySpec, by the
        parts the class holds; the language model, where the class has one, is
        composed (its own registered policy, found by ComposedPolicy); without one
        split_gather (with overlap) is the only mode.  With both parts, the
        vision encoder's stack is the first split-gather stack and the
        Q-Former's the second."""
        cfg = self.model.config
        modules, stacks = (), ()
        if "vision" in self.parts:
            vision = getattr(cfg, "vision_config", cfg)
            modules += self.vision_modules(vision)
            stacks += (vision_split_gather(vision),)
        if "qformer" in self.parts:
            modules += self.qformer_modules(getattr(cfg, "qformer_config", cfg))
            stacks += (qformer_split_gather(),)
        return PolicySpec("blip2", modules, split_gather=stacks[0], stacks=stacks[1:], compose=("language_model",),
                          capabilities=Capabilities(sp_modes=("split_gather",), sequence_overlap=True,
                                                    pipeline_split=PIPELINE_SPLITS),
                          refusals=REFUSALS)

    def vision_modules(self, vision_cfg) -> tuple[ModuleSpec, ...]:
        """The vision encoder's ModuleSpecs (module-level vision_modules), for a subclass to override."""
        return vision_modules(vision_cfg)

    def qformer_modules(self, qformer_cfg) -> tuple[ModuleSpec, ...]:
        """The Q-Former's ModuleSpecs (module-level qformer_modules), for a subclass to override."""
        return qformer_modules(qformer_cfg)



_HF = "blip_2.modeling_blip_2"
VISION = Family("blip2", _HF, Blip2Shape, options={"parts": ("vision",)}, heads={"Blip2VisionModel": ()})
QFORMER = Family("blip2", _HF, Blip2Shape, options={"parts": ("qformer",)}, heads={
    "Blip2QFormerModel": (),
    "Blip2TextModelWithProjection": gathered("text_projection"),
})
FULL = Family("blip2", _HF, Blip2Shape, heads={
    "Blip2Model": gathered("language_projection"),
    "Blip2ForConditionalGeneration": gathered("language_projection"),
    "Blip2ForImageTextRetrieval": (gathered("vision_projection"), gathered("text_projection"), gathered("itm_head")),
    "Blip2VisionModelWithProjection": gathered("vision_projection"),
})
FAMILIES = (VISION, QFORMER, FULL)
for _family in FAMILIES:
    globals().update(_family.policy_classes())
