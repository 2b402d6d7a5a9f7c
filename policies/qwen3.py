"""Qwen3: the Llama-shaped decoder (policies/shapes.py DecoderShape) with per-head
RMSNorms on q and k: they act on head_dim, so they stay replicated (their
gradients all-reduced)."""
from shardformer.family import Family
from shardformer.policies.shapes import DecoderShape, decoder_heads

FAMILY = Family("qwen3", "qwen3.modeling_qwen3", DecoderShape, options={"prefix": "Qwen3", "qk_norm": True},
                heads=decoder_heads("Qwen3"))
globals().update(FAMILY.policy_classes())
