"""OPT: attention heads and MLP features split; vocabulary-parallel embedding
and LM head (tied to decoder.embed_tokens when HF tied it, the default).

    decoder.layers.*.self_attn.q_proj, k_proj, v_proj   Linear1D_Col (per head)
    decoder.layers.*.self_attn.out_proj                 Linear1D_Row
    decoder.layers.*.fc1 / fc2                          Linear1D_Col / Linear1D_Row
    decoder.embed_tokens                                VocabParallelEmbedding1D
    lm_head                                             VocabParallelLMHead1D
    score / qa_outputs                                  Linear1D_Col, gathered

OPTAttention reshapes the query by self.num_heads, so that becomes this
rank's head count.  Learned positions and project_in / project_out (when
word_embed_proj_dim != hidden_size) stay replicated.

Split-gather sequence parallelism (the layout above sp_linear_kwargs in policies/shapes.py):
the hidden states are split along the sequence from decoder.layers.0 to
the last layer (gathered after it: final_layer_norm, project_out and the
heads see the full sequence).  self_attn takes layouts ENTER (input
all-gathered, padding dropped: the causal attention and the KV cache see
the whole sequence); the MLP is no module of its own and runs on rows
flattened to [B * S/p, hidden], so fc1 gathers its input rows itself
(Linear1D_Col gather_input=True: all-gather along the rows, backward
reduce-scatter); out_proj and fc2 reduce-scatter their partial sums and add
their bias on this rank's rows.  The layer's residual dropouts are
functional calls with the layer's `dropout`: that becomes 0 and the
probability moves into out_proj / fc2 (Linear1D_Row dropout=p: a mask per
rank, on this rank's rows).  With ShardConfig.enable_sequence_overlap, fc1's
all-gather overlaps its matmul, and backward the reduce-scatter of dX its
dW.  self_attn_layer_norm and final_layer_norm run
on this rank's rows (gradients all-reduced).  Refused with layerdrop > 0
(a skipped first or last layer would skip the split or the gather).
"""
from __future__ import annotations

from shardformer.family import Family, SpecPolicy, spec_capabilities
from shardformer.layer.sequence_layout import ENTER
from shardformer.pipeline.stages import StageSplit
from shardformer.policies.shapes import gpt_heads
from shardformer.spec import (Attribute, Entry, HeadsFrom, ModuleSpec, PolicySpec, Refusal, Region, Setting,
                              SplitGatherSpec)


class OPTShape(SpecPolicy):
    """A spec factory (build_spec(), interpreted by shardformer.plan.interpret):
    the layer's entries (attention_entries(), mlp_entries()), the embedding,
    the split-gather regions; the residual dropout probability is read from
    the bound model's config."""

    split_attention_at = ("OPTDecoder", "layers")
    pipeline_split = StageSplit("OPTDecoder", "layers", last=("final_layer_norm", "project_out"))

    sp_modes = ("split_gather",)
    sequence_overlap = True                 # fc1 gathers its own rows (Entry sp="gather_rows")

    def attention_entries(self) -> tuple[Entry, ...]:
        """q / k / v by heads, out_proj by the same heads."""
        return (Entry("self_attn.q_proj", "colwise_heads"), Entry("self_attn.k_proj", "colwise_heads"),
                Entry("self_attn.v_proj", "colwise_heads"), Entry("self_attn.out_proj", "rowwise_heads"))

    def mlp_entries(self) -> tuple[Entry, ...]:
        """fc1 (gathering its own input rows under SP: the MLP is no module) and fc2."""
        return Entry("fc1", "colwise", sp="gather_rows"), Entry("fc2", "rowwise")

    def build_spec(self) -> PolicySpec:
        entries = self.attention_entries() + self.mlp_entries()
        p = float(getattr(self.model.config, "dropout", 0.0) or 0.0)
        if p:        # under split-gather SP the row layers draw the layer's residual dropout on their rows
            drop, sp = (("dropout", p),), ("sequence_parallel",)
            entries += tuple(Entry(e.suffix, e.style, sp, kwargs=drop) for e in entries if e.style.startswith("row"))
        attributes = (Attribute("self_attn.num_heads", "heads"), Setting("dropout", 0.0, ("sequence_parallel",)))
        return PolicySpec(
            name=self.family.name if self.family is not None else "opt",
            modules=(ModuleSpec("OPTDecoderLayer", entries, attributes, sp_linear="rows"),
                     ModuleSpec("OPTDecoder", (Entry("embed_tokens", "embedding_rowwise"),))),
            heads=HeadsFrom(kv_heads=None, head_dim=None),
            split_gather=SplitGatherSpec("OPTDecoder", "layers", "OPTDecoderLayer", (Region("self_attn", ENTER),),
                                         overlap=False, skip=("self_attn", "fc1", "fc2")),
            capabilities=spec_capabilities(self),
            refusals=(Refusal("layerdrop", allowed=(0, None), default=0.0, when=("sequence_parallel",),
                              error="NotImplementedError",
                              message="{model}: sequence parallelism (split_gather) with layerdrop={value} is not "
                                      "available (set layerdrop=0)"),),
        )


FAMILY = Family("opt", "opt.modeling_opt", OPTShape, heads=gpt_heads("OPT", token=False))
globals().update(FAMILY.policy_classes())
