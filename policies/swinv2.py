"""Swinv2: cosine window attention heads and MLP features split over the
tensor-parallel group, stage by stage (num_heads[i] heads in stage i).

    encoder.layers.i.blocks.*.attention.self.{query,key,value}   Linear1D_Col (heads of stage i)
    encoder.layers.i.blocks.*.attention.output.dense             Linear1D_Row (all-reduce forward)
    ...attention.self.continuous_position_bias_mlp.2            Linear1D_Col, not gathered: the
        bias MLP's last layer [heads, 512] keeps this rank's head rows, so the MLP yields the
        bias of its own heads; its replicated input layer gets the all-reduced gradient
    ...attention.self (logit_scale [heads, 1, 1])                ShardParams, split by heads
    encoder.layers.i.blocks.*.intermediate.dense                 Linear1D_Col
    encoder.layers.i.blocks.*.output.dense                       Linear1D_Row
    classifier                                                   Linear1D_Col, gathered

Swinv2SelfAttention reshapes with num_attention_heads and all_head_size, so
both become this rank's values.  Patch embeddings, patch merging, norms and
the masked-image-modeling decoder stay replicated.
"""
from __future__ import annotations

from shardformer.layer import (
    DropoutForReplicatedInput,
    FusedLayerNorm,
    Linear1D_Col,
    Linear1D_Row,
)
from shardformer.layer.param_shard import ShardParams
from shardformer.layout import Heads
from shardformer.policy import ModulePolicyDescription, Policy
from shardformer.policy import SubModuleReplacementDescription as Sub

from .swin import stage_heads


def _hf():
    from transformers.models.swinv2 import modeling_swinv2

    return modeling_swinv2


class Swinv2Policy(Policy):
    def module_policy(self):
        hf = _hf()
        cfg = self.model.config
        policy = {}
        if self.tensor_parallel:
            subs, attrs = [], {}
            for i, heads in enumerate(stage_heads(cfg)):
                p = f"layers.{i}.blocks.*"
                per_head = Heads(heads.num_heads, head_dim=1).q
                subs += [
                    Sub(f"{p}.attention.self.query", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub(f"{p}.attention.self.key", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub(f"{p}.attention.self.value", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub(f"{p}.attention.self.continuous_position_bias_mlp.2", Linear1D_Col,
                        kwargs={"split": per_head, "gather_output": False}),
                    Sub(f"{p}.attention.self", ShardParams, kwargs={"params": {"logit_scale": (0, per_head)}}),
                    Sub(f"{p}.attention.output.dense", Linear1D_Row, kwargs={"split": heads.q}),
                    Sub(f"{p}.intermediate.dense", Linear1D_Col),
                    Sub(f"{p}.output.dense", Linear1D_Row),
                    Sub(f"{p}.output.dropout", DropoutForReplicatedInput),
                ]
                for j in range(cfg.depths[i]):
                    a = f"layers.{i}.blocks.{j}.attention.self"
                    attrs[f"{a}.num_attention_heads"] = heads.local_heads()
                    attrs[f"{a}.all_head_size"] = heads.local_width(heads.head_dim)
            policy[hf.Swinv2Encoder] = ModulePolicyDescription(attribute_replacement=attrs,
                                                               sub_module_replacement=subs)
        if self.shard_config.enable_fused_normalization:
            self.append_or_create_submodule_replacement(
                [Sub("layernorm_before", FusedLayerNorm), Sub("layernorm_after", FusedLayerNorm)], policy,
                hf.Swinv2Layer)
        return policy


class Swinv2ModelPolicy(Swinv2Policy):
    pass


class Swinv2ForMaskedImageModelingPolicy(Swinv2Policy):
    pass


class Swinv2ForImageClassificationPolicy(Swinv2Policy):
    def module_policy(self):
        policy = super().module_policy()
        if self.tensor_parallel and self.model.config.num_labels > 0:
            self.append_or_create_submodule_replacement(
                Sub("classifier", Linear1D_Col, kwargs={"gather_output": True}), policy,
                _hf().Swinv2ForImageClassification)
        return policy
