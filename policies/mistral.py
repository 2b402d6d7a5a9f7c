"""Mistral: the Llama-shaped decoder (policies/shapes.py DecoderShape); the
sliding window acts per head and needs no change."""
from shardformer.family import Family
from shardformer.policies.shapes import DecoderShape, decoder_heads

FAMILY = Family("mistral", "mistral.modeling_mistral", DecoderShape, options={"prefix": "Mistral"},
                heads=decoder_heads("Mistral"))
globals().update(FAMILY.policy_classes())
