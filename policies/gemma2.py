"""Gemma 2: as Gemma (scaled embeddings, (1 + weight) RMSNorms), plus attention
logit soft-capping and pre/post feed-forward norms, which act per head or on the
full hidden state and need no change (policies/shapes.py DecoderShape)."""
from shardformer.family import Family
from shardformer.policies.shapes import DecoderShape, decoder_heads

FAMILY = Family("gemma2", "gemma2.modeling_gemma2", DecoderShape,
                options={"prefix": "Gemma2", "embed_scale": True}, heads=decoder_heads("Gemma2", qa=False))
globals().update(FAMILY.policy_classes())
