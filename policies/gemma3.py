"""Gemma 3: the text models and the multimodal ones.

Text models (Gemma3TextModel, Gemma3ForCausalLM, ...): as Gemma 2, with
per-head q/k RMSNorms (replicated, they act on head_dim) and sliding/full
attention layers; see policies/mistral.py.

Multimodal models (Gemma3Model, Gemma3ForConditionalGeneration,
Gemma3ForSequenceClassification): a SigLIP vision tower, a projector and the
text model, composed as in policies/blip2.py:

    SiglipEncoderLayer .self_attn.{q,k,v}_proj  Linear1D_Col (per head, uneven allowed)
                       .self_attn.out_proj      Linear1D_Row (input split by the same heads)
                       .mlp.fc1 / fc2           Linear1D_Col / Linear1D_Row
    language_model                              Gemma3TextModelPolicy, found in the registry
    lm_head                                     VocabParallelLMHead1D (tied when HF tied it)
    score                                       Linear1D_Col, gathered

Patch and position embeddings, the vision layer norms (FusedLayerNorm with
enable_fused_normalization) and the multi-modal projector (an average pool,
an RMSNorm and one [vision, text] matrix over a few tokens per image) stay
replicated: the projector's output joins the replicated input embeddings,
whose gradient the text layers already all-reduce.

Sequence parallelism applies to the text model only, with its own policy's
modes (split_gather, all_to_all, ring_attn; see policies/shapes.py
DecoderShape): the image features are merged into the input embeddings
before the first decoder layer, which splits the merged sequence [B, S, H]
along S; the vision tower and projector run unsplit and replicated (their
few tokens per image never see the split).  The text model builds its
attention masks from token_type_ids for the whole sequence: an image's
tokens see each other in both directions.  split_gather runs each
attention on the all-gathered sequence with that mask as built;
all_to_all gathers the sequence per head group (all-to-all), so the model's
own attention function reads the same [B, 1, S, S] mask (padded to S').
ring_attn is refused for these classes: its kernel expresses causal masks,
key padding and sliding windows, not the bidirectional image blocks.

Pipeline parallelism (MM_PIPELINE): the stages split the text model's
layers (language_model.layers of Gemma3Model); its token embeddings run on
the first stage, its final norm, lm_head and score on the last.  The vision
tower and the projector are replicated on every stage (StageSplit.everywhere)
and run by each from the micro-batch's pixel_values: every stage needs the
image features, the first to merge them into the embeddings, the last for
the output's image_hidden_states, and the ones between for the placeholder
check of Gemma3Model's forward (the merged embeddings they make are replaced
by the activation received).  Their gradients, the first stage's through the
text layers and the last stage's through image_hidden_states, are summed
over the stages, so each replica steps with the unsharded model's gradient.
The attention masks come from token_type_ids, which every stage is given.
"""
from __future__ import annotations


from shardformer.family import ComposedPolicy, Family, gathered, lm
from shardformer.layout import Heads
from shardformer.pipeline.stages import StageSplit
from shardformer.policies.shapes import DecoderShape
from shardformer.spec import Attribute, Entry, ModuleSpec, PolicySpec, Refusal

TEXT = Family("gemma3", "gemma3.modeling_gemma3", DecoderShape,
              options={"prefix": "Gemma3", "base_model": "TextModel", "qk_norm": True, "embed_scale": True},
              heads={"Gemma3TextModel": (), "Gemma3ForCausalLM": lm("lm_head"),
                     "Gemma3TextForSequenceClassification": gathered("score")})


# ---- the multimodal models: SigLIP vision tower + projector + the text model above ----

def siglip_module(vision_cfg) -> ModuleSpec:
    """SigLIP encoder layers split by attention heads (uneven allowed) and MLP
    features, unsplit along the sequence (sp_linear "").  SiglipAttention
    reshapes by head_dim with -1 heads, so only the (informational)
    num_heads attribute changes per rank."""
    n = vision_cfg.num_attention_heads
    heads = Heads(n, n, vision_cfg.hidden_size // n)
    return ModuleSpec("SiglipEncoderLayer", tuple(
        Entry(f"self_attn.{p}_proj", "colwise_heads", heads=heads) for p in "qkv") + (
        Entry("self_attn.out_proj", "rowwise_heads", heads=heads),
        Entry("mlp.fc1", "colwise"), Entry("mlp.fc2", "rowwise")),
        attributes=(Attribute("self_attn.num_heads", "heads", heads=heads),), sp_linear="")


# The text model's layers split over the stages; its embeddings on the first, its norm and the heads on the
# last.  The vision tower and projector run on every stage (their gradients summed over the stages).
MM_PIPELINE = StageSplit("Gemma3Model", "language_model.layers", last=("language_model.norm",),
                         everywhere=("vision_tower", "multi_modal_projector"))


class Gemma3MultimodalShape(ComposedPolicy):
    """Gemma3Model and the heads around it: the SigLIP tower split here, the
    text model by its own registered policy (Gemma3TextModelPolicy), bound to
    it and composed in (PolicySpec.compose).  Option `base`: path of the
    Gemma3Model inside the model ("" for Gemma3Model itself)."""

    base = "model"
    pipeline_split = MM_PIPELINE

    def language_path(self) -> str:
        return f"{self.base}.language_model" if self.base else "language_model"

    def build_spec(self) -> PolicySpec:
        """The vision tower's part as a PolicySpec; the text model composed
        (its own registered policy; ring_attn refused by a Refusal row)."""
        return PolicySpec("gemma3", (siglip_module(self.model.config.vision_config),),
                          compose=(self.language_path(),), refusals=(Refusal(
                              "", when=("mode:ring_attn",), error="NotImplementedError", message=(
                                  "{model}: sequence_parallelism_mode='ring_attn' is not available for "
                                  f"{self.language_path()}: Gemma 3 lets the tokens of one image attend to each "
                                  "other in both directions (token_type_ids), a mask the ring kernel (causal, key "
                                  "padding, sliding window) cannot express; use 'all_to_all' or 'split_gather'")),))


MULTIMODAL = Family("gemma3", "gemma3.modeling_gemma3", Gemma3MultimodalShape, options={"base": "model"},
                    heads={"Gemma3ForConditionalGeneration": lm("lm_head"),
                           "Gemma3ForSequenceClassification": gathered("score")})
BASE = Family("gemma3", "gemma3.modeling_gemma3", Gemma3MultimodalShape, options={"base": ""},
              heads={"Gemma3Model": ()})
FAMILIES = (TEXT, MULTIMODAL, BASE)
for _family in FAMILIES:
    globals().update(_family.policy_classes())
