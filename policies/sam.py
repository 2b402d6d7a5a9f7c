"""SAM (Segment Anything): the vision encoder's heads and MLP features and the
mask decoder's two-way transformer split over the tensor-parallel group.

    vision_encoder.layers.*.attn.qkv        Linear1D_Col, split Fused(q, k, v) per head: the
                                            fused rows are [q | k | v], each [heads x head_dim]
    vision_encoder.layers.*.attn.proj       Linear1D_Row (input split by the same heads)
    vision_encoder.layers.*.attn            rel_pos_h / rel_pos_w [2S-1, head_dim] are shared by
                                            all heads: kept whole on every rank (each rank adds
                                            them to its own heads' scores), their gradients
                                            all-reduced (ReplicatedInParallelRegion)
    vision_encoder.layers.*.mlp.lin1 / lin2 Linear1D_Col / Linear1D_Row
    mask_decoder SamAttention.{q,k,v}_proj  Linear1D_Col (per head; the cross attentions work in
                                            hidden / attention_downsample_rate, so head_dim is
                                            read from each projection's width)
    mask_decoder SamAttention.out_proj      Linear1D_Row
    mask_decoder layers.*.mlp.lin1 / lin2   Linear1D_Col / Linear1D_Row

Heads need not divide the group (5 heads on 2 ranks: 3, 2); every rank needs
at least one head.  Both attentions reshape by self.num_attention_heads, so it
becomes this rank's head count.  The prompt encoder, the positional
embeddings (tied between shared_image_embedding and the prompt encoder), the
vision neck, the mask decoder's output tokens, upscaling convolutions and
hypernetwork / IoU MLPs are small and stay replicated.

SamVisionModel is the vision encoder alone (its config is the vision
config); SamModel adds the mask decoder (config.mask_decoder_config).
"""
from __future__ import annotations

from shardformer.family import Family, FamilyPolicy
from shardformer.layer import Linear1D_Col, Linear1D_Row
from shardformer.layer.replicated import ReplicatedInParallelRegion
from shardformer.layout import Heads
from shardformer.policy import ModulePolicyDescription
from shardformer.policy import SubModuleReplacementDescription as Sub


def vision_layer_description(vision_cfg) -> ModulePolicyDescription:
    """SamVisionLayer: fused-qkv attention with decomposed relative positions, MLP."""
    n = vision_cfg.num_attention_heads
    heads = Heads(n, n, vision_cfg.hidden_size // n)
    subs = [
        Sub("attn.qkv", Linear1D_Col, kwargs={"split": heads.qkv}),
        Sub("attn.proj", Linear1D_Row, kwargs={"split": heads.q}),
        Sub("mlp.lin1", Linear1D_Col),
        Sub("mlp.lin2", Linear1D_Row),
    ]
    if vision_cfg.use_rel_pos:
        subs.append(Sub("attn", ReplicatedInParallelRegion, kwargs={"params": ("rel_pos_h", "rel_pos_w")}))
    return ModulePolicyDescription(attribute_replacement={"attn.num_attention_heads": heads.local_heads()},
                                   sub_module_replacement=subs)


def mask_decoder_policy(decoder_cfg) -> dict:
    """The mask decoder's two-way transformer.  One head count for every
    SamAttention; head_dim differs between the self attention (hidden / n)
    and the downsampled cross attentions."""
    heads = Heads(decoder_cfg.num_attention_heads)
    return {
        "SamAttention": ModulePolicyDescription(
            attribute_replacement={"num_attention_heads": heads.local_heads()},
            sub_module_replacement=[Sub(f"{p}_proj", Linear1D_Col, kwargs={"split": heads.q}) for p in "qkv"] + [
                Sub("out_proj", Linear1D_Row, kwargs={"split": heads.q})]),
        "SamTwoWayAttentionBlock": ModulePolicyDescription(sub_module_replacement=[
            Sub("mlp.lin1", Linear1D_Col), Sub("mlp.lin2", Linear1D_Row)]),
    }


class SamShape(FamilyPolicy):
    def body_policy(self):
        if not self.tensor_parallel:
            return {}
        cfg = self.model.config
        policy = {"SamVisionLayer": vision_layer_description(getattr(cfg, "vision_config", cfg))}
        if hasattr(cfg, "mask_decoder_config"):
            policy.update(mask_decoder_policy(cfg.mask_decoder_config))
        return policy


FAMILY = Family("sam", "sam.modeling_sam", SamShape, heads={"SamModel": (), "SamVisionModel": ()})
globals().update(FAMILY.policy_classes())
