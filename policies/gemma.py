"""Gemma: the Llama-shaped decoder (policies/shapes.py DecoderShape) whose embedding
output is scaled by sqrt(hidden_size) (VocabParallelEmbedding1D(embed_scale=...)
applies it after the all-reduce).  Its RMSNorm multiplies by (1 + weight), which
the sharder's fused-norm probe sees, so the norms stay HF's."""
from shardformer.family import Family
from shardformer.policies.shapes import DecoderShape, decoder_heads

FAMILY = Family("gemma", "gemma.modeling_gemma", DecoderShape, options={"prefix": "Gemma", "embed_scale": True},
                heads=decoder_heads("Gemma", qa=False))
globals().update(FAMILY.policy_classes())
