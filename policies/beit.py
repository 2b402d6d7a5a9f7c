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
"""
from __future__ import annotations

from shardformer.family import Family, gathered
from shardformer.layer.param_shard import ShardParams
from shardformer.layout import Heads
from shardformer.policies.shapes import VisionShape, bias_table_split
from shardformer.policy import ModulePolicyDescription
from shardformer.policy import SubModuleReplacementDescription as Sub


class BeitShape(VisionShape):
    """Per-layer bias tables (use_relative_position_bias) or one shared by all
    layers (use_shared_relative_position_bias): whichever the model has.
    Sequence parallelism is refused: BeitLayer sizes its relative position
    bias from its input's length, which would be this rank's rows."""

    split_attention_at = None

    def sequence_parallel_modes(self) -> tuple[str, ...]:
        return ()
    pipeline_split = None        # a bias table may be shared by all layers: not split into stages

    def layer_replacements(self, heads: Heads) -> list[Sub]:
        return super().layer_replacements(heads) + [
            Sub("relative_position_bias", ShardParams, kwargs=bias_table_split(heads.num_heads),
                ignore_if_not_exist=True)]

    def body_policy(self):
        policy = super().body_policy()
        if self.tensor_parallel:
            policy["BeitModel"] = ModulePolicyDescription(sub_module_replacement=[
                Sub("shared_position_bias", ShardParams, kwargs=bias_table_split(self.model.config.num_attention_heads),
                    ignore_if_not_exist=True)])
        return policy


FAMILY = Family("beit", "beit.modeling_beit", BeitShape, options={"prefix": "Beit"}, heads={
    "BeitModel": (),
    "BeitForImageClassification": gathered("classifier"),
    "BeitForMaskedImageModeling": gathered("lm_head"),
    "BeitForSemanticSegmentation": (),
})
globals().update(FAMILY.policy_classes())
