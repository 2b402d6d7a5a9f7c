"""Llama: the Llama-shaped decoder (policies/shapes.py DecoderShape): attention
heads (grouped-query KV heads replicated when fewer than ranks) and MLP features
split, embeddings and the LM head split by vocabulary, classifier heads gathered."""
from shardformer.family import Family
from shardformer.policies.shapes import DecoderShape, decoder_heads

FAMILY = Family("llama", "llama.modeling_llama", DecoderShape, options={"prefix": "Llama"},
                heads=decoder_heads("Llama"))
globals().update(FAMILY.policy_classes())
