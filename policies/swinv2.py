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
Sequence parallelism: refused, see Swinv2Shape.
"""
from __future__ import annotations

from shardformer.family import Family, gathered
from shardformer.layer import DropoutForReplicatedInput, Linear1D_Col, Linear1D_Row
from shardformer.layer.param_shard import ShardParams
from shardformer.layout import Heads
from shardformer.policies.shapes import StageShape
from shardformer.policy import SubModuleReplacementDescription as Sub


class Swinv2Shape(StageShape):
    """Sequence parallelism is refused (every mode): Swinv2Layer is post-norm
    and reads its input twice before any of its modules runs, as the
    residual and, reshaped, as the full (height, width) map it cuts into
    windows; so a block's input cannot be this rank's rows of the sequence
    (Swin's pre-norm block gathers the output of layernorm_before instead:
    StageShape), and gathering it would leave every activation full."""

    def sequence_parallel_modes(self) -> tuple[str, ...]:
        return ()

    def sequence_parallel_refusal(self, mode: str) -> str:
        return (f"{self.encoder_prefix()}.layers.*.blocks.* (Swinv2Layer) is post-norm and reads its input "
                f"as the residual and, reshaped to the full (height, width) map, as the windows' input "
                f"before any of its modules runs: it cannot take one rank's rows ({mode})")

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
