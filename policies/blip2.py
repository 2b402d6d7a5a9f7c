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
"""
from __future__ import annotations

from dataclasses import replace

import torch

from shardformer.family import Family, FamilyPolicy, gathered, sequence_mode_refused
from shardformer.layer import DropoutForReplicatedInput, Linear1D_Col, Linear1D_Row, VocabParallelEmbedding1D
from shardformer.layer.replicated import ReplicatedInParallelRegion
from shardformer.layer.sequence_layout import ENTER
from shardformer.layer.sequence_segments import GatherOrderInput, Segments, SegmentSplit
from shardformer.layout import Heads
from shardformer.plan import record_hidden_states, residual_dropout, sequence_region, split_gather_ends
from shardformer.policies.shapes import new_sequence_state, sp_gathering, sp_layer_subs, sp_linear_kwargs, sp_overlap
from shardformer.policy import ModulePolicyDescription, Policy, merge_policies
from shardformer.policy import SubModuleReplacementDescription as Sub


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


def vision_policy(vision_cfg, col: dict | None = None, row: dict | None = None) -> dict:
    """The vision encoder under TP; `col` / `row`: the attention's column / row
    layer kwargs under split-gather SP (sp_linear_kwargs)."""
    heads = _heads(vision_cfg)
    return {
        "Blip2Attention": ModulePolicyDescription(
            attribute_replacement=heads.attributes({"num_heads": "heads"}),
            sub_module_replacement=[Sub("qkv", Linear1D_Col, kwargs={"split": heads.qkv, **(col or {})}),
                                    Sub("projection", Linear1D_Row, kwargs={"split": heads.q, **(row or {})})],
            method_replacement={"forward": vision_attention_forward}),
        "Blip2EncoderLayer": ModulePolicyDescription(sub_module_replacement=[
            Sub("mlp.fc1", Linear1D_Col), Sub("mlp.fc2", Linear1D_Row)]),
    }


def qformer_policy(qformer_cfg, vocab_kwargs: dict) -> dict:
    heads = _heads(qformer_cfg)
    # The text feed-forward (intermediate / output) exists with use_qformer_text_input.
    feed_forward = [Sub("intermediate_query.dense", Linear1D_Col), Sub("output_query.dense", Linear1D_Row),
                    Sub("output_query.dropout", DropoutForReplicatedInput)]
    feed_forward += [Sub(s, cls, ignore_if_not_exist=True) for s, cls in (
        ("intermediate.dense", Linear1D_Col), ("output.dense", Linear1D_Row),
        ("output.dropout", DropoutForReplicatedInput))]
    return {
        # Self and cross attention alike.
        "Blip2QFormerMultiHeadAttention": ModulePolicyDescription(
            attribute_replacement=heads.attributes({"num_attention_heads": "heads", "all_head_size": "width"}),
            sub_module_replacement=[Sub(p, Linear1D_Col, kwargs={"split": heads.q})
                                    for p in ("query", "key", "value")]),
        "Blip2QFormerAttention": ModulePolicyDescription(sub_module_replacement=[
            Sub("output.dense", Linear1D_Row, kwargs={"split": heads.q}),
            Sub("output.dropout", DropoutForReplicatedInput)]),
        "Blip2QFormerLayer": ModulePolicyDescription(sub_module_replacement=feed_forward),
        "Blip2QFormerModel": ModulePolicyDescription(sub_module_replacement=[
            Sub("dropout", DropoutForReplicatedInput)]),
        "Blip2TextEmbeddings": ModulePolicyDescription(sub_module_replacement=[
            Sub("word_embeddings", VocabParallelEmbedding1D, kwargs=vocab_kwargs)]),
    }


def vision_sp_policy(vision_cfg, shard_config) -> dict:
    """vision_policy under split-gather SP (VisionShape's layout, see the module docstring)."""
    col, row = sp_linear_kwargs(shard_config)
    overlap = sp_overlap(shard_config)
    state = new_sequence_state()
    layer = [Sub("mlp.fc1", Linear1D_Col, kwargs=sp_gathering(col) if overlap else col),
             Sub("mlp.fc2", Linear1D_Row, kwargs=row)]
    layer += sp_layer_subs(["self_attn"] + ([] if overlap else ["mlp"]), ["layer_norm1", "layer_norm2"], state)
    policy = vision_policy(vision_cfg, col, row)
    policy["Blip2EncoderLayer"] = ModulePolicyDescription(sub_module_replacement=layer)
    policy["Blip2VisionModel"] = ModulePolicyDescription(
        sub_module_replacement=split_gather_ends("encoder.layers", vision_cfg.num_hidden_layers, state))
    return policy


def qformer_sp_policy(qformer_cfg, vocab_kwargs: dict, shard_config) -> dict:
    """qformer_policy under split-gather SP: the sequence [queries; text] split
    segment by segment (layer/sequence_segments.py, the module docstring)."""
    heads = _heads(qformer_cfg)
    col, row = sp_linear_kwargs(shard_config)
    overlap = sp_overlap(shard_config)
    seg = Segments(("query", "text"))
    dropout = residual_dropout(shard_config)
    qkv = {"split": heads.q}
    # `maybe`: what only some layers hold (the cross attention every cross_attention_frequency layers,
    # the text feed-forward with use_qformer_text_input); the cross attention's key / value read the
    # replicated image features, as under TP
    layer = [Sub(f"attention.attention.{p}", Linear1D_Col, kwargs={**qkv, **col}) for p in ("query", "key", "value")]
    maybe = [Sub("crossattention.attention.query", Linear1D_Col, kwargs={**qkv, **col}),
             Sub("crossattention.attention.key", Linear1D_Col, kwargs=qkv),
             Sub("crossattention.attention.value", Linear1D_Col, kwargs=qkv)]
    for up, down, segment, always in (("intermediate_query", "output_query", "query", True),
                                      ("intermediate", "output", "text", False)):
        subs = [Sub(f"{up}.dense", Linear1D_Col, kwargs=sp_gathering(col) if overlap else col),
                Sub(f"{down}.dense", Linear1D_Row, kwargs=row), Sub(f"{down}.dropout", dropout),
                Sub(f"{down}.LayerNorm", ReplicatedInParallelRegion)]
        if not overlap:
            subs.append(sequence_region(up, ENTER, seg[segment]))
        (layer if always else maybe).extend(subs)
    layer += [sequence_region("attention.attention", ENTER, seg.whole),
              Sub("attention.output", GatherOrderInput, kwargs={"state": seg.whole}),
              Sub("attention.output.LayerNorm", ReplicatedInParallelRegion)]
    maybe += [sequence_region("crossattention.attention", ENTER, seg["query"]),
              Sub("crossattention.output.LayerNorm", ReplicatedInParallelRegion)]
    layer += [replace(s, ignore_if_not_exist=True) for s in maybe]
    n = qformer_cfg.num_hidden_layers
    policy = qformer_policy(qformer_cfg, vocab_kwargs)
    policy["Blip2QFormerMultiHeadAttention"] = ModulePolicyDescription(
        attribute_replacement=heads.attributes({"num_attention_heads": "heads", "all_head_size": "width"}))
    policy["Blip2QFormerAttention"] = ModulePolicyDescription(sub_module_replacement=[
        Sub("output.dense", Linear1D_Row, kwargs={"split": heads.q, **row}), Sub("output.dropout", dropout)])
    policy["Blip2QFormerLayer"] = ModulePolicyDescription(sub_module_replacement=layer)
    policy["Blip2QFormerEncoder"] = ModulePolicyDescription(sub_module_replacement=[
        Sub(f"layer.{i}", SegmentSplit, kwargs={"segments": seg, "first": i == 0, "last": i == n - 1})
        for i in range(n)])
    return policy


class Blip2Shape(FamilyPolicy):
    """Option `parts`: what the model holds ("vision", "qformer"); a
    language_model is composed in when present."""

    parts: tuple[str, ...] = ("vision", "qformer")

    @property
    def pipeline_split(self):
        """Where the stages split (shardformer.pipeline.stages), by what the class holds:

            a vision encoder    its layers (vision_model.encoder.layers) are the stack; the
                                post-layernorm, the Q-Former, the projections and any language
                                model run on the last stage, which every micro-batch's text
                                inputs reach (each stage is given the whole micro-batch)
            a Q-Former only     its layers (encoder.layer); Blip2TextModelWithProjection's
                                text embeddings run on the first stage, its projection on the last

        The query tokens (a Parameter of the model, read by the Q-Former on the last stage) are
        on every stage, their gradient summed over them (zeros but the last's).  docs/pipeline.md
        (BLIP-2) says why the vision encoder, not the language model, is the stack."""
        from shardformer.pipeline.stages import StageSplit

        model = getattr(self, "model", None)
        if model is None or hasattr(model, "vision_model") or type(model).__name__ == "Blip2VisionModel":
            return StageSplit("Blip2VisionModel", "encoder.layers", last=("post_layernorm",),
                              everywhere=("query_tokens",))
        # the Q-Former's encoder loops `for i in range(self.config.num_hidden_layers): self.layer[i]`
        if type(model).__name__ == "Blip2TextModelWithProjection":
            return StageSplit("Blip2TextModelWithProjection", "qformer.encoder.layer", last=("text_projection",),
                              everywhere=("query_tokens",), count="config.num_hidden_layers")
        return StageSplit("Blip2QFormerModel", "encoder.layer", count="config.num_hidden_layers")

    def language_policy(self) -> Policy | None:
        """The registered policy of the language model, bound to it."""
        lm = getattr(self.model, "language_model", None)
        return None if lm is None else self.sub_policy(lm)

    def config_sanity_check(self):
        inner = self.language_policy()
        if inner is not None:
            inner.config_sanity_check()
        self.check_sequence_mode(inner)

    def check_sequence_mode(self, inner: Policy | None) -> None:
        """Refuse all_to_all / ring_attn without a language model, or a mode
        the language model's policy does not implement."""
        cfg = self.shard_config
        if not cfg.enable_sequence_parallelism:
            return
        name, mode = type(self.model).__name__, cfg.sequence_parallelism_mode
        if cfg.sequence_parallel and cfg.pipeline_stage_manager is not None:
            raise NotImplementedError(
                f"{name}: sequence_parallelism_mode='split_gather' with pipeline parallelism is not available: "
                f"the vision encoder's and the Q-Former's layers would be split over the stages while their "
                f"sequence is split at their first layer (docs/sequence-parallelism.md, BLIP-2)")
        if inner is None and mode != "split_gather":
            raise sequence_mode_refused(name, "vision_model / qformer", mode,
                                        f"{mode} applies to the language model, and this class has none "
                                        f"(split_gather splits its vision encoder and Q-Former)")
        if inner is None:
            return
        if mode not in inner.sequence_parallel_modes():
            lm = type(self.model.language_model).__name__
            raise sequence_mode_refused(name, f"language_model ({lm})", mode,
                                        f"{type(inner).__name__} implements "
                                        f"{', '.join(inner.sequence_parallel_modes()) or 'no mode'}")

    def sequence_parallel_modes(self) -> tuple[str, ...]:
        """The language model's modes (split_gather without one)."""
        inner = self.language_policy()
        return ("split_gather",) if inner is None else inner.sequence_parallel_modes()

    def supports_sequence_overlap(self) -> bool:
        inner = self.language_policy()
        return inner is None or inner.supports_sequence_overlap()

    def body_policy(self):
        cfg = self.model.config
        policy = {}
        sp = self.shard_config.sequence_parallel
        if self.tensor_parallel:
            vision, qformer = getattr(cfg, "vision_config", cfg), getattr(cfg, "qformer_config", cfg)
            if "vision" in self.parts:
                merge_policies(policy, vision_sp_policy(vision, self.shard_config) if sp else vision_policy(vision))
            if "qformer" in self.parts:
                merge_policies(policy, qformer_sp_policy(qformer, self.vocab_kwargs(), self.shard_config) if sp
                               else qformer_policy(qformer, self.vocab_kwargs()))
        inner = self.language_policy()
        if inner is not None:
            merge_policies(policy, inner.module_policy())
        return policy

    def preprocess(self):
        inner = self.language_policy()
        if inner is not None:
            inner.preprocess()
        return super().preprocess()

    def postprocess(self):
        """The language model's postprocess, then output_hidden_states=True under
        split-gather SP recording the vision encoder's and Q-Former's full
        sequences (their layers mark their rows: record_hidden_states)."""
        inner = self.language_policy()
        if inner is not None:
            inner.postprocess()
        return record_hidden_states(self, super().postprocess())


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
