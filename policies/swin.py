"""Swin: window attention heads and MLP features split over the
tensor-parallel group, stage by stage.

Each stage i has its own head count num_heads[i] (and width embed_dim * 2^i),
so the policy lists one set of replacements per stage, keyed on the encoder:

    encoder.layers.i.blocks.*.attention.{q,k,v}_proj   Linear1D_Col (heads of stage i)
    encoder.layers.i.blocks.*.attention.o_proj         Linear1D_Row (all-reduce forward)
    encoder.layers.i.blocks.*.attention.relative_position_bias
                                                       ShardParams: table T [(2W-1)^2, heads]
                                                       split by columns with the heads
    encoder.layers.i.blocks.*.mlp.fc1 / fc2            Linear1D_Col / Linear1D_Row
    encoder.layers.i.blocks.*.dropout                  DropoutForReplicatedInput
    classifier                                         Linear1D_Col, gathered

SwinAttention infers the head count from the projection width and the bias
from the table width; patch embeddings, patch merging, norms and the
masked-image-modeling decoder stay replicated.
"""
from __future__ import annotations

from shardformer.layer import DropoutForReplicatedInput, FusedLayerNorm, Linear1D_Col, Linear1D_Row
from shardformer.layer.param_shard import ShardParams
from shardformer.layout import Heads
from shardformer.policy import ModulePolicyDescription, Policy
from shardformer.policy import SubModuleReplacementDescription as Sub


def _hf():
    from transformers.models.swin import modeling_swin

    return modeling_swin


def stage_heads(cfg) -> list[Heads]:
    """One Heads spec per stage (head_dim from the stage width)."""
    out = []
    for i, n in enumerate(cfg.num_heads):
        width = int(cfg.embed_dim * 2 ** i)
        if width % n:
            raise ValueError(f"stage {i}: width {width} is not a multiple of num_heads={n}")
        out.append(Heads(n, n, width // n))
    return out


class SwinPolicy(Policy):
    def module_policy(self):
        hf = _hf()
        policy = {}
        if self.tensor_parallel:
            subs = []
            for i, heads in enumerate(stage_heads(self.model.config)):
                p = f"layers.{i}.blocks.*"
                table = Heads(heads.num_heads, head_dim=1).q
                subs += [
                    Sub(f"{p}.attention.q_proj", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub(f"{p}.attention.k_proj", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub(f"{p}.attention.v_proj", Linear1D_Col, kwargs={"split": heads.q}),
                    Sub(f"{p}.attention.o_proj", Linear1D_Row, kwargs={"split": heads.q}),
                    Sub(f"{p}.attention.relative_position_bias", ShardParams,
                        kwargs={"params": {"relative_position_bias_table": (1, table)}}),
                    Sub(f"{p}.mlp.fc1", Linear1D_Col),
                    Sub(f"{p}.mlp.fc2", Linear1D_Row),
                    Sub(f"{p}.dropout", DropoutForReplicatedInput),
                ]
            policy[hf.SwinEncoder] = ModulePolicyDescription(sub_module_replacement=subs)
        if self.shard_config.enable_fused_normalization:
            self.append_or_create_submodule_replacement(
                [Sub("layernorm_before", FusedLayerNorm), Sub("layernorm_after", FusedLayerNorm)], policy, hf.SwinLayer)
        return policy


class SwinModelPolicy(SwinPolicy):
    pass


class SwinForMaskedImageModelingPolicy(SwinPolicy):
    pass


class SwinForImageClassificationPolicy(SwinPolicy):
    def module_policy(self):
        policy = super().module_policy()
        if self.tensor_parallel and self.model.config.num_labels > 0:
            self.append_or_create_submodule_replacement(
                Sub("classifier", Linear1D_Col, kwargs={"gather_output": True}), policy,
                _hf().SwinForImageClassification)
        return policy
