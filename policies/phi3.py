"""Phi-3: the Llama-shaped decoder (policies/shapes.py DecoderShape) with a fused
qkv_proj ([q | k | v] rows, GQA) and a fused gate_up_proj ([gate | up] rows).  Both
are split as Fused specs, so each rank keeps its query heads, its (possibly
replicated) KV heads and its slices of gate and up.

Phi3Attention cuts q from k/v at config.num_attention_heads * head_dim and k
from v at self.num_key_value_heads * head_dim, so each rank's attention gets
its own head counts: num_key_value_heads directly, and a per-rank copy of the
config (shared by all layers of the rank) with num_attention_heads and
num_key_value_heads set to the rank's counts.
"""
from __future__ import annotations

from shardformer.family import Family
from shardformer.policies.shapes import DecoderShape, decoder_heads


class Phi3Shape(DecoderShape):
    head_attributes = {**DecoderShape.head_attributes, "self_attn.num_key_value_heads": "kv_heads",
                       "self_attn.config": "config"}


FAMILY = Family("phi3", "phi3.modeling_phi3", Phi3Shape,
                options={"prefix": "Phi3", "mlp": "fused", "fused_qkv": True}, heads=decoder_heads("Phi3", qa=False))
globals().update(FAMILY.policy_classes())
