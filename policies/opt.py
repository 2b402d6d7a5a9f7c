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

Split-gather sequence parallelism (policies/shapes.py, sp_linear_kwargs):
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

from shardformer.family import Family, FamilyPolicy
from shardformer.layout import Heads
from shardformer.pipeline.stages import StageSplit
from shardformer.plan import PlanContext, realize, split_gather_ends
from shardformer.policies.shapes import (SplitGatherMixin, attention_by_heads, gpt_heads, new_sequence_state,
                                         parameterized_children, sp_layer_subs, sp_linear_kwargs, sp_overlap)
from shardformer.policy import ModulePolicyDescription


class OPTShape(SplitGatherMixin, FamilyPolicy):
    split_attention_at = ("OPTDecoder", "layers")
    pipeline_split = StageSplit("OPTDecoder", "layers", last=("final_layer_norm", "project_out"))

    sp_modes = ("split_gather",)

    def config_sanity_check(self):
        super().config_sanity_check()
        layerdrop = getattr(self.model.config, "layerdrop", 0.0)
        if self.shard_config.sequence_parallel and layerdrop:
            raise NotImplementedError(f"{type(self.model).__name__}: sequence parallelism (split_gather) with "
                                      f"layerdrop={layerdrop} is not available (set layerdrop=0)")

    def body_policy(self):
        if not self.tensor_parallel:
            return {}
        cfg = self.model.config
        n = cfg.num_attention_heads
        heads = Heads(n, n, cfg.hidden_size // n)
        sp = self.shard_config.sequence_parallel
        col, row = sp_linear_kwargs(self.shard_config)
        if sp and cfg.dropout:       # the layer's functional residual dropouts move into the row layers
            row = {**row, "dropout": float(cfg.dropout)}
        attributes = heads.attributes({"self_attn.num_heads": "heads"})
        up = {**col, "gather_input": True, "overlap": sp_overlap(self.shard_config)} if sp else {}
        ctx = PlanContext(self)
        layer_subs = [*attention_by_heads("self_attn", heads, o="out_proj", col=col, row=row),
                      *realize({"fc1": "colwise", "fc2": "rowwise"}, ctx, row=row, extra={"fc1": up})]
        decoder_subs = realize({"embed_tokens": "embedding_rowwise"}, ctx)
        if sp:
            state = new_sequence_state()
            layers = [m for m in self.model.modules() if type(m).__name__ == "OPTDecoderLayer"]
            norms = parameterized_children(layers[0], skip=("self_attn", "fc1", "fc2"))
            attributes["dropout"] = 0.0
            layer_subs += sp_layer_subs(["self_attn"], norms, state)
            decoder_subs += split_gather_ends("layers", len(layers), state)
        return {
            "OPTDecoderLayer": ModulePolicyDescription(attribute_replacement=attributes,
                                                       sub_module_replacement=layer_subs),
            "OPTDecoder": ModulePolicyDescription(sub_module_replacement=decoder_subs),
        }


FAMILY = Family("opt", "opt.modeling_opt", OPTShape, heads=gpt_heads("OPT", token=False))
globals().update(FAMILY.policy_classes())
