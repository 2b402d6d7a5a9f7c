"""Swinv2: the Swin-style vision stages (policies/shapes.py StageShape) with
Swinv2's cosine window attention block: heads and MLP features split over the
tensor-parallel group, stage by stage (num_heads[i] heads in stage i).

    encoder.layers.i.blocks.*.attention.self.{query,key,value}   Linear1D_Col (heads of stage i)
    encoder.layers.i.blocks.*.attention.output.dense             Linear1D_Row (all-reduce forward)
    ...attention.self.continuous_position_bias_mlp.2            Linear1D_Col, not gathered: the
        bias MLP's last layer [heads, 512] keeps this rank's head rows, so the MLP yields the
        bias of its own heads; its replicated input layer gets the all-reduced gradient
    ...attention.self (logit_scale [heads, 1, 1])                ShardParams, split by heads
    encoder.layers.i.blocks.*.intermediate.dense                 Linear1D_Col
    encoder.layers.i.blocks.*.output.dense                       Linear1D_Row
    encoder.layers.i.blocks.*.output.dropout                     DropoutForReplicatedInput
    classifier                                                   Linear1D_Col, gathered (none
                                                                 with num_labels=0)

Swinv2SelfAttention reshapes with num_attention_heads and all_head_size, so
both become this rank's values (set per block).  Patch embeddings, patch
merging, norms and the masked-image-modeling decoder stay replicated.
Split-gather sequence parallelism, per stage (Swinv2Shape): the layers'
hidden states between the blocks of a stage are this rank's rows; each
block runs whole, as under plain TP.
"""
from __future__ import annotations

from shardformer.family import Family, gathered
from shardformer.layer import DropoutForReplicatedInput, Linear1D_Col, Linear1D_Row
from shardformer.layer.param_shard import ShardParams
from shardformer.layout import Heads
from shardformer.policies.shapes import StageShape
from shardformer.policy import SubModuleReplacementDescription as Sub


class Swinv2Shape(StageShape):
    """Split-gather sequence parallelism, stage by stage, with whole blocks.
    Swinv2Layer is post-norm: it reads its input X [B, H*W, C] twice before
    any of its modules runs, as the residual and, viewed as the (H, W) map,
    as the windows' input; no module boundary inside it sees the sequence
    in order before the residual add.  So each block runs on the full
    sequence, the same on every rank of the TP group (its column / row
    layers as plain TP: copy_to_tp_region in, all-reduce out), and the
    hidden states between the blocks of a stage are this rank's rows
    (S padded to S', a multiple of p, rows [r S'/p, (r+1) S'/p)):

        blocks.0            output cut to this rank's rows ("split_output";
                            backward: all-gather of the rows' gradients)
        blocks.1 .. d-2     input all-gathered ("gather_input"; backward:
                            this rank's rows of the gradient, which every
                            rank computed in full and alike), output cut
        blocks.d-1          input all-gathered; output full, for patch
                            merging (the 2 x 2 neighbours of the map)

    Forward and backward are plain TP's inside each block; what is split is
    the activation kept between blocks (1/p of it).  A stage of one block
    has nothing between blocks and runs as plain TP.  all_to_all / ring_attn
    and enable_sequence_overlap are refused (StageShape)."""

    def stage_sp_subs(self, i: int, depth: int) -> list[Sub]:
        """The roles of stage i's blocks (paths under the encoder); no norm
        gradient all-reduce: every parameter sees the full sequence."""
        from shardformer.layer.sequence import SequenceParallelRegion, SequenceState

        state = SequenceState()         # one per stage: each has its own length
        roles = [()] * depth
        if depth > 1:
            roles = [("split_output",)] + [("gather_input", "split_output")] * (depth - 2) + [("gather_input",)]
        return [Sub(f"layers.{i}.blocks.{j}", SequenceParallelRegion, kwargs={"role": role, "state": state})
                for j, role in enumerate(roles) if role]

    def block_replacements(self, heads: Heads) -> list[Sub]:
        per_head = Heads(heads.num_heads, head_dim=1).q
        return [
            Sub("attention.self.query", Linear1D_Col, kwargs={"split": heads.q}),
            Sub("attention.self.key", Linear1D_Col, kwargs={"split": heads.q}),
            Sub("attention.self.value", Linear1D_Col, kwargs={"split": heads.q}),
            Sub("attention.self.continuous_position_bias_mlp.2", Linear1D_Col,
                kwargs={"split": per_head, "gather_output": False}),
            Sub("attention.self", ShardParams, kwargs={"params": {"logit_scale": (0, per_head)}}),
            Sub("attention.output.dense", Linear1D_Row, kwargs={"split": heads.q}),
            Sub("intermediate.dense", Linear1D_Col),
            Sub("output.dense", Linear1D_Row),
            Sub("output.dropout", DropoutForReplicatedInput),
        ]

    def block_attributes(self, heads: Heads) -> dict:
        return {"attention.self.num_attention_heads": heads.local_heads(),
                "attention.self.all_head_size": heads.local_width(heads.head_dim)}


FAMILY = Family("swinv2", "swinv2.modeling_swinv2", Swinv2Shape, options={"prefix": "Swinv2"}, heads={
    "Swinv2Model": (),
    "Swinv2ForImageClassification": gathered("classifier"),
    "Swinv2ForMaskedImageModeling": (),
})
globals().update(FAMILY.policy_classes())
