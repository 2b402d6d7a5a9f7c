"""GLM (transformers' GlmModel): the Llama-shaped decoder (policies/shapes.py
DecoderShape) with biased q/k/v and a fused mlp.gate_up_proj ([gate | up] rows),
split as Fused(Split, Split) so each rank keeps its slice of both halves."""
from shardformer.family import Family
from shardformer.policies.shapes import DecoderShape, decoder_heads

FAMILY = Family("glm", "glm.modeling_glm", DecoderShape, options={"prefix": "Glm", "mlp": "fused"},
                heads=decoder_heads("Glm", qa=False))
globals().update(FAMILY.policy_classes())
