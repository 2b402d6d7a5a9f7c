"""ViT: attention heads and MLP features split over the tensor-parallel group.

    layers.*.attention.{q,k,v}_proj   Linear1D_Col  (per head: rank i computes its heads H_i)
    layers.*.attention.o_proj         Linear1D_Row  (input split by the same heads; all-reduce
                                                     forward, identity backward)
    layers.*.mlp.fc1                  Linear1D_Col
    layers.*.mlp.fc2                  Linear1D_Row
    layers.*.dropout                  DropoutForReplicatedInput
    classifier                        Linear1D_Col, gathered (any label count)

Patch embeddings, layer norms, the pooler and the masked-image-modeling
decoder (a 1x1 convolution) stay replicated.  ViTAttention infers its head
count from the projection width, so no attribute changes per rank.
"""
from __future__ import annotations

from shardformer.layer import DropoutForReplicatedInput, FusedLayerNorm, Linear1D_Col, Linear1D_Row
from shardformer.layout import Heads
from shardformer.policy import ModulePolicyDescription, Policy
from shardformer.policy import SubModuleReplacementDescription as Sub


def _hf():
    from transformers.models.vit import modeling_vit

    return modeling_vit


def attention_subs(prefix: str, heads: Heads) -> list[Sub]:
    """q/k/v/o replacements of a q_proj/k_proj/v_proj/o_proj attention
    (ViT-style modules, shared with BEiT)."""
    return [
        Sub(f"{prefix}.q_proj", Linear1D_Col, kwargs={"split": heads.q}),
        Sub(f"{prefix}.k_proj", Linear1D_Col, kwargs={"split": heads.q}),
        Sub(f"{prefix}.v_proj", Linear1D_Col, kwargs={"split": heads.q}),
        Sub(f"{prefix}.o_proj", Linear1D_Row, kwargs={"split": heads.q}),
    ]


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class ViTPolicy(Policy):
    def module_policy(self):
        hf = _hf()
        cfg = self.model.config
        heads = Heads(cfg.num_attention_heads, cfg.num_attention_heads, head_dim_of(cfg))
        policy = {}
        if self.tensor_parallel:
            policy[hf.ViTLayer] = ModulePolicyDescription(sub_module_replacement=attention_subs("attention", heads) + [
                Sub("mlp.fc1", Linear1D_Col),
                Sub("mlp.fc2", Linear1D_Row),
                Sub("dropout", DropoutForReplicatedInput),
            ])
        if self.shard_config.enable_fused_normalization:
            self.append_or_create_submodule_replacement(
                [Sub("layernorm_before", FusedLayerNorm), Sub("layernorm_after", FusedLayerNorm)], policy, hf.ViTLayer)
        return policy


class ViTModelPolicy(ViTPolicy):
    pass


class ViTForMaskedImageModelingPolicy(ViTPolicy):
    pass


class ViTForImageClassificationPolicy(ViTPolicy):
    def module_policy(self):
        policy = super().module_policy()
        if self.tensor_parallel and self.model.config.num_labels > 0:
            self.append_or_create_submodule_replacement(
                Sub("classifier", Linear1D_Col, kwargs={"gather_output": True}), policy,
                _hf().ViTForImageClassification)
        return policy
