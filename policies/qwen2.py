"""Qwen2: the Llama-shaped decoder (policies/shapes.py DecoderShape) with biased
q/k/v projections, each bias split with its rows."""
from shardformer.family import Family
from shardformer.policies.shapes import DecoderShape, decoder_heads

FAMILY = Family("qwen2", "qwen2.modeling_qwen2", DecoderShape, options={"prefix": "Qwen2"},
                heads=decoder_heads("Qwen2"))
globals().update(FAMILY.policy_classes())
