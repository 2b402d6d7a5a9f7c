"""BEiT: the ViT-style vision layer (policies/shapes.py VisionShape) with
relative position bias tables split by the same heads.

    layers.*.attention.{q,k,v}_proj        Linear1D_Col (per head)
    layers.*.attention.o_proj              Linear1D_Row (all-reduce forward)
    layers.*.mlp.fc1 / fc2                 Linear1D_Col / Linear1D_Row
    layers.*.relative_position_bias        ShardParams: table T [distances, heads] split by
    shared_position_bias                   columns (heads); rank i builds the bias of its heads
                                           H_i only, which its local scores need (no collective)
    layers.*.dropout                       DropoutForReplicatedInput
    classifier                             Linear1D_Col, gathered
    lm_head (visual-token vocabulary)      Linear1D_Col, gathered (HF's loss reads full logits)

Layer scales (lambda_1, lambda_2), norms, patch embeddings and the
segmentation decode heads (convolutions) stay replicated.  BeitAttention
infers its head count from the projection width; the bias tables from their
own width.

Split-gather sequence parallelism (VisionShape's layout: the S = patches + 1
tokens split along the sequence from layers.0 to the last layer, padded to a
multiple of p; attention and mlp all-gather their input, backward
reduce-scatter; o_proj and fc2 reduce-scatter their partial sums, backward
all-gather, and add their bias on this rank's rows).  The relative position
bias [1, heads_i, S, S] is built for the full length, as the attention's
gathered q/k/v need: the per-layer tables from the image resolution, the
shared one in BeitModel before the split; BeitLayer's dim_size (the
interpolation target with interpolate_pos_encoding) becomes the full S
(FullLengthKwarg), not this rank's rows.  On this rank's rows: the dropout
(a mask per rank), the layer scales lambda_1 / lambda_2 and the norms (their
gradients all-reduced), drop path and the residual adds.  all_to_all and
ring_attn are refused (split_attention_at None): the bias is added to
[S, S] scores that those modes never build.

Pipeline parallelism: the layers split like ViT's (layernorm and pooler on
the last stage).  The shared bias table (use_shared_relative_position_bias)
is computed in BeitModel before the layers and added to every layer's
scores: it is placed on every stage (StageSplit.everywhere), each stage
runs it, and its gradient, which on each stage holds that stage's layers'
contributions, is summed over the stages after backward.
BeitForSemanticSegmentation's decode head reads several layers' hidden
states: they travel to the last stage in the messages (StageSplit.reads).
"""
from __future__ import annotations

from dataclasses import replace

from shardformer.family import Family, gathered, spec_capabilities, spec_stage_split
from shardformer.pipeline.stages import StageSplit
from shardformer.policies.shapes import VisionShape
from shardformer.spec import Entry, Hook, PolicySpec, Refusal


class BeitShape(VisionShape):
    """Per-layer bias tables (use_relative_position_bias) or one shared by all
    layers (use_shared_relative_position_bias): whichever the model has.
    Split-gather SP as the module docstring says; all_to_all / ring_attn
    refused by name (no split_attention_at)."""

    split_attention_at = None

    pipeline_split = property(spec_stage_split)       # the spec's StageSplit (capabilities())

    def decode_reads(self) -> tuple[int, ...]:
        """The hidden states a decode head reads (BeitForSemanticSegmentation.forward:
        encoder_hidden_states[i - 1] for i in config.out_indices); none without one."""
        return tuple(i - 1 for i in self.model.config.out_indices) if hasattr(self.model, "decode_head") else ()

    def capabilities(self):
        """The layers split over the stages like ViT's; the shared bias table
        (use_shared_relative_position_bias: BeitModel.shared_position_bias,
        built before the layers and added to every layer's scores) runs on
        every stage, its gradients summed over them; the hidden states a
        decode head reads (decode_reads()) travel to the last stage in the
        messages (StageSplit.reads)."""
        return spec_capabilities(self, pipeline_split=StageSplit(
            "{prefix}Model", "layers", last=("layernorm", "pooler"), everywhere=("shared_position_bias",),
            reads=self.decode_reads()))

    def build_spec(self) -> PolicySpec:
        """VisionShape's spec; with a decode head, split-gather SP under
        pipeline stages refused (a Refusal row): the hidden states it reads
        would travel as each rank's rows."""
        spec, reads = super().build_spec(), self.decode_reads()
        if not reads:
            return spec
        return replace(spec, refusals=spec.refusals + (Refusal(
            "", when=("pipeline_stages", "model:decode_head", "mode:split_gather"), error="NotImplementedError",
            message=(f"{{model}}: pipeline parallelism with sequence parallelism ({{mode}}) is not available: the "
                     f"hidden states {sorted(set(reads))} of {self.base_prefix()}.layers that the decode head reads "
                     f"would travel as each rank's rows, and the head needs whole ones (docs/pipeline.md)")),))

    def sp_norms(self, layer) -> list[str]:
        # the bias table is split by heads (ShardParams): complete per rank, no all-reduce
        return [n for n in super().sp_norms(layer) if n != "relative_position_bias"]

    def sequence_parallel_refusal(self, mode: str) -> str:
        return (f"{self.base_prefix()}.layers.*.attention adds a relative position bias [heads, S, S] to "
                f"the full scores, which {mode} never builds (it splits the sequence inside the attention)")

    def layer_params(self) -> tuple[str, ...]:
        """Under split-gather SP: the layer scales layers.*.lambda_1 / lambda_2
        (parameters of each layer, with layer_scale_init_value > 0) multiply
        this rank's rows, so their gradients are all-reduced."""
        return ("lambda_1", "lambda_2")

    def base_prefix(self) -> str:
        return next(name for name, m in self.model.named_modules() if type(m).__name__ == "BeitModel")

    def layer_entries(self):
        """VisionShape's, the bias table split by heads and, under split-gather
        SP, told the full length (dim_size) on top of that (a Hook row)."""
        return super().layer_entries() + (
            Entry("relative_position_bias", "bias_table_heads", optional=True),
            Hook("relative_position_bias", "full_length_kwarg", (("name", "dim_size"),), optional=True))

    def model_entries(self):
        return (Entry("shared_position_bias", "bias_table_heads", optional=True),)


FAMILY = Family("beit", "beit.modeling_beit", BeitShape, options={"prefix": "Beit"}, heads={
    "BeitModel": (),
    "BeitForImageClassification": gathered("classifier"),
    "BeitForMaskedImageModeling": gathered("lm_head"),
    "BeitForSemanticSegmentation": (),
})
globals().update(FAMILY.policy_classes())
