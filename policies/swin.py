"""Swin: the Swin-style vision stages (policies/shapes.py StageShape): window
attention heads and MLP features split over the tensor-parallel group,
stage by stage.

Each stage i has its own head count num_heads[i] (and width embed_dim * 2^i),
so the policy lists one set of replacements per stage, keyed on the encoder:

    encoder.layers.i.blocks.*.attention.{q,k,v}_proj   Linear1D_Col (heads of stage i)
    encoder.layers.i.blocks.*.attention.o_proj         Linear1D_Row (all-reduce forward)
    encoder.layers.i.blocks.*.attention.relative_position_bias
                                                       ShardParams: table T [(2W-1)^2, heads]
                                                       split by columns with the heads
    encoder.layers.i.blocks.*.mlp.fc1 / fc2            Linear1D_Col / Linear1D_Row
    encoder.layers.i.blocks.*.dropout                  DropoutForReplicatedInput
    classifier                                         Linear1D_Col, gathered (none with
                                                       num_labels=0: an nn.Identity)

SwinAttention infers the head count from the projection width and the bias
from the table width; patch embeddings, patch merging, norms and the
masked-image-modeling decoder stay replicated.

Split-gather sequence parallelism: per stage (StageShape's layout): each
stage's patch tokens are split along the sequence between its first and
last block; patch merging, the final norm, the pooler and the heads run on
the full sequence; inside a block the windowed attention reads the gathered
(H, W) map.  all_to_all / ring_attn are refused.  enable_sequence_overlap:
q/k/v of the map computed during the gather, then reordered into the
windows (StageShape, layer/window_overlap.py).
"""
from shardformer.family import Family, gathered
from shardformer.policies.shapes import StageShape

FAMILY = Family("swin", "swin.modeling_swin", StageShape, options={"prefix": "Swin"}, heads={
    "SwinModel": (),
    "SwinForImageClassification": gathered("classifier"),
    "SwinForMaskedImageModeling": (),
})
globals().update(FAMILY.policy_classes())
