"""BEiT: ViT-style attention and MLP split over the tensor-parallel group,
with relative position bias tables split by the same heads.

    layers.*.attention.{q,k,v}_proj        Linear1D_Col (per head)
    layers.*.attention.o_proj              Linear1D_Row
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

from shardformer.layer import DropoutForReplicatedInput, FusedLayerNorm, Linear1D_Col, Linear1D_Row
from shardformer.layer.param_shard import ShardParams
from shardformer.layout import Heads
from shardformer.policy import ModulePolicyDescription, Policy
from shardformer.policy import SubModuleReplacementDescription as Sub

from .vit import attention_subs, head_dim_of


def _hf():
    from transformers.models.beit import modeling_beit

    return modeling_beit


class BeitPolicy(Policy):
    def module_policy(self):
        hf = _hf()
        cfg = self.model.config
        heads = Heads(cfg.num_attention_heads, cfg.num_attention_heads, head_dim_of(cfg))
        bias = {"params": {"relative_position_bias_table": (1, Heads(cfg.num_attention_heads, head_dim=1).q)}}
        policy = {}
        if self.tensor_parallel:
            policy[hf.BeitLayer] = ModulePolicyDescription(sub_module_replacement=attention_subs("attention", heads) + [
                Sub("mlp.fc1", Linear1D_Col),
                Sub("mlp.fc2", Linear1D_Row),
                Sub("dropout", DropoutForReplicatedInput),
                Sub("relative_position_bias", ShardParams, kwargs=bias, ignore_if_not_exist=True),
            ])
            policy[hf.BeitModel] = ModulePolicyDescription(sub_module_replacement=[
                Sub("shared_position_bias", ShardParams, kwargs=bias, ignore_if_not_exist=True)])
        if self.shard_config.enable_fused_normalization:
            self.append_or_create_submodule_replacement(
                [Sub("layernorm_before", FusedLayerNorm), Sub("layernorm_after", FusedLayerNorm)], policy, hf.BeitLayer)
        return policy


class BeitModelPolicy(BeitPolicy):
    pass


class BeitForSemanticSegmentationPolicy(BeitPolicy):
    pass


class _BeitHeadPolicy(BeitPolicy):
    model_class = ""
    head = ""

    def module_policy(self):
        policy = super().module_policy()
        if self.tensor_parallel:
            self.append_or_create_submodule_replacement(
                Sub(self.head, Linear1D_Col, kwargs={"gather_output": True}), policy,
                getattr(_hf(), self.model_class))
        return policy


class BeitForImageClassificationPolicy(_BeitHeadPolicy):
    model_class, head = "BeitForImageClassification", "classifier"


class BeitForMaskedImageModelingPolicy(_BeitHeadPolicy):
    model_class, head = "BeitForMaskedImageModeling", "lm_head"
